// /v1/chat/completions, /tokenize and /detokenize bodies. Messages become ChatMessages rendered by
// the checkpoint's chat template (tools and tool calls included), so the prompt is exactly what
// `megadecode chat` would feed.
#include <fmt/format.h>

#include <algorithm>

#include "json_fields.h"
#include "megadecode/base/error.h"
#include "megadecode/server/chat_constraints.h"
#include "megadecode/server/request.h"
#include "megadecode/server/structured_outputs.h"
#include "megadecode/text/generator.h"

namespace md::server {

using nlohmann::json;
using namespace detail;

namespace {

// "content": a string, or a list of text parts ({"type": "text", "text": ...}) joined by
// newlines (as vLLM joins them); null only where the role allows it.
std::string parse_content(const json& m, const std::string& param, bool may_be_absent) {
  const json* c = field(m, "content");
  if (!c) {
    if (may_be_absent) return "";
    throw invalid_field(param + ".content", fmt::format("'{}.content' is required", param),
                        "missing_required_parameter");
  }
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array())
    throw invalid_field(
        param + ".content",
        fmt::format("'{}.content' must be a string or a list of content parts", param),
        "invalid_type");
  std::string text;
  for (size_t i = 0; i < c->size(); ++i) {
    const json& part = (*c)[i];
    const std::string pp = param + ".content." + std::to_string(i);
    if (!part.is_object())
      throw invalid_field(pp, fmt::format("'{}' must be a content part object", pp),
                          "invalid_type");
    const json* type = field(part, "type");
    const std::string t = type ? as_string(*type, pp + ".type") : "";
    if (t != "text")
      throw invalid_field(pp + ".type",
                          fmt::format("content part type '{}' is not supported (only 'text')", t),
                          "unsupported_parameter");
    const json* tx = field(part, "text");
    if (!tx)
      throw invalid_field(pp + ".text", fmt::format("'{}.text' is required", pp),
                          "missing_required_parameter");
    if (i) text += "\n";
    text += as_string(*tx, pp + ".text");
  }
  return text;
}

std::vector<ToolCall> parse_tool_calls(const json& v, const std::string& param) {
  if (!v.is_array())
    throw invalid_field(param, fmt::format("'{}' must be a list", param), "invalid_type");
  std::vector<ToolCall> calls;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string p = param + "." + std::to_string(i);
    const json& c = v[i];
    if (!c.is_object())
      throw invalid_field(p, fmt::format("'{}' must be an object", p), "invalid_type");
    ToolCall tc;
    if (const json* id = field(c, "id")) tc.id = as_string(*id, p + ".id");
    const json* fn = field(c, "function");
    if (!fn || !fn->is_object())
      throw invalid_field(p + ".function", fmt::format("'{}.function' must be an object", p),
                          "invalid_type");
    const json* name = field(*fn, "name");
    if (!name)
      throw invalid_field(p + ".function.name", fmt::format("'{}.function.name' is required", p),
                          "missing_required_parameter");
    tc.name = as_string(*name, p + ".function.name");
    if (const json* a = field(*fn, "arguments"))
      tc.arguments = a->is_string() ? a->get<std::string>()
                                    : a->dump(-1, ' ', false, json::error_handler_t::replace);
    calls.push_back(std::move(tc));
  }
  return calls;
}

std::vector<ChatMessage> parse_messages(const json& j) {
  const json* ms = field(j, "messages");
  if (!ms) throw invalid_field("messages", "'messages' is required", "missing_required_parameter");
  if (!ms->is_array())
    throw invalid_field("messages", "'messages' must be a list of messages", "invalid_type");
  if (ms->empty()) throw invalid_field("messages", "'messages' must not be empty");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < ms->size(); ++i) {
    const json& m = (*ms)[i];
    const std::string p = "messages." + std::to_string(i);
    if (!m.is_object())
      throw invalid_field(p, fmt::format("'{}' must be a message object", p), "invalid_type");
    const json* role = field(m, "role");
    if (!role)
      throw invalid_field(p + ".role", fmt::format("'{}.role' is required", p),
                          "missing_required_parameter");
    ChatMessage cm;
    cm.role = as_string(*role, p + ".role");
    if (cm.role == "developer") cm.role = "system";  // the newer OpenAI name of the system role
    if (cm.role != "system" && cm.role != "user" && cm.role != "assistant" && cm.role != "tool")
      throw invalid_field(p + ".role",
                          fmt::format("unknown role '{}' (expected system, developer, user, "
                                      "assistant or tool)",
                                      cm.role));
    const json* calls = field(m, "tool_calls");
    if (calls && cm.role != "assistant")
      throw invalid_field(p + ".tool_calls", "only assistant messages carry 'tool_calls'");
    if (calls) cm.tool_calls = parse_tool_calls(*calls, p + ".tool_calls");
    cm.content = parse_content(m, p, cm.role == "assistant");
    if (const json* n = field(m, "name")) cm.name = as_string(*n, p + ".name");
    if (cm.role == "tool") {
      if (const json* id = field(m, "tool_call_id"))
        cm.tool_call_id = as_string(*id, p + ".tool_call_id");
    }
    if (const json* rc = field(m, "reasoning_content"))
      cm.reasoning = as_string(*rc, p + ".reasoning_content");
    out.push_back(std::move(cm));
  }
  return out;
}

