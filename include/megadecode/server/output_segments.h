// One choice's output cut into the segments a structured API returns:
// think-channel text (Kimi K3), answer text, and each tool call, in the order the model wrote
// them. The Responses API makes them output items (responses_output.cpp), the Anthropic Messages
// API content blocks (anthropic_output.cpp); both take the same cut from here, streamed or not.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "megadecode/server/engine_loop.h"
#include "megadecode/server/tool_calls.h"
#include "megadecode/tokenizer/chat_template.h"

namespace md::server {

class OutputSegments {
 public:
  enum class Kind { kNone, kReasoning, kText, kCall };

  // What the segments become. begin: a segment starts (`call`: a tool call's id and name);
  // delta: its next piece of text (a call's: of its arguments), with the logprobs of the tokens
  // whose text it is (answer text only); end: it is done (`cut`: the output ended by length).
  struct Sink {
    virtual ~Sink() = default;
    virtual void begin(Kind kind, const ToolCallPiece* call) = 0;
    virtual void delta(Kind kind, const std::string& text, std::vector<TokenLogprob> lps) = 0;
    virtual void end(Kind kind, bool cut) = 0;
  };

  // `tools`: the request declared tools, so tool-call markup in the answer (`format`'s) becomes
  // calls; `id_prefix`: ids of calls the format does not name (tool_calls.h).
  OutputSegments(Sink& sink, bool tools, TemplateKind format, std::string id_prefix);
  // It holds its sink (usually its owner): neither copied nor moved.
  OutputSegments(const OutputSegments&) = delete;
  OutputSegments& operator=(const OutputSegments&) = delete;

  void add(ChoiceEvent& e);  // one engine event, in order
  void finish();             // after the last event: the open segment ends

  Kind open() const { return open_; }
  const std::string& text() const { return text_; }  // the open segment's text so far
  const std::string& finish_reason() const { return finish_reason_; }
  const std::string& stop_string() const { return stop_string_; }
  const std::string& error() const { return error_; }
  size_t calls() const { return calls_; }
  int64_t prompt_tokens() const { return prompt_tokens_; }
  int64_t completion_tokens() const { return completion_tokens_; }
  int64_t cached_tokens() const { return cached_tokens_; }
  // Tokens whose text went to the think channel (an event's tokens count there when it released
  // reasoning and no answer text).
  int64_t reasoning_tokens() const { return reasoning_tokens_; }

 private:
  void piece(Kind kind, const std::string& text, std::vector<TokenLogprob> lps);
  void start(Kind kind, const ToolCallPiece* call);
  void content(ToolCallDelta d);

  Sink& sink_;
  std::optional<ToolCallStream> tools_;
  Kind open_ = Kind::kNone;
  std::string text_;
  std::vector<TokenLogprob> pending_lps_;  // tokens whose text has not come out yet
  std::string finish_reason_, stop_string_, error_;
  bool finished_ = false;
  size_t calls_ = 0;
  int64_t prompt_tokens_ = 0, completion_tokens_ = 0, cached_tokens_ = 0, reasoning_tokens_ = 0;
};

}  // namespace md::server
