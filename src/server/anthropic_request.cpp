// /v1/messages bodies -> the chat request the engine runs (server/anthropic_api.h). The
// Messages fields are read here with errors naming them; the sampling fields and the chat tail
// are the chat parser's, run on a translated body, their errors renamed back.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <optional>

#include "json_fields.h"
#include "megadecode/base/error.h"
#include "megadecode/server/anthropic_api.h"
#include "megadecode/text/generator.h"

namespace md::server {

using nlohmann::json;
using namespace detail;

json anthropic_error(const ApiError& e) {
  std::string type = "invalid_request_error";
  if (e.status == 401) type = "authentication_error";
  if (e.status == 403) type = "permission_error";
  if (e.status == 404) type = "not_found_error";
  if (e.status == 413) type = "request_too_large";
  if (e.status == 429) type = "rate_limit_error";
  if (e.status == 503) type = "overloaded_error";
  if (e.status >= 500 && e.status != 503) type = "api_error";
  // Anthropic's errors have no `param`: the message names the field.
  std::string message = e.message;
  if (!e.param.empty() && message.find(e.param) == std::string::npos)
    message = e.param + ": " + message;
  return {{"type", "error"}, {"error", {{"type", type}, {"message", message}}}};
}

namespace {

// A user message's blocks: text (joined into a user message), tool results (a tool message
// each), in order. Images and documents are refused.
void user_blocks(const json& content, const std::string& p, std::vector<ChatMessage>& out) {
  if (content.is_string()) {
    out.push_back({"user", content.get<std::string>(), "", "", {}, ""});
    return;
  }
  if (!content.is_array())
    throw invalid_field(p, fmt::format("'{}' must be a string or a list of content blocks", p),
                        "invalid_type");
  bool open_text = false;  // the last message is this turn's user text, more text joins it
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string b = p + "." + std::to_string(i);
    const json& block = content[i];
    if (!block.is_object())
      throw invalid_field(b, fmt::format("'{}' must be a content block object", b), "invalid_type");
    const std::string type = required_string(block, "type", b);
    if (type == "text") {
      const std::string text = required_string(block, "text", b);
      if (open_text) {
        out.back().content += "\n" + text;
      } else {
        out.push_back({"user", text, "", "", {}, ""});
        open_text = true;
      }
    } else if (type == "tool_result") {
      ChatMessage m;
      m.role = "tool";
      m.tool_call_id = required_string(block, "tool_use_id", b);
      if (const json* c = field(block, "content"))
        m.content = parts_text(*c, b + ".content", {"text"});
      if (get_bool(block, "is_error", false)) m.content = "Error: " + m.content;
      out.push_back(std::move(m));
      open_text = false;
    } else {
      throw invalid_field(b + ".type",
                          fmt::format("content blocks of type '{}' are not supported in user "
                                      "messages (text and tool_result are)",
                                      type),
                          "unsupported_parameter");
    }
  }
}

// An assistant message's blocks: text (content), thinking (reasoning), tool_use (calls, their
// `input` object as the arguments' JSON text).
ChatMessage assistant_blocks(const json& content, const std::string& p) {
  ChatMessage m;
  m.role = "assistant";
  if (content.is_string()) {
    m.content = content.get<std::string>();
    return m;
  }
  if (!content.is_array())
    throw invalid_field(p, fmt::format("'{}' must be a string or a list of content blocks", p),
                        "invalid_type");
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string b = p + "." + std::to_string(i);
    const json& block = content[i];
    if (!block.is_object())
      throw invalid_field(b, fmt::format("'{}' must be a content block object", b), "invalid_type");
    const std::string type = required_string(block, "type", b);
    if (type == "text") {
      if (!m.content.empty()) m.content += "\n";
      m.content += required_string(block, "text", b);
    } else if (type == "thinking") {
      m.reasoning += required_string(block, "thinking", b);
    } else if (type == "redacted_thinking") {
      // Encrypted by another provider: nothing a template can render.
    } else if (type == "tool_use") {
      ToolCall call;
      call.id = required_string(block, "id", b);
      call.name = required_string(block, "name", b);
      const json* in = field(block, "input");
      if (!in || !in->is_object())
        throw invalid_field(b + ".input", fmt::format("'{}.input' must be an object", b),
                            in ? "invalid_type" : "missing_required_parameter");
      call.arguments = in->dump(-1, ' ', false, json::error_handler_t::replace);
      m.tool_calls.push_back(std::move(call));
    } else {
      throw invalid_field(b + ".type",
                          fmt::format("content blocks of type '{}' are not supported in "
                                      "assistant messages (text, thinking and tool_use are)",
                                      type),
                          "unsupported_parameter");
    }
  }
  return m;
}