std::vector<json> parse_tools(const json& j) {
  std::vector<json> tools;
  const json* t = field(j, "tools");
  if (!t) return tools;
  if (!t->is_array()) throw invalid_field("tools", "'tools' must be a list", "invalid_type");
  for (size_t i = 0; i < t->size(); ++i) {
    const json& tool = (*t)[i];
    const std::string p = "tools." + std::to_string(i);
    if (!tool.is_object())
      throw invalid_field(p, fmt::format("'{}' must be a tool object", p), "invalid_type");
    const json* type = field(tool, "type");
    if (!type || !type->is_string() || type->get<std::string>() != "function")
      throw invalid_field(p + ".type", "only tools of type 'function' are supported");
    const json* fn = field(tool, "function");
    if (!fn || !fn->is_object() || !field(*fn, "name") || !(*fn)["name"].is_string())
      throw invalid_field(p + ".function", fmt::format("'{}.function' must be an object with a "
                                                       "string 'name'",
                                                       p));
    tools.push_back(tool);
  }
  return tools;
}

ChatOptions parse_chat_options(const json& j) {
  ChatOptions o;
  if (const json* tc = field(j, "tool_choice")) {
    if (tc->is_string()) {
      const std::string c = tc->get<std::string>();
      if (c != "none" && c != "auto" && c != "required")
        throw invalid_field("tool_choice", fmt::format("unknown tool_choice '{}' (expected none, "
                                                       "auto, required or a function object)",
                                                       c));
      if (c != "auto") o.tool_choice = c;
    } else if (tc->is_object()) {
      o.tool_choice = "required";  // a named function: the template can only ask for a call
    } else {
      throw invalid_field("tool_choice", "'tool_choice' must be a string or an object",
                          "invalid_type");
    }
  }
  if (const json* rf = field(j, "response_format")) {
    if (!rf->is_object() || !field(*rf, "type") || !(*rf)["type"].is_string())
      throw invalid_field("response_format", "'response_format' must be an object with a 'type'");
    const std::string t = (*rf)["type"].get<std::string>();
    if (t != "text" && t != "json_object" && t != "json_schema")
      throw invalid_field("response_format.type",
                          fmt::format("unknown response_format type '{}'", t));
    if (t != "text") o.response_format = *rf;
  }
  if (const json* kw = field(j, "chat_template_kwargs")) {
    if (!kw->is_object())
      throw invalid_field("chat_template_kwargs", "'chat_template_kwargs' must be an object",
                          "invalid_type");
    o.thinking = get_bool(*kw, "thinking", true);
    if (const json* e = field(*kw, "thinking_effort")) {
      const std::string effort = as_string(*e, "chat_template_kwargs.thinking_effort");
      if (effort == "none")
        o.thinking_effort.reset();
      else if (effort == "low" || effort == "high" || effort == "max")
        o.thinking_effort = effort;
      else
        throw invalid_field("chat_template_kwargs.thinking_effort",
                            "thinking_effort must be low, high, max or none");
    }
  }
  return o;
}

// tool_choice as what is enforced: "auto" (or absent) nothing; "none", "required", or
// {"type": "function", "function": {"name": NAME}} naming a declared function.
ToolChoice parse_tool_choice(const json& j, const std::vector<json>& tools) {
  ToolChoice c;
  const json* tc = field(j, "tool_choice");
  if (!tc) return c;
  if (tc->is_string()) {  // parse_chat_options has checked the value
    const std::string v = tc->get<std::string>();
    c.mode = v == "none"       ? ToolChoice::Mode::kNone
             : v == "required" ? ToolChoice::Mode::kRequired
                               : ToolChoice::Mode::kAuto;
  } else {
    const json* type = field(*tc, "type");
    if (!type || !type->is_string() || type->get<std::string>() != "function")
      throw invalid_field("tool_choice.type", "a named tool_choice needs \"type\": \"function\"");
    const json* fn = field(*tc, "function");
    const json* name = fn && fn->is_object() ? field(*fn, "name") : nullptr;
    if (!name || !name->is_string())
      throw invalid_field("tool_choice.function.name",
                          "a named tool_choice needs 'function': {'name': ...}",
                          "missing_required_parameter");
    c.mode = ToolChoice::Mode::kNamed;
    c.name = name->get<std::string>();
    const bool declared = std::any_of(tools.begin(), tools.end(), [&](const json& t) {
      return t["function"]["name"] == c.name;
    });
    if (!declared && !tools.empty())
      throw invalid_field("tool_choice.function.name",
                          fmt::format("tool_choice names '{}', which is not in 'tools'", c.name));
  }
  if (tools.empty() && c.mode != ToolChoice::Mode::kAuto && c.mode != ToolChoice::Mode::kNone)
    throw invalid_field("tool_choice", "tool_choice 'required' or a named function needs 'tools'");
  return c;
}

