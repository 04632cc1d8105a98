// /v1/responses bodies -> the chat request the engine runs (server/responses_api.h). The
// Responses fields are read here with errors naming them; the sampling fields and the chat tail
// (the template's prompt, max tokens against the context, the output's constraint) are the chat
// parser's, run on a translated body, and their errors are renamed back to the Responses fields.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <random>

#include "json_fields.h"
#include "megadecode/base/error.h"
#include "megadecode/server/responses_api.h"
#include "megadecode/text/generator.h"

namespace md::server {

using nlohmann::json;
using namespace detail;

std::string response_id(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng(
      uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) ^
      (counter.fetch_add(1) * 0x9E3779B97F4A7C15ull));
  return fmt::format("{}_{:016x}{:016x}", prefix, rng(), rng());
}

namespace {

// `input` -> chat messages, appended to `out`; the items as the store lists them (ids added).
// Reasoning items go with the assistant turn that follows them; function calls join the
// assistant message before them (or start one).
void parse_input(const json& j, std::vector<ChatMessage>& out, json& items) {
  const json* in = field(j, "input");
  if (!in) throw invalid_field("input", "'input' is required", "missing_required_parameter");
  if (in->is_string()) {
    out.push_back({"user", in->get<std::string>(), "", "", {}, ""});
    items.push_back({{"id", response_id("msg")},
                     {"type", "message"},
                     {"role", "user"},
                     {"status", "completed"},
                     {"content", json::array({{{"type", "input_text"}, {"text", *in}}})}});
    return;
  }
  if (!in->is_array())
    throw invalid_field("input", "'input' must be a string or a list of input items",
                        "invalid_type");
  if (in->empty()) throw invalid_field("input", "'input' must not be empty");
  std::string reasoning;        // a reasoning item's text, for the next assistant message
  bool open_assistant = false;  // the last message is an assistant turn calls may join
  auto assistant = [&]() -> ChatMessage& {
    if (!open_assistant) {
      out.push_back({"assistant", "", "", "", {}, std::move(reasoning)});
      reasoning.clear();
      open_assistant = true;
    }
    return out.back();
  };
  for (size_t i = 0; i < in->size(); ++i) {
    const json& it = (*in)[i];
    const std::string p = "input." + std::to_string(i);
    if (!it.is_object())
      throw invalid_field(p, fmt::format("'{}' must be an input item object", p), "invalid_type");
    const json* type = field(it, "type");
    const std::string t = type ? as_string(*type, p + ".type") : "message";
    json item = it;
    if (t == "message") {
      const std::string role = required_string(it, "role", p);
      const json* content = field(it, "content");
      if (!content)
        throw invalid_field(p + ".content", fmt::format("'{}.content' is required", p),
                            "missing_required_parameter");
      if (role == "assistant") {
        const std::string text =
            parts_text(*content, p + ".content", {"output_text", "input_text", "refusal"});
        // Text after a turn's calls starts a new turn.
        if (open_assistant && !out.back().tool_calls.empty()) open_assistant = false;
        ChatMessage& m = assistant();
        if (!m.content.empty() && !text.empty()) m.content += "\n";
        m.content += text;
      } else if (role == "user" || role == "system" || role == "developer") {
        out.push_back({role == "developer" ? "system" : role,
                       parts_text(*content, p + ".content", {"input_text"}),
                       "",
                       "",
                       {},
                       ""});
        open_assistant = false;
      } else {
        throw invalid_field(p + ".role", fmt::format("unknown role '{}' (expected user, system, "
                                                     "developer or assistant)",
                                                     role));
      }
      item["type"] = "message";
      if (!item.contains("status")) item["status"] = "completed";
    } else if (t == "function_call") {
      ToolCall call;
      call.id = required_string(it, "call_id", p);
      call.name = required_string(it, "name", p);
      call.arguments = required_string(it, "arguments", p);
      assistant().tool_calls.push_back(std::move(call));
    } else if (t == "function_call_output") {
      ChatMessage m;
      m.role = "tool";
      m.tool_call_id = required_string(it, "call_id", p);
      const json* o = field(it, "output");
      if (!o)
        throw invalid_field(p + ".output", fmt::format("'{}.output' is required", p),
                            "missing_required_parameter");
      m.content = parts_text(*o, p + ".output", {"input_text"});
      out.push_back(std::move(m));
      open_assistant = false;
    } else if (t == "reasoning") {
      if (const json* c = field(it, "content")) {
        if (!c->is_array())
          throw invalid_field(p + ".content", fmt::format("'{}.content' must be a list", p),
                              "invalid_type");
        reasoning += parts_text(*c, p + ".content", {"reasoning_text"});
      }
      open_assistant = false;
    } else {
      throw invalid_field(p + ".type",
                          fmt::format("input items of type '{}' are not supported (message, "
                                      "function_call, function_call_output and reasoning are)",
                                      t),
                          "unsupported_parameter");
    }
    if (!item.contains("id"))
      item["id"] = response_id(t == "message"         ? "msg"
                               : t == "reasoning"     ? "rs"
                               : t == "function_call" ? "fc"
                                                      : "fco");
    items.push_back(std::move(item));
  }
}

// Responses tools ({"type": "function", "name", "parameters", "strict", "description"}) -> the
// chat form; the normalised list the response repeats.
std::vector<json> parse_tools(const json& j, json& echo) {
  std::vector<json> tools;
  echo = json::array();
  const json* t = field(j, "tools");
  if (!t) return tools;
  if (!t->is_array()) throw invalid_field("tools", "'tools' must be a list", "invalid_type");
  for (size_t i = 0; i < t->size(); ++i) {
    const json& tool = (*t)[i];
    const std::string p = "tools." + std::to_string(i);
    if (!tool.is_object())
      throw invalid_field(p, fmt::format("'{}' must be a tool object", p), "invalid_type");
    const std::string type = required_string(tool, "type", p);
    if (type != "function")
      throw invalid_field(
          p + ".type", fmt::format("tools of type '{}' are not supported (only 'function')", type),
          "unsupported_parameter");
    json fn = {{"name", required_string(tool, "name", p)}};
    json e = {
        {"type", "function"}, {"name", fn["name"]}, {"parameters", nullptr}, {"strict", nullptr}};
    if (const json* d = field(tool, "description")) {
      fn["description"] = as_string(*d, p + ".description");
      e["description"] = fn["description"];
    }
    if (const json* ps = field(tool, "parameters")) {
      if (!ps->is_object())
        throw invalid_field(p + ".parameters", fmt::format("'{}.parameters' must be an object", p),
                            "invalid_type");
      fn["parameters"] = *ps;
      e["parameters"] = *ps;
    }
    if (const json* s = field(tool, "strict")) {
      if (!s->is_boolean())
        throw invalid_field(p + ".strict", fmt::format("'{}.strict' must be a boolean", p),
                            "invalid_type");
      e["strict"] = *s;
    }
    tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
    echo.push_back(std::move(e));
  }
  return tools;
}

// tool_choice: "none" | "auto" | "required" | {"type": "function", "name"}.
ToolChoice parse_tool_choice(const json& j, const std::vector<json>& tools, ChatOptions& options,
                             json& echo) {
  ToolChoice c;
  echo = "auto";
  const json* tc = field(j, "tool_choice");
  if (!tc) return c;
  if (tc->is_string()) {
    const std::string v = tc->get<std::string>();
    if (v == "none")
      c.mode = ToolChoice::Mode::kNone;
    else if (v == "required")
      c.mode = ToolChoice::Mode::kRequired;
    else if (v != "auto")
      throw invalid_field("tool_choice", fmt::format("unknown tool_choice '{}' (expected none, "
                                                     "auto, required or a function object)",
                                                     v));
    echo = v;
  } else if (tc->is_object()) {
    const std::string type = required_string(*tc, "type", "tool_choice");
    if (type != "function")
      throw invalid_field("tool_choice.type",
                          fmt::format("tool_choice of type '{}' is not supported (only "
                                      "'function')",
                                      type),
                          "unsupported_parameter");
    c.mode = ToolChoice::Mode::kNamed;
    c.name = required_string(*tc, "name", "tool_choice");
    if (std::none_of(tools.begin(), tools.end(),
                     [&](const json& t) { return t["function"]["name"] == c.name; }))
      throw invalid_field("tool_choice.name",
                          fmt::format("tool_choice names '{}', which is not in 'tools'", c.name));
    echo = {{"type", "function"}, {"name", c.name}};
  } else {
    throw invalid_field("tool_choice", "'tool_choice' must be a string or an object",
                        "invalid_type");
  }
  if (tools.empty() &&
      (c.mode == ToolChoice::Mode::kRequired || c.mode == ToolChoice::Mode::kNamed))
    throw invalid_field("tool_choice", "tool_choice 'required' or a named function needs 'tools'");
  if (c.mode == ToolChoice::Mode::kNone) options.tool_choice = "none";
  if (c.mode == ToolChoice::Mode::kRequired || c.mode == ToolChoice::Mode::kNamed)
    options.tool_choice = "required";
  return c;
}

// text: {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict",
// "description"}} -> response_format; the normalised config the response repeats.
json parse_text(const json& j, ChatOptions& options) {
  json echo = {{"format", {{"type", "text"}}}};
  const json* t = field(j, "text");
  if (!t) return echo;
  if (!t->is_object()) throw invalid_field("text", "'text' must be an object", "invalid_type");
  if (const json* v = field(*t, "verbosity")) echo["verbosity"] = as_string(*v, "text.verbosity");
  const json* f = field(*t, "format");
  if (!f) return echo;
  if (!f->is_object())
    throw invalid_field("text.format", "'text.format' must be an object", "invalid_type");
  const std::string type = required_string(*f, "type", "text.format");
  if (type == "json_object") {
    options.response_format = {{"type", "json_object"}};
  } else if (type == "json_schema") {
    const std::string name = required_string(*f, "name", "text.format");
    const json* s = field(*f, "schema");
    if (!s)
      throw invalid_field("text.format.schema", "'text.format.schema' is required",
                          "missing_required_parameter");
    if (!s->is_object())
      throw invalid_field("text.format.schema", "'text.format.schema' must be an object",
                          "invalid_type");
    json js = {{"name", name}, {"schema", *s}};
    if (const json* st = field(*f, "strict")) js["strict"] = *st;
    options.response_format = {{"type", "json_schema"}, {"json_schema", js}};
  } else if (type != "text") {
    throw invalid_field("text.format.type",
                        fmt::format("unknown text format '{}' (expected text, json_object or "
                                    "json_schema)",
                                    type));
  }
  echo["format"] = *f;
  return echo;
}

// reasoning: {"effort": none | minimal | low | medium | high | xhigh, "summary"} -> Kimi K3's
// thinking switch and effort (low / high / max; the template's default when absent).
json parse_reasoning(const json& j, ChatOptions& options) {
  json echo = {{"effort", nullptr}, {"summary", nullptr}};
  const json* r = field(j, "reasoning");
  if (!r) return echo;
  if (!r->is_object())
    throw invalid_field("reasoning", "'reasoning' must be an object", "invalid_type");
  if (const json* e = field(*r, "effort")) {
    const std::string v = as_string(*e, "reasoning.effort");
    if (v == "none") {
      options.thinking = false;
      options.thinking_effort.reset();
    } else if (v == "minimal" || v == "low") {
      options.thinking_effort = "low";
    } else if (v == "medium" || v == "high") {
      options.thinking_effort = "high";
    } else if (v == "xhigh") {
      options.thinking_effort = "max";
    } else {
      throw invalid_field("reasoning.effort",
                          fmt::format("unknown reasoning effort '{}' (expected none, minimal, "
                                      "low, medium, high or xhigh)",
                                      v));
    }
    echo["effort"] = v;
  }
  for (const char* k : {"summary", "generate_summary"})
    if (const json* s = field(*r, k)) {
      const std::string v = as_string(*s, std::string("reasoning.") + k);
      if (v != "auto" && v != "concise" && v != "detailed")
        throw invalid_field(std::string("reasoning.") + k,
                            fmt::format("unknown summary '{}' (expected auto, concise or "
                                        "detailed)",
                                        v));
      echo["summary"] = v;  // accepted; the reasoning item carries the text, not a summary
    }
  return echo;
}

json parse_metadata(const json& j) {
  const json* m = field(j, "metadata");
  if (!m) return nullptr;
  if (!m->is_object())
    throw invalid_field("metadata", "'metadata' must be an object of strings", "invalid_type");
  if (m->size() > 16)
    throw invalid_field("metadata",
                        fmt::format("'metadata' has {} keys; at most 16 are allowed", m->size()));
  for (const auto& [k, v] : m->items()) {
    if (k.size() > 64)
      throw invalid_field("metadata", "'metadata' keys must be at most 64 characters long");
    if (!v.is_string() || v.get<std::string>().size() > 512)
      throw invalid_field(
          "metadata." + k,
          fmt::format("'metadata.{}' must be a string of at most 512 characters", k));
  }
  return *m;
}

}  // namespace

