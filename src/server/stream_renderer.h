// What a streamed response's events become on the wire (private to src/server). SseStream
// (sse_stream.h) moves the bytes; a renderer turns the engine's events of one request into
// server-sent events in the shape of the endpoint: chat and completion chunks (chat_stream.cpp)
// or the Responses API's typed events (responses_stream.cpp). A renderer is used under its
// stream's mutex, from whichever thread delivers the events.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "megadecode/base/util.h"
#include "megadecode/server/anthropic_api.h"
#include "megadecode/server/engine_loop.h"
#include "megadecode/server/request.h"
#include "megadecode/server/responses.h"
#include "megadecode/server/responses_api.h"
#include "megadecode/server/tool_calls.h"

namespace md::server {

// What the access log reports of a stream.
struct StreamTotals {
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  double first_token = 0;  // steady seconds of the first generated token (0: none yet)
};

class StreamRenderer {
 public:
  virtual ~StreamRenderer() = default;
  virtual std::string start() = 0;                // before any event
  virtual std::string event(ChoiceEvent& e) = 0;  // one engine event (may be empty text)
  virtual std::string end() = 0;                  // after the request's last event
  const StreamTotals& totals() const { return totals_; }

 protected:
  StreamTotals totals_;
};

// /v1/completions and /v1/chat/completions chunks: `data: {chunk}` lines, the usage chunk with
// include_usage, then `data: [DONE]`.
class ChatStreamRenderer : public StreamRenderer {
 public:
  ChatStreamRenderer(CompletionRequest req, ResponseMeta meta, const Tokenizer& tok,
                     size_t choices);
  std::string start() override;
  std::string event(ChoiceEvent& e) override;
  std::string end() override;

 private:
  // Choice i's template of a chunk that carries only text (ChunkTemplate), made at first use.
  const ChunkTemplate& plain_chunk(size_t i);

  const CompletionRequest req_;
  const ResponseMeta meta_;
  const Tokenizer& tok_;
  std::vector<size_t> text_offset_;    // completions logprobs: text sent so far per choice
  std::vector<ToolCallStream> tools_;  // chat with tools: each choice's tool-call parser
  std::vector<bool> echoed_;           // completions echo: the prompt text has been sent
  std::vector<ChunkTemplate> plain_;   // per choice (plain_chunk)
};

// A renderer over an output builder (ResponseBuilder, MessageBuilder: open(), add(), finish(),
// take_events(), segments()): the builder renders, this counts for the access log; `on_end`
// runs after the finish (the Responses API stores the response there).
template <class Builder>
class BuilderStreamRenderer : public StreamRenderer {
 public:
  // The builder is made in place from `args` (it holds a reference to itself: no copy, no move).
  template <class... Args>
  explicit BuilderStreamRenderer(std::function<void(const Builder&)> on_end, Args&&... args)
      : b_(std::forward<Args>(args)...), on_end_(std::move(on_end)) {}
  std::string start() override { return b_.open(); }
  std::string event(ChoiceEvent& e) override {
    if (!e.tokens.empty() && totals_.first_token == 0) totals_.first_token = now_seconds();
    b_.add(e);
    totals_.prompt_tokens = b_.segments().prompt_tokens();
    totals_.completion_tokens = b_.segments().completion_tokens();
    totals_.cached_tokens = b_.segments().cached_tokens();
    return b_.take_events();
  }
  std::string end() override {
    b_.finish();
    if (on_end_) on_end_(b_);
    return b_.take_events();
  }

 private:
  Builder b_;
  std::function<void(const Builder&)> on_end_;
};

// The Responses API's typed events (responses_output.cpp): response.created and in_progress, the
// output items' events, then response.completed / incomplete / failed (no [DONE], as OpenAI's
// stream ends). With the request's `store`, the finished response goes into `store`.
std::unique_ptr<StreamRenderer> responses_stream_renderer(
    std::shared_ptr<const ResponsesRequest> req, ResponseMeta meta, const Tokenizer& tok,
    std::shared_ptr<ResponseStore> store);

// The Anthropic Messages API's events (anthropic_output.cpp): message_start, ping, the content
// blocks' events, message_delta, message_stop (or an error event).
std::unique_ptr<StreamRenderer> messages_stream_renderer(std::shared_ptr<const MessagesRequest> req,
                                                         ResponseMeta meta);

}  // namespace md::server