// The conversation: `system`, then the messages. A final assistant message is a prefill: the
// model continues its text (`prefill`; its thinking and tool calls are refused).
std::vector<ChatMessage> parse_conversation(const json& j, std::optional<std::string>& prefill) {
  std::vector<ChatMessage> out;
  if (const json* s = field(j, "system"))
    out.push_back({"system", parts_text(*s, "system", {"text"}), "", "", {}, ""});
  const json* ms = field(j, "messages");
  if (!ms) throw invalid_field("messages", "'messages' is required", "missing_required_parameter");
  if (!ms->is_array())
    throw invalid_field("messages", "'messages' must be a list of messages", "invalid_type");
  if (ms->empty()) throw invalid_field("messages", "'messages' must not be empty");
  for (size_t i = 0; i < ms->size(); ++i) {
    const std::string p = "messages." + std::to_string(i);
    const json& m = (*ms)[i];
    if (!m.is_object())
      throw invalid_field(p, fmt::format("'{}' must be a message object", p), "invalid_type");
    const std::string role = required_string(m, "role", p);
    const json* content = field(m, "content");
    if (!content)
      throw invalid_field(p + ".content", fmt::format("'{}.content' is required", p),
                          "missing_required_parameter");
    if (role == "user") {
      user_blocks(*content, p + ".content", out);
    } else if (role == "assistant") {
      ChatMessage a = assistant_blocks(*content, p + ".content");
      if (i + 1 == ms->size()) {
        if (!a.tool_calls.empty() || !a.reasoning.empty())
          throw invalid_field(p, "a final assistant message (a prefill) may hold text only",
                              "unsupported_parameter");
        // Anthropic trims the prefill's trailing whitespace.
        while (!a.content.empty() && std::isspace(static_cast<unsigned char>(a.content.back())))
          a.content.pop_back();
        prefill = a.content;
        continue;
      }
      out.push_back(std::move(a));
    } else {
      throw invalid_field(p + ".role",
                          fmt::format("unknown role '{}' (expected user or assistant)", role));
    }
  }
  return out;
}

// Custom tools ({"name", "description", "input_schema"}) -> the chat form.
std::vector<json> parse_tools(const json& j) {
  std::vector<json> tools;
  const json* t = field(j, "tools");
  if (!t) return tools;
  if (!t->is_array()) throw invalid_field("tools", "'tools' must be a list", "invalid_type");
  for (size_t i = 0; i < t->size(); ++i) {
    const std::string p = "tools." + std::to_string(i);
    const json& tool = (*t)[i];
    if (!tool.is_object())
      throw invalid_field(p, fmt::format("'{}' must be a tool object", p), "invalid_type");
    if (const json* type = field(tool, "type"))
      if (as_string(*type, p + ".type") != "custom")
        throw invalid_field(p + ".type",
                            fmt::format("tools of type '{}' are not supported (only custom "
                                        "tools with an input_schema)",
                                        type->get<std::string>()),
                            "unsupported_parameter");
    json fn = {{"name", required_string(tool, "name", p)}};
    if (const json* d = field(tool, "description"))
      fn["description"] = as_string(*d, p + ".description");
    const json* s = field(tool, "input_schema");
    if (!s)
      throw invalid_field(p + ".input_schema", fmt::format("'{}.input_schema' is required", p),
                          "missing_required_parameter");
    if (!s->is_object())
      throw invalid_field(p + ".input_schema",
                          fmt::format("'{}.input_schema' must be an object", p), "invalid_type");
    fn["parameters"] = *s;
    tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
  }
  return tools;
}

// tool_choice: {"type": "auto" | "any" | "tool" (with "name") | "none"}.
ToolChoice parse_tool_choice(const json& j, const std::vector<json>& tools, ChatOptions& options) {
  ToolChoice c;
  const json* tc = field(j, "tool_choice");
  if (!tc) return c;
  if (!tc->is_object())
    throw invalid_field("tool_choice", "'tool_choice' must be an object with a 'type'",
                        "invalid_type");
  const std::string type = required_string(*tc, "type", "tool_choice");
  if (type == "none") {
    c.mode = ToolChoice::Mode::kNone;
    options.tool_choice = "none";
  } else if (type == "any") {
    c.mode = ToolChoice::Mode::kRequired;
  } else if (type == "tool") {
    c.mode = ToolChoice::Mode::kNamed;
    c.name = required_string(*tc, "name", "tool_choice");
    if (std::none_of(tools.begin(), tools.end(),
                     [&](const json& t) { return t["function"]["name"] == c.name; }))
      throw invalid_field("tool_choice.name",
                          fmt::format("tool_choice names '{}', which is not in 'tools'", c.name));
  } else if (type != "auto") {
    throw invalid_field("tool_choice.type",
                        fmt::format("unknown tool_choice type '{}' (expected auto, any, tool or "
                                    "none)",
                                    type));
  }
  c.parallel = !get_bool(*tc, "disable_parallel_tool_use", false);
  if (tools.empty() &&
      (c.mode == ToolChoice::Mode::kRequired || c.mode == ToolChoice::Mode::kNamed))
    throw invalid_field("tool_choice", "tool_choice 'any' or 'tool' needs 'tools'");
  if (c.mode == ToolChoice::Mode::kRequired || c.mode == ToolChoice::Mode::kNamed)
    options.tool_choice = "required";
  return c;
}

