// Typed access to the fields of a request body: each getter names the field in its ApiError.
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "megadecode/server/chat_constraints.h"
#include "megadecode/server/request.h"
#include "megadecode/server/structured_outputs.h"

namespace md::server::detail {

using nlohmann::json;

inline const char* type_name(const json& v) {
  return v.type_name();
}

// The field, or nullptr when absent or null.
inline const json* field(const json& obj, const char* name) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

inline int64_t as_int(const json& v, const std::string& param, int64_t lo, int64_t hi) {
  if (!v.is_number_integer())
    throw invalid_field(param,
                        fmt::format("'{}' must be an integer, not {}", param,
                                    v.is_number() ? "a fractional number" : type_name(v)),
                        "invalid_type");
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    throw invalid_field(param, fmt::format("'{}' is out of range", param));
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    throw invalid_field(param, fmt::format("'{}' is {}; it must be in [{}, {}]", param, x, lo, hi));
  return x;
}

inline int64_t get_int(const json& obj, const char* name, int64_t lo, int64_t hi, int64_t def) {
  const json* v = field(obj, name);
  return v ? as_int(*v, name, lo, hi) : def;
}

// A number in [lo, hi] (open at lo when lo_open).
inline double get_number(const json& obj, const char* name, double lo, double hi, double def,
                         bool lo_open = false) {
  const json* v = field(obj, name);
  if (!v) return def;
  if (!v->is_number())
    throw invalid_field(name, fmt::format("'{}' must be a number, not {}", name, type_name(*v)),
                        "invalid_type");
  const double x = v->get<double>();
  if (x < lo || x > hi || (lo_open && x == lo))
    throw invalid_field(name, fmt::format("'{}' is {}; it must be in {}{}, {}]", name, x,
                                          lo_open ? "(" : "[", lo, hi));
  return x;
}

inline bool get_bool(const json& obj, const char* name, bool def) {
  const json* v = field(obj, name);
  if (!v) return def;
  if (!v->is_boolean())
    throw invalid_field(name, fmt::format("'{}' must be a boolean, not {}", name, type_name(*v)),
                        "invalid_type");
  return v->get<bool>();
}

inline std::string as_string(const json& v, const std::string& param) {
  if (!v.is_string())
    throw invalid_field(param, fmt::format("'{}' must be a string, not {}", param, type_name(v)),
                        "invalid_type");
  return v.get<std::string>();
}

inline void reject_if_given(const json& obj, const char* name, const char* why) {
  if (field(obj, name))
    throw invalid_field(name, fmt::format("'{}' is not supported: {}", name, why),
                        "unsupported_parameter");
}

inline void check_ids(const std::vector<int32_t>& ids, const std::string& param, int64_t vocab) {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw invalid_field(
          param,
          fmt::format("token id {} (at {}) is outside the vocabulary [0, {})", ids[i], i, vocab));
}

inline std::vector<int32_t> as_ids(const json& v, const std::string& param, int64_t vocab) {
  if (!v.is_array())
    throw invalid_field(param, fmt::format("'{}' must be a list of token ids", param),
                        "invalid_type");
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    ids.push_back(int32_t(as_int(v[i], param + "." + std::to_string(i), 0, vocab - 1)));
  return ids;
}

// Shared by the completions and chat parsers (request.cpp).
void parse_common(const json& j, const ParseContext& ctx, CompletionRequest& r);
std::vector<std::pair<int32_t, float>> parse_logit_bias(const json& lb, const ParseContext& ctx);
void parse_length(const json& j, const ParseContext& ctx, CompletionRequest& r, int def);
void final_check(CompletionRequest& r);

// A chat request's parts, read from a /v1/chat/completions body (chat_request.cpp) or translated
// from a /v1/responses one (responses_request.cpp).
struct ChatParts {
  std::vector<ChatMessage> messages;
  std::vector<json> tools;  // {"type": "function", "function": {"name", ...}}
  ChatOptions options;
  ToolChoice choice;
  std::optional<StructuredOutput> structured;
  bool add_generation_prompt = true;
  // The final assistant message's text, continued rather than closed (vLLM's
  // continue_final_message, Anthropic's prefill): `messages` lacks it, and its tokens follow
  // the generation prompt. The output is the continuation.
  std::optional<std::string> prefill;
  std::string prefill_param;  // the field it came from, for errors about it
};
// The rest of a chat request, once parse_common has read `j`'s sampling fields into `r`: the
// prompt the template renders, max_tokens against the context (`j`'s), and the constraint the
// tool choice, response_format or structured outputs ask for.
void finish_chat_request(const json& j, const ParseContext& ctx, CompletionRequest& r,
                         ChatParts parts);

// For the endpoints translated onto the chat request (responses_request.cpp,
// anthropic_request.cpp; translated_fields.cpp):
// A content list's text: a string, or parts whose `type` is one of `allowed`, their `text`s
// joined by newlines (as the chat parser joins text parts).
std::string parts_text(const json& content, const std::string& param,
                       std::initializer_list<const char*> allowed);
// obj[name] as a string, required (the error names param.name).
std::string required_string(const json& obj, const char* name, const std::string& param);
// An error of the chat parser's fields spelled as the endpoint spells them: the first (from, to)
// whose `from` is the error's param or a dotted prefix of it is replaced (in the message too,
// where it is quoted), and "tools.N.function.parameters" becomes "tools.N." + `tool_schema`.
ApiError renamed(ApiError e, std::initializer_list<std::pair<std::string, std::string>> names,
                 const std::string& tool_schema);

}  // namespace md::server::detail