std::vector<int32_t> encode_chat(const ParseContext& ctx, const std::vector<ChatMessage>& msgs,
                                 bool add_generation_prompt, const ChatOptions& options,
                                 const std::vector<json>& tools) {
  try {
    return ctx.generator->encode_chat(msgs, add_generation_prompt, options, tools);
  } catch (const Error& e) {
    // The template refused the conversation (e.g. tool calls where they cannot go).
    throw invalid_field("messages", e.what());
  }
}

}  // namespace

CompletionRequest parse_chat_request(std::string_view body, const ParseContext& ctx) {
  const json j = parse_json_body(body, ctx.max_json_depth);
  CompletionRequest r;
  r.kind = RequestKind::kChat;
  parse_common(j, ctx, r);
  r.logprobs = get_bool(j, "logprobs", false);
  if (const json* tl = field(j, "top_logprobs")) {
    r.top_logprobs = int(as_int(*tl, "top_logprobs", 0, 20));
    if (!r.logprobs) throw invalid_field("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  }
  ChatParts parts;
  parts.messages = parse_messages(j);
  parts.tools = parse_tools(j);
  parts.options = parse_chat_options(j);
  parts.add_generation_prompt = get_bool(j, "add_generation_prompt", true);
  if (get_bool(j, "continue_final_message", false)) {
    // vLLM's: the last message, an assistant's, stays open and the model continues it.
    if (const json* g = field(j, "add_generation_prompt"); g && g->get<bool>())
      throw invalid_field("continue_final_message",
                          "'continue_final_message' and 'add_generation_prompt' cannot both be "
                          "true");
    const ChatMessage& last = parts.messages.back();
    if (last.role != "assistant" || !last.tool_calls.empty())
      throw invalid_field("continue_final_message",
                          "'continue_final_message' needs a final assistant message of text");
    parts.prefill = last.content;
    parts.prefill_param = "continue_final_message";
    parts.messages.pop_back();
    parts.add_generation_prompt = true;  // the open turn's header
  }
  parts.choice = parse_tool_choice(j, parts.tools);
  parts.choice.parallel = get_bool(j, "parallel_tool_calls", true);
  parts.structured = parse_structured_outputs(j);
  finish_chat_request(j, ctx, r, std::move(parts));
  return r;
}

namespace detail {

void finish_chat_request(const json& j, const ParseContext& ctx, CompletionRequest& r,
                         ChatParts parts) {
  const std::vector<json>& tools = parts.tools;
  const ChatOptions& options = parts.options;
  const bool add_generation_prompt = parts.add_generation_prompt;
  r.kind = RequestKind::kChat;
  r.tools_given = !tools.empty();
  r.prompts.push_back(encode_chat(ctx, parts.messages, add_generation_prompt, options, tools));
  r.chat_template = ctx.generator->template_kind();  // known: encode_chat rendered with it
  if (parts.prefill) {
    // K3's generation prompt opens the think channel when thinking: the text to continue would
    // land there. The constraints start a whole answer, not the middle of one.
    if (r.chat_template == TemplateKind::kKimiK3 && options.thinking)
      throw invalid_field(parts.prefill_param,
                          "continuing a final assistant message needs thinking off (Kimi K3's "
                          "generation prompt opens the think channel)",
                          "unsupported_parameter");
    if (parts.structured || !options.response_format.is_null() ||
        (!tools.empty() && parts.choice.mode != ToolChoice::Mode::kAuto))
      throw invalid_field(parts.prefill_param,
                          "continuing a final assistant message cannot be combined with a "
                          "constrained output (tool_choice, a response format, structured "
                          "outputs)",
                          "unsupported_parameter");
    const std::vector<int32_t> more = ctx.generator->tokenizer().encode(*parts.prefill, false);
    r.prompts.back().insert(r.prompts.back().end(), more.begin(), more.end());
  }
  parse_length(j, ctx, r, /*def=*/0);  // chat: the rest of the context, as vLLM
  final_check(r);
  // The output's shape: a tool_choice that calls (or forbids calling), response_format or
  // structured outputs; structured outputs beside either of the others is an error.
  const ToolChoice& choice = parts.choice;
  std::optional<StructuredOutput>& structured = parts.structured;
  if (structured) {
    if (!tools.empty() && choice.mode != ToolChoice::Mode::kAuto)
      throw invalid_field(
          structured->param,
          fmt::format("'{}' cannot be combined with tool_choice '{}'", structured->param,
                      choice.mode == ToolChoice::Mode::kNone ? "none" : "required"));
    if (!options.response_format.is_null())
      throw invalid_field(structured->param, fmt::format("'{}' cannot be combined with "
                                                         "response_format",
                                                         structured->param));
    if (add_generation_prompt) {
      try {
        r.constraint =
            structured_output_program(r.chat_template, options.thinking, ctx.generator->tokenizer(),
                                      r.sampling.stop_token_ids, std::move(structured->body));
      } catch (const Error& e) {
        throw invalid_field(structured->param, e.what());
      }
    }
  } else if (!tools.empty() && choice.mode != ToolChoice::Mode::kAuto) {
    std::vector<std::string> names;
    for (const json& t : tools) names.push_back(t["function"]["name"].get<std::string>());
    // Each function's arguments' schema: its `parameters`.
    std::vector<std::shared_ptr<const JsonSchema>> args(tools.size());
    for (size_t i = 0; i < tools.size() && choice.mode != ToolChoice::Mode::kNone; ++i) {
      const json& f = tools[i]["function"];
      if (!f.contains("parameters") || f["parameters"].is_null()) continue;
      try {
        args[i] = JsonSchema::compile(f["parameters"]);
      } catch (const Error& e) {
        throw invalid_field(fmt::format("tools.{}.function.parameters", i), e.what());
      }
    }
    try {
      r.constraint =
          tool_choice_program(r.chat_template, choice, std::move(names), ctx.generator->tokenizer(),
                              r.sampling.stop_token_ids, std::move(args));
    } catch (const Error& e) {
      throw invalid_field("tool_choice", e.what());
    }
  } else if (!options.response_format.is_null() && add_generation_prompt) {
    // json_schema: {"json_schema": {"name", "schema", "strict"}}; its schema is enforced.
    std::shared_ptr<const JsonSchema> schema;
    const json& rf = options.response_format;
    if (rf["type"] == "json_schema") {
      const json* js = field(rf, "json_schema");
      if (js && !js->is_object())
        throw invalid_field("response_format.json_schema", "'json_schema' must be an object",
                            "invalid_type");
      if (const json* s = js ? field(*js, "schema") : nullptr) {
        try {
          schema = JsonSchema::compile(*s);
        } catch (const Error& e) {
          throw invalid_field("response_format.json_schema.schema", e.what());
        }
      }
    }
    try {
      r.constraint =
          json_object_program(r.chat_template, options.thinking, ctx.generator->tokenizer(),
                              r.sampling.stop_token_ids, std::move(schema));
    } catch (const Error& e) {
      throw invalid_field("response_format", e.what());
    }
  }
}

}  // namespace detail

TokenizeRequest parse_tokenize_request(std::string_view body, const ParseContext& ctx) {
  const json j = parse_json_body(body, ctx.max_json_depth);
  check_model_name(j, ctx);
  TokenizeRequest r;
  const bool has_prompt = field(j, "prompt") != nullptr, has_messages = field(j, "messages");
  if (has_prompt == has_messages)
    throw invalid_field(has_prompt ? "messages" : "prompt",
                        "give exactly one of 'prompt' and 'messages'",
                        has_prompt ? "invalid_value" : "missing_required_parameter");
  if (has_prompt) {
    const std::string text = as_string(j["prompt"], "prompt");
    const bool special = get_bool(j, "add_special_tokens", true);
    r.tokens = ctx.generator->tokenizer().encode(text, special);
  } else {
    r.tokens = encode_chat(ctx, parse_messages(j), get_bool(j, "add_generation_prompt", true),
                           parse_chat_options(j), parse_tools(j));
  }
  return r;
}

std::vector<int32_t> parse_detokenize_request(std::string_view body, const ParseContext& ctx) {
  const json j = parse_json_body(body, ctx.max_json_depth);
  check_model_name(j, ctx);
  const json* t = field(j, "tokens");
  if (!t) throw invalid_field("tokens", "'tokens' is required", "missing_required_parameter");
  return as_ids(*t, "tokens", ctx.vocab_size);
}

}  // namespace md::server