// thinking {"type": "enabled" | "adaptive" | "disabled"} and output_config {"effort", "format"}
// -> Kimi K3's thinking switch and effort, and response_format.
void parse_thinking(const json& j, ChatOptions& options) {
  if (const json* t = field(j, "thinking")) {
    if (!t->is_object())
      throw invalid_field("thinking", "'thinking' must be an object with a 'type'", "invalid_type");
    const std::string type = required_string(*t, "type", "thinking");
    if (type == "disabled") {
      options.thinking = false;
    } else if (type == "enabled" || type == "adaptive") {
      options.thinking = true;
      // budget_tokens is checked but not enforced: thinking ends when the model ends it, and
      // counts toward max_tokens, as Anthropic counts it.
      if (type == "enabled")
        if (const json* b = field(*t, "budget_tokens"))
          (void)as_int(*b, "thinking.budget_tokens", 1, std::numeric_limits<int32_t>::max());
    } else {
      throw invalid_field("thinking.type",
                          fmt::format("unknown thinking type '{}' (expected enabled, adaptive or "
                                      "disabled)",
                                      type));
    }
  }
  const json* oc = field(j, "output_config");
  if (!oc) return;
  if (!oc->is_object())
    throw invalid_field("output_config", "'output_config' must be an object", "invalid_type");
  if (const json* e = field(*oc, "effort")) {
    const std::string v = as_string(*e, "output_config.effort");
    if (v == "low")
      options.thinking_effort = "low";
    else if (v == "medium" || v == "high")
      options.thinking_effort = "high";
    else if (v == "xhigh" || v == "max")
      options.thinking_effort = "max";
    else
      throw invalid_field("output_config.effort",
                          fmt::format("unknown effort '{}' (expected low, medium, high, xhigh or "
                                      "max)",
                                      v));
  }
  if (const json* f = field(*oc, "format")) {
    if (!f->is_object())
      throw invalid_field("output_config.format", "'output_config.format' must be an object",
                          "invalid_type");
    const std::string type = required_string(*f, "type", "output_config.format");
    if (type != "json_schema")
      throw invalid_field("output_config.format.type",
                          fmt::format("unknown format type '{}' (expected json_schema)", type));
    const json* s = field(*f, "schema");
    if (!s || !s->is_object())
      throw invalid_field("output_config.format.schema",
                          "'output_config.format.schema' must be an object",
                          s ? "invalid_type" : "missing_required_parameter");
    options.response_format = {{"type", "json_schema"},
                               {"json_schema", {{"name", "output"}, {"schema", *s}}}};
  }
}

// The chat request of a /v1/messages body; `need_max_tokens`: count_tokens needs none.
CompletionRequest translate(const json& j, const ParseContext& ctx, bool need_max_tokens) {
  json c = json::object();
  for (const char* k :
       {"model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "seed", "stop_token_ids", "ignore_eos", "stream"})
    if (const json* v = field(j, k)) c[k] = *v;
  if (const json* m = field(j, "max_tokens"))
    c["max_tokens"] = *m;
  else if (need_max_tokens)
    throw invalid_field("max_tokens", "'max_tokens' is required", "missing_required_parameter");
  if (const json* s = field(j, "stop_sequences")) c["stop"] = *s;
  if (const json* md = field(j, "metadata"))
    if (!md->is_object())
      throw invalid_field("metadata", "'metadata' must be an object", "invalid_type");
  ChatParts parts;
  parts.messages = parse_conversation(j, parts.prefill);
  parts.prefill_param = "messages." + std::to_string(field(j, "messages")->size() - 1);
  parts.tools = parse_tools(j);
  parts.choice = parse_tool_choice(j, parts.tools, parts.options);
  parse_thinking(j, parts.options);
  // Anthropic thinks only when asked; a prefill (the answer's start) needs it off on Kimi K3.
  if (parts.prefill && !field(j, "thinking")) parts.options.thinking = false;
  CompletionRequest r;
  try {
    parse_common(c, ctx, r);
    finish_chat_request(c, ctx, r, std::move(parts));
  } catch (const ApiError& e) {
    throw renamed(e,
                  {{"stop", "stop_sequences"},
                   {"response_format.json_schema.schema", "output_config.format.schema"},
                   {"response_format", "output_config.format"},
                   {"tool_choice.function", "tool_choice"},
                   {"chat_template_kwargs.thinking_effort", "output_config.effort"}},
                  "input_schema");
  }
  return r;
}

}  // namespace

MessagesRequest parse_messages_request(std::string_view body, const ParseContext& ctx) {
  const json j = parse_json_body(body, ctx.max_json_depth);
  MessagesRequest r;
  r.chat = translate(j, ctx, true);
  return r;
}

int64_t count_message_tokens(std::string_view body, const ParseContext& ctx) {
  const json j = parse_json_body(body, ctx.max_json_depth);
  return int64_t(translate(j, ctx, false).prompts.at(0).size());
}

}  // namespace md::server
