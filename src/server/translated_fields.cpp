// Helpers of the endpoints translated onto the chat request (json_fields.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "json_fields.h"

namespace md::server::detail {

std::string parts_text(const json& c, const std::string& param,
                       std::initializer_list<const char*> allowed) {
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array())
    throw invalid_field(param,
                        fmt::format("'{}' must be a string or a list of content parts", param),
                        "invalid_type");
  std::string text;
  for (size_t i = 0; i < c.size(); ++i) {
    const std::string p = param + "." + std::to_string(i);
    const json& part = c[i];
    if (!part.is_object())
      throw invalid_field(p, fmt::format("'{}' must be a content part object", p), "invalid_type");
    const std::string t = required_string(part, "type", p);
    if (std::none_of(allowed.begin(), allowed.end(), [&](const char* a) { return t == a; }))
      throw invalid_field(p + ".type",
                          fmt::format("content part type '{}' is not supported here (only text: "
                                      "{})",
                                      t, fmt::join(allowed, ", ")),
                          "unsupported_parameter");
    if (i) text += "\n";
    text += required_string(part, "text", p);
  }
  return text;
}

std::string required_string(const json& obj, const char* name, const std::string& param) {
  const json* v = field(obj, name);
  if (!v)
    throw invalid_field(param + "." + name, fmt::format("'{}.{}' is required", param, name),
                        "missing_required_parameter");
  return as_string(*v, param + "." + name);
}

ApiError renamed(ApiError e, std::initializer_list<std::pair<std::string, std::string>> names,
                 const std::string& tool_schema) {
  for (const auto& [from, to] : names) {
    if (e.param.compare(0, from.size(), from) != 0 ||
        (e.param.size() != from.size() && e.param[from.size()] != '.'))
      continue;
    e.param = to + e.param.substr(from.size());
    for (size_t at = 0; (at = e.message.find("'" + from, at)) != std::string::npos; at += to.size())
      e.message.replace(at + 1, from.size(), to);
    break;
  }
  if (e.param.rfind("tools.", 0) == 0) {
    const size_t at = e.param.find(".function.parameters");
    if (at != std::string::npos)
      e.param.replace(at + 1, std::string("function.parameters").size(), tool_schema);
  }
  return e;
}

}  // namespace md::server::detail
