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
//  - in a section, a call starts once its header is complete (Kimi: <|tool_call_begin|>ID
//    <|tool_call_argument_begin|>; K3: <|open|>call tool="NAME" index="N"<|sep|>): its id and
//    name go out at once, then its arguments in pieces as they come: Kimi's ARGS verbatim (a tail
//    that may begin a marker waits), K3's typed arguments one member at a time ({"k": v, then
//    , "k2": v2, closed by }; {} for none), K3's json block verbatim;
//  - a call ends at its end markup (<|tool_call_end|>; <|close|>call<|sep|>). When what follows
//    cannot continue it (another Kimi marker in ARGS; a K3 item that is malformed, of the wrong
//    type, a repeated key, or not the call's end after a json block) or the output ends, the call
//    ends there with the arguments it has (K3's typed ones closed with }), and the rest of the
//    output is content, verbatim;
//  - markup that cannot be a call header (an unknown tag or attribute, text where a call must
//    start) makes the rest of the output content, verbatim from the end of the last call (from
//    the section's opening marker when there was none); so does a section still open when the
//    output ends.
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

// A piece of a call, as a stream's delta carries it.
struct ToolCallPiece {
  size_t index = 0;       // the call's position among the choice's calls
  bool first = false;     // the call's first piece: id and name are set
  std::string id, name;
  std::string arguments;  // the next piece of the call's arguments text
};
// The delta's "tool_calls" entry: {"index", "id", "type", "function": {"name", "arguments"}} for a
// first piece, {"index", "function": {"arguments"}} for the others.
nlohmann::json tool_call_piece_json(const ToolCallPiece& piece);
// The calls that pieces make, added to `calls` (a first piece starts a call).
void add_pieces(std::vector<ParsedToolCall>& calls, const std::vector<ToolCallPiece>& pieces);

struct ToolCallDelta {
  std::string content;               // text to release as content
  std::vector<ToolCallPiece> pieces;  // in order; one per call at most
};

class ToolCallStream {
 public:
  ToolCallStream(TemplateKind format, std::string id_prefix);
  // The next piece of generated text (any split, even inside a marker or a UTF-8 character).
  ToolCallDelta feed(std::string_view text);
  // The output ended: whatever is still held is content.
  ToolCallDelta finish();
  size_t calls() const { return calls_; }  // calls started so far

 private:
  enum class Mode { kContent, kSection, kCall, kBroken };
  void run(ToolCallDelta& out, bool at_end);
  // Inside a call (its header out): false when more text is needed.
  bool run_kimi_call(ToolCallDelta& out, bool at_end);
  bool run_k3_call(ToolCallDelta& out, bool at_end);
  void emit(ToolCallDelta& out, std::string_view arguments);
  void end_call(ToolCallDelta& out, Mode next);
  TemplateKind format_;
  std::string id_prefix_;
  Mode mode_ = Mode::kContent;
  // Text not released yet. In a section it starts where the released output ends (the opening
  // marker, or the end of the last call), and `pos_` is where the next call may start; in a call
  // it starts at what the call has not consumed.
  std::string buf_;
  size_t pos_ = 0;
  size_t calls_ = 0;
  // The K3 call under way: a json block (raw_) and whether it closed, or the typed arguments
  // released and their keys.
  bool raw_ = false, raw_done_ = false;
  size_t arguments_ = 0;
  std::vector<std::string> keys_;
};

struct ToolCallSplit {
  std::string content;
  std::vector<ParsedToolCall> calls;
};
ToolCallSplit split_tool_calls(TemplateKind format, std::string_view text,
                               const std::string& id_prefix = "call_");

}  // namespace md::server
