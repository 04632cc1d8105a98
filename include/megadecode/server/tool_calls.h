// Tool calls in generated chat text, for both Kimi formats: the inverse of how the chat templates
// (src/tokenizer/chat_template.cpp, chat_template_k3.cpp) render an assistant message's calls.
//
//   Kimi Linear / K2 (TemplateKind::kKimi):
//     <|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS
//     <|tool_call_end|>...<|tool_calls_section_end|>
//     ID is "functions.NAME:N" and becomes the call's id; ARGS is the arguments text verbatim.
//   Kimi K3 XTML (TemplateKind::kKimiK3), as TokenTextStream shows it (channel markup dropped):
//     <|open|>tools<|sep|><|open|>call tool="NAME" index="N"<|sep|>
//       <|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>...
//     <|close|>call<|sep|>...<|close|>tools<|sep|>
//     The typed arguments become one JSON object (string values as they are, the others parsed as
//     JSON of their TYPE), serialised as Python's json.dumps writes it ({"k": "v", "n": 1});
//     a call of a raw <|open|>json type="object"<|sep|>TEXT<|close|>json<|sep|> block has TEXT as
//     its arguments; a call without arguments "{}". The format carries no ids: call k of a
//     choice gets `id_prefix` + k.
//
// The same state machine serves whole and streamed responses (split_tool_calls is one feed and a
// finish), so the streamed deltas concatenate to the non-streamed message. The rule:
//  - text outside a tool-call section is content, released at once except a trailing piece that
//    could be the start of the section's opening marker;
//  - inside a section, the text of a call is held until the call is complete, then the call is
//    released (whole: name and arguments in one piece) and its markup dropped;
//  - markup that cannot be a call (an unknown tag or attribute, a value of the wrong type, text
//    where a call must start) makes the rest of the output content, verbatim from the end of the
//    last complete call (from the section's opening marker when there was none); so does a
//    section still open when the output ends (the model stopped mid-call).
// Whitespace between calls and between K3 arguments is accepted and dropped with the markup.
// Limitation: the parse is of text, so a string value holding the literal text "<|close|>" (or,
// for Kimi, a marker's text) ends it early; real markup tokens and such text decode alike.
#pragma once
#include <cstddef>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/tokenizer/chat_template.h"

namespace md::server {

struct ParsedToolCall {
  std::string id, name, arguments;
};

// An OpenAI tool_call object ({"id", "type": "function", "function": {"name", "arguments"}}),
// with "index" for a stream's delta.
nlohmann::json tool_call_json(const ParsedToolCall& call, std::optional<size_t> index = {});

struct ToolCallDelta {
  std::string content;                // text to release as content
  std::vector<ParsedToolCall> calls;  // calls completed by this piece, in order
};

class ToolCallStream {
 public:
  ToolCallStream(TemplateKind format, std::string id_prefix);
  // The next piece of generated text (any split, even inside a marker or a UTF-8 character).
  ToolCallDelta feed(std::string_view text);
  // The output ended: whatever is still held is content.
  ToolCallDelta finish();
  size_t calls() const { return calls_; }  // complete calls so far

 private:
  enum class Mode { kContent, kSection, kBroken };
  void run(ToolCallDelta& out, bool at_end);
  TemplateKind format_;
  std::string id_prefix_;
  Mode mode_ = Mode::kContent;
  // Text not released yet. In a section it starts where the released output ends (the opening
  // marker, or the end of the last complete call), and `pos_` is where the next call may start.
  std::string buf_;
  size_t pos_ = 0;
  size_t calls_ = 0;
};

struct ToolCallSplit {
  std::string content;
  std::vector<ParsedToolCall> calls;
};
ToolCallSplit split_tool_calls(TemplateKind format, std::string_view text,
                               const std::string& id_prefix = "call_");

}  // namespace md::server
