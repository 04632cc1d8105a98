// vLLM's structured outputs as a constraint element (server/structured_outputs.h).
#include "megadecode/server/structured_outputs.h"

#include <fmt/format.h>

#include <algorithm>

#include "json_fields.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/gbnf.h"
#include "megadecode/engine/grammar.h"
#include "megadecode/engine/json_regex.h"
#include "megadecode/engine/json_schema.h"
#include "megadecode/engine/regex_dfa.h"

namespace md::server {

using namespace detail;  // NOLINT(google-build-using-namespace): the field getters
using Kind = ConstraintElement::Kind;

namespace {

// A JSON value following `schema` (an object, or its JSON text; vLLM's `json` takes any schema:
// an array or a string at the root too).
ConstraintElement json_element(const json& schema, const std::string& param) {
  json s = schema;
  if (schema.is_string()) {
    try {
      s = json::parse(schema.get<std::string>());
    } catch (const json::exception& e) {
      throw invalid_field(param, fmt::format("'{}' is not valid JSON: {}", param, e.what()));
    }
  }
  if (!s.is_object() && !s.is_boolean())
    throw invalid_field(param, fmt::format("'{}' must be a JSON Schema object", param),
                        "invalid_type");
  ConstraintElement e;
  e.kind = Kind::kJson;
  e.any_value = true;
  try {
    e.schema = JsonSchema::compile(s, /*any_root=*/true);
  } catch (const Error& err) {
    throw invalid_field(param, err.what());
  }
  return e;
}

ConstraintElement regex_element(const json& v, const std::string& param) {
  const std::string pattern = as_string(v, param);
  ConstraintElement e;
  e.kind = Kind::kRegex;
  try {
    e.regex = RegexDfa::compile(pattern);
  } catch (const Error& err) {
    throw invalid_field(param, err.what());
  }
  return e;
}

// A GBNF grammar: with recursion, the grammar element (engine/grammar.h); without, written out
// as one pattern and run as the regex element (engine/gbnf.h), whose masks are cheaper.
ConstraintElement grammar_element(const json& v, const std::string& param) {
  const std::string grammar = as_string(v, param);
  ConstraintElement e;
  try {
    std::shared_ptr<const Grammar> g = Grammar::compile_gbnf(grammar);
    if (g->recursive()) {
      e.kind = Kind::kGrammar;
      e.grammar = std::move(g);
    } else {
      e.kind = Kind::kRegex;
      e.regex = compile_gbnf(grammar);
    }
  } catch (const Error& err) {
    throw invalid_field(param, err.what());
  }
  return e;
}

ConstraintElement choice_element(const json& v, const std::string& param) {
  if (!v.is_array() || v.empty())
    throw invalid_field(param, fmt::format("'{}' must be a non-empty list of strings", param),
                        "invalid_type");
  if (v.size() > 4096)
    throw invalid_field(
        param, fmt::format("'{}' has {} entries; at most 4096 are allowed", param, v.size()));
  ConstraintElement e;
  e.kind = Kind::kName;
  for (size_t i = 0; i < v.size(); ++i) {
    std::string s = as_string(v[i], fmt::format("{}.{}", param, i));
    if (s.empty()) throw invalid_field(param, fmt::format("'{}.{}' is an empty string", param, i));
    e.names.push_back(std::move(s));
  }
  std::sort(e.names.begin(), e.names.end());
  e.names.erase(std::unique(e.names.begin(), e.names.end()), e.names.end());
  return e;
}

bool set_true(const json& obj, const char* name) {
  const json* v = field(obj, name);
  if (!v) return false;
  if (!v->is_boolean())
    throw invalid_field(name, fmt::format("'{}' must be a boolean", name), "invalid_type");
  return v->get<bool>();
}

}  // namespace

std::optional<StructuredOutput> parse_structured_outputs(const json& request) {
  std::optional<StructuredOutput> out;
  auto take = [&](std::string param, ConstraintElement e) {
    if (out)
      throw invalid_field(param, fmt::format("'{}' and '{}' both constrain the output; give one",
                                             out->param, param));
    out = StructuredOutput{std::move(e), std::move(param)};
  };
  if (const json* so = field(request, "structured_outputs")) {
    if (!so->is_object())
      throw invalid_field("structured_outputs", "'structured_outputs' must be an object",
                          "invalid_type");
    for (const auto& [key, value] : so->items()) {
      const std::string param = "structured_outputs." + key;
      if (value.is_null()) continue;
      if (key == "json") {
        take(param, json_element(value, param));
      } else if (key == "regex") {
        take(param, regex_element(value, param));
      } else if (key == "choice") {
        take(param, choice_element(value, param));
      } else if (key == "json_object") {
        if (set_true(*so, "json_object")) {  // one object, as response_format's json_object
          ConstraintElement e;
          e.kind = Kind::kJson;
          take(param, std::move(e));
        }
      } else if (key == "grammar") {
        take(param, grammar_element(value, param));
      } else if (key == "structural_tag" || key == "whitespace_pattern") {
        throw invalid_field(param,
                            fmt::format("'{}' is not supported (megadecode enforces json, "
                                        "json_object, regex, choice and grammar)",
                                        param),
                            "unsupported_parameter");
      } else if (key == "disable_any_whitespace" || key == "disable_additional_properties") {
        if (set_true(*so, key.c_str()))
          throw invalid_field(param, fmt::format("'{}': true is not supported", param),
                              "unsupported_parameter");
      } else if (key == "disable_fallback") {
        set_true(*so, key.c_str());  // (one backend here: nothing to fall back from)
      } else {
        throw invalid_field(param, fmt::format("unknown field '{}'", param));
      }
    }
  }
  // The fields vLLM had before 0.12.
  if (const json* v = field(request, "guided_json"))
    take("guided_json", json_element(*v, "guided_json"));
  if (const json* v = field(request, "guided_regex"))
    take("guided_regex", regex_element(*v, "guided_regex"));
  if (const json* v = field(request, "guided_choice"))
    take("guided_choice", choice_element(*v, "guided_choice"));
  if (const json* v = field(request, "guided_grammar"))
    take("guided_grammar", grammar_element(*v, "guided_grammar"));
  // llama.cpp's server field.
  if (const json* v = field(request, "grammar")) take("grammar", grammar_element(*v, "grammar"));
  reject_if_given(request, "guided_whitespace_pattern", "JSON whitespace is not configurable");
  if (const json* b = field(request, "guided_decoding_backend"))
    as_string(*b, "guided_decoding_backend");  // (one backend here)
  return out;
}

}  // namespace md::server
