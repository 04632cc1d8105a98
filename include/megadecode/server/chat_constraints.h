// What a chat request asks of the shape of its output, enforced while decoding as constraint
// programs (engine/token_constraint.h): `tool_choice` in the model's own tool-call markup, so the
// calls come out as the model writes them and the tool-call parser (server/tool_calls.h) reads
// them back; `response_format` json_object / json_schema as one JSON object; and vLLM's
// structured outputs (server/structured_outputs.h) in the same place.
//
//   none      no tool-call section may start (Kimi: <|tool_calls_section_begin|> and
//             <|tool_call_begin|> never drawn; K3: no <|open|>tools)
//   required  the output's tool calls: one or more calls of the declared functions, each with a
//             JSON object as its arguments, then the end of the section and of the message
//   named     the same with exactly one call, of that function
//   auto      nothing enforced (no program)
// Where the calls go: Kimi Linear / K2 writes the section first thing; K3 writes it after its
// response channel closes (<|close|>response<|sep|>), so thinking and the response come first,
// free, and K3's calls take the template's JSON-block form (<|open|>json type="object"<|sep|>).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megadecode/engine/token_constraint.h"
#include "megadecode/tokenizer/chat_template.h"

namespace md {
class Tokenizer;
}

namespace md::server {

struct ToolChoice {
  enum class Mode { kAuto, kNone, kRequired, kNamed };
  Mode mode = Mode::kAuto;
  std::string name;  // kNamed: the function
  // false (parallel_tool_calls false, Anthropic's disable_parallel_tool_use): kRequired makes
  // exactly one call, as kNamed always does. (kAuto has no program: not enforced there.)
  bool parallel = true;
};

// The program for `choice` (null for kAuto). `names`: the declared functions (kRequired may call
// any of them); `stop_ids`: what may end the message after the calls (empty: anything may follow);
// `args`: each function's arguments' schema (its `parameters`; empty or null entries: any
// object), in the order of `names`, enforced on the calls of that function.
std::shared_ptr<const ConstraintProgram> tool_choice_program(
    TemplateKind format, const ToolChoice& choice, std::vector<std::string> names,
    const Tokenizer& tokenizer, const std::vector<int32_t>& stop_ids,
    std::vector<std::shared_ptr<const JsonSchema>> args = {});

// response_format {"type": "json_object"} or {"type": "json_schema", ...}: the answer is one JSON
// object, following `schema` when there is one (json_schema's, engine/json_schema.h). Kimi Linear /
// K2: the whole output, then a stop id (stop_ids; none: anything may follow). K3: its response
// channel's text, after thinking when the generation prompt opened the think channel (`thinking`),
// then the channel closes.
std::shared_ptr<const ConstraintProgram> json_object_program(
    TemplateKind format, bool thinking, const Tokenizer& tokenizer,
    const std::vector<int32_t>& stop_ids, std::shared_ptr<const JsonSchema> schema = nullptr);

// The same for any answer element `body` (a JSON object, a regex, one of given names:
// server/structured_outputs.h): where json_object_program puts its object, `body` goes.
std::shared_ptr<const ConstraintProgram> structured_output_program(
    TemplateKind format, bool thinking, const Tokenizer& tokenizer,
    const std::vector<int32_t>& stop_ids, ConstraintElement body);

}  // namespace md::server