ResponsesRequest parse_responses_request(std::string_view body, const ParseContext& ctx,
                                         ResponseStore* store) {
  const json j = parse_json_body(body, ctx.max_json_depth);
  ResponsesRequest r;
  // What is not served here, refused rather than silently dropped.
  if (get_bool(j, "background", false))
    throw invalid_field("background", "'background': true is not supported",
                        "unsupported_parameter");
  reject_if_given(j, "conversation", "use previous_response_id or send the whole input");
  reject_if_given(j, "prompt", "reusable prompts are not stored here; send the input");
  if (const json* t = field(j, "truncation"))
    if (as_string(*t, "truncation") != "disabled")
      throw invalid_field("truncation",
                          "only 'truncation': 'disabled' is supported (a conversation longer "
                          "than the context is a 400)",
                          "unsupported_parameter");
  // The sampling fields, read by the chat parser from a body of the chat names.
  json c = json::object();
  for (const char* k : {"model", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                        "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                        "ignore_eos", "logit_bias", "stream", "skip_special_tokens"})
    if (const json* v = field(j, k)) c[k] = *v;
  if (const json* m = field(j, "max_output_tokens")) c["max_tokens"] = *m;
  if (const json* so = field(j, "stream_options")) {
    if (!get_bool(j, "stream", false))
      throw invalid_field("stream_options",
                          "'stream_options' is only allowed when 'stream' is true");
    if (!so->is_object())
      throw invalid_field("stream_options", "'stream_options' must be an object", "invalid_type");
  }
  r.store = get_bool(j, "store", true);
  bool logprobs = false;
  if (const json* inc = field(j, "include")) {
    if (!inc->is_array())
      throw invalid_field("include", "'include' must be a list of strings", "invalid_type");
    for (size_t i = 0; i < inc->size(); ++i) {
      const std::string v = as_string((*inc)[i], "include." + std::to_string(i));
      // The other includables name outputs of tools this server does not run, or encrypted
      // reasoning it does not produce: nothing to add.
      if (v == "message.output_text.logprobs") logprobs = true;
    }
  }
  const int top_logprobs = int(get_int(j, "top_logprobs", 0, 20, 0));
  ChatParts parts;
  // The conversation: the previous response's, the instructions, this input.
  std::string previous;
  if (const json* pr = field(j, "previous_response_id")) {
    previous = as_string(*pr, "previous_response_id");
    const std::shared_ptr<const StoredResponse> prev = store ? store->get(previous) : nullptr;
    if (!prev)
      throw ApiError(404,
                     fmt::format("no stored response '{}' (responses are kept with 'store', "
                                 "up to the server's --responses-store)",
                                 previous),
                     "previous_response_id", "previous_response_not_found");
    r.conversation = prev->conversation;
  }
  parse_input(j, r.conversation, r.input_items);
  std::string instructions;
  if (const json* in = field(j, "instructions")) {
    instructions = as_string(*in, "instructions");
    parts.messages.push_back({"system", instructions, "", "", {}, ""});
  }
  parts.messages.insert(parts.messages.end(), r.conversation.begin(), r.conversation.end());
  json tools_echo;
  parts.tools = parse_tools(j, tools_echo);
  json choice_echo;
  parts.choice = parse_tool_choice(j, parts.tools, parts.options, choice_echo);
  const json text_echo = parse_text(j, parts.options);
  const json reasoning_echo = parse_reasoning(j, parts.options);
  const json metadata = parse_metadata(j);
  const bool parallel = get_bool(j, "parallel_tool_calls", true);
  parts.choice.parallel = parallel;
  json user = nullptr;
  if (const json* u = field(j, "user")) user = as_string(*u, "user");
  try {
    parse_common(c, ctx, r.chat);
    r.chat.logprobs = logprobs || top_logprobs > 0;
    r.chat.top_logprobs = top_logprobs;
    finish_chat_request(c, ctx, r.chat, std::move(parts));
  } catch (const ApiError& e) {
    throw renamed(e,
                  {{"max_tokens", "max_output_tokens"},
                   {"messages", "input"},
                   {"response_format.json_schema.schema", "text.format.schema"},
                   {"response_format", "text.format"},
                   {"tool_choice.function", "tool_choice"},
                   {"chat_template_kwargs.thinking_effort", "reasoning.effort"}},
                  "parameters");
  }
  const SamplingParams& s = r.chat.sampling;
  r.echo = {
      {"instructions", instructions.empty() ? json(nullptr) : json(instructions)},
      {"max_output_tokens", field(j, "max_output_tokens") ? json(s.max_tokens) : json(nullptr)},
      {"metadata", metadata.is_null() ? json::object() : metadata},
      {"parallel_tool_calls", parallel},
      {"previous_response_id", previous.empty() ? json(nullptr) : json(previous)},
      {"reasoning", reasoning_echo},
      {"store", r.store},
      {"temperature", s.temperature},
      {"text", text_echo},
      {"tool_choice", choice_echo},
      {"tools", tools_echo},
      {"top_logprobs", top_logprobs},
      {"top_p", s.top_p},
      {"truncation", "disabled"},
      {"user", user},
      {"background", false},
      {"service_tier", "default"}};
  return r;
}

}  // namespace md::server
