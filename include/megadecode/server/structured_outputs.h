// vLLM's structured outputs: a request field that fixes the shape of the whole answer, on
// /v1/completions and /v1/chat/completions alike (vLLM's `StructuredOutputsParams`):
//
//   "structured_outputs": {"json": SCHEMA}        one JSON value following SCHEMA (a schema
//                                                 object, or its JSON text; any root type)
//   "structured_outputs": {"json_object": true}   one JSON object
//   "structured_outputs": {"regex": PATTERN}      text that PATTERN matches as a whole
//   "structured_outputs": {"choice": [S, ...]}    exactly one of the strings
//   "structured_outputs": {"grammar": GBNF}       text of the grammar's `root` (engine/grammar.h;
//                                                 without recursion, engine/gbnf.h's automaton)
//
// and the same as the top-level fields vLLM had before 0.12 (`guided_json`, `guided_regex`,
// `guided_choice`, `guided_grammar`; `guided_decoding_backend` is accepted and ignored) and
// llama.cpp's `grammar`. At most one of them. Not enforced, so refused with a 400 naming them:
// `structural_tag`, `whitespace_pattern`, `disable_any_whitespace` and
// `disable_additional_properties` set. Patterns are the ECMAScript subset of
// engine/json_regex.h, run as engine/regex_dfa.h.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "megadecode/engine/token_constraint.h"

namespace md::server {

struct StructuredOutput {
  ConstraintElement body;  // the answer's element (kJson, kRegex or kName)
  std::string param;       // the field it came from, for errors about it
};

// What the request asks for (nullopt: nothing). Throws ApiError naming the field at fault.
std::optional<StructuredOutput> parse_structured_outputs(const nlohmann::json& request);

}  // namespace md::server
