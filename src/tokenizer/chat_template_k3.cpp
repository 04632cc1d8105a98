// Kimi K3 "XTML" chat format (TemplateKind::kKimiK3).
//
// Kimi K3 ships no Jinja chat template: its tokenizer (tokenization_kimi.py apply_chat_template)
// renders chats with a Python encoder, encoding_k3.py build_chat_segments, into segments that are
// tokenized one by one (markup with special tokens allowed, message text without). This renderer
// reproduces that encoder's behaviour (facts and provenance in docs/chat_templates.md); the Jinja
// template below, written for this project from the same facts, is the oracle the goldens are
// rendered with (tests/tokenizer/make_chat_golden.py, which also cross-checks them against a copy
// of the Python encoder when one is given).
#include <algorithm>
#include <array>
#include <cctype>

#include "chat_template_k3.h"
#include "megadecode/base/error.h"

namespace md {

namespace {

// make_chat_golden.py reads the text between the K3JINJA delimiters below, so keep them intact.
// Inputs beyond transformers' usual ones: `thinking` (default true), `thinking_effort` (default
// "max", none for no effort message), `tool_choice`, `response_format`. Like the Kimi tokenizer,
// callers pass tools (and response_format) deep-sorted, and tool-call arguments as mappings (a
// string is taken as unparseable JSON and rendered as a raw json block).
const char* const kKimiK3Template = R"K3JINJA({#- Kimi K3 XTML chat format (megadecode; see docs/chat_templates.md). -#}
{%- macro attr(v) -%}{{ (v | string) | replace('&', '&amp;') | replace('"', '&quot;') }}{%- endmacro -%}
{%- macro system_message(kind, body) -%}
  <|open|>message role="system" type="{{ kind }}"<|sep|>{{ body | trim }}<|close|>message<|sep|><|end_of_msg|>
{%- endmacro -%}
{%- macro content(c) -%}
  {%- if c is string -%}
    {{ c }}
  {%- elif c is not none -%}
    {%- for part in c -%}
      {%- if part['type'] in ['image', 'image_url'] -%}
        <|kimi_image_placeholder|>
      {%- else -%}
        {{ part['text'] }}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro tool_declare(ts, dynamic) -%}
  {%- if dynamic -%}
    {{- system_message('tool-declare', '## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n' ~ (ts | tojson(separators=(',', ':'))) ~ '\n```') -}}
  {%- else -%}
    {{- system_message('tool-declare', '# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n' ~ (ts | tojson(separators=(',', ':'))) ~ '\n```') -}}
  {%- endif -%}
{%- endmacro -%}
{%- set thinking = true if thinking is not defined else thinking -%}
{%- set effort = 'max' if thinking_effort is not defined else thinking_effort -%}
{%- if thinking and effort is not none and effort not in ['low', 'high', 'max'] -%}
  {{- raise_exception('Unsupported thinking_effort=' ~ effort ~ '; supported values are high, low, max.') -}}
{%- endif -%}
{%- if tools -%}
  {{- tool_declare(tools, false) -}}
{%- endif -%}
{%- if thinking and effort -%}
  {{- system_message('thinking-effort', '`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=' ~ effort ~ '`.') -}}
{%- endif -%}
{%- set ns = namespace(calls=[], tool_index=0) -%}
{%- for m in messages -%}
  {%- set i = loop.index0 -%}
  {%- if m['role'] == 'system' and m.get('tools') -%}
    {{- tool_declare(m['tools'], true) -}}
  {%- elif m['role'] in ['user', 'system'] -%}
    <|open|>message role="{{ attr(m['role']) }}"{{ (' name="' ~ attr(m['name']) ~ '"') if m.get('name') else '' }}<|sep|>{{ content(m.get('content')) }}<|close|>message<|sep|><|end_of_msg|>
  {%- elif m['role'] == 'assistant' -%}
    {%- set ns.calls = m.get('tool_calls') or [] -%}
    {%- set ns.tool_index = 0 -%}
    <|open|>message role="assistant"<|sep|>
    {%- if thinking -%}
      <|open|>think<|sep|>
      {%- set r = m.get('reasoning_content') or m.get('reasoning') -%}
      {%- if r is not none and (r | string | trim) -%}
        {{ r }}
      {%- endif -%}
      <|close|>think<|sep|>
    {%- endif -%}
    <|open|>response<|sep|>{{ content(m.get('content')) }}<|close|>response<|sep|>
    {%- if ns.calls -%}
      <|open|>tools<|sep|>
      {%- for call in ns.calls -%}
        {%- set f = call.get('function', call) -%}
        <|open|>call tool="{{ attr(f['name']) }}" index="{{ loop.index }}"<|sep|>
        {%- set a = f.get('arguments') -%}
        {%- if a is string -%}
          {%- if a | trim -%}
            <|open|>json type="object"<|sep|>{{ a }}<|close|>json<|sep|>
          {%- endif -%}
        {%- elif a is mapping -%}
          {%- for key, value in a.items() -%}
            {%- if value is boolean -%}
              {%- set t = 'boolean' -%}
            {%- elif value is none -%}
              {%- set t = 'null' -%}
            {%- elif value is number -%}
              {%- set t = 'number' -%}
            {%- elif value is string -%}
              {%- set t = 'string' -%}
            {%- elif value is mapping -%}
              {%- set t = 'object' -%}
            {%- else -%}
              {%- set t = 'array' -%}
            {%- endif -%}
            <|open|>argument key="{{ attr(key) }}" type="{{ t }}"<|sep|>{{ value if value is string else value | tojson }}<|close|>argument<|sep|>
          {%- endfor -%}
        {%- endif -%}
        <|close|>call<|sep|>
      {%- endfor -%}
      <|close|>tools<|sep|>
    {%- endif -%}
    <|close|>message<|sep|><|end_of_msg|>
  {%- elif m['role'] == 'tool' and (i == 0 or messages[i - 1]['role'] != 'tool') -%}
    {#- A run of tool results: each is matched to the last assistant's calls by id (and then named
        after its call); the run is put in call order when every one of them matches. -#}
    {%- set run = namespace(open=true, unresolved=false, pos=[], order=[]) -%}
    {%- for j in range(i, messages | length) -%}
      {%- if run.open and messages[j]['role'] == 'tool' -%}
        {%- set tm = messages[j] -%}
        {%- set tid = tm.get('tool_call_id', tm.get('id')) -%}
        {%- set found = namespace(pos=0) -%}
        {%- if tid is not none -%}
          {%- for c in ns.calls -%}
            {%- if found.pos == 0 and c.get('id') is not none and (c['id'] | string) == (tid | string) -%}
              {%- set found.pos = loop.index -%}
            {%- endif -%}
          {%- endfor -%}
        {%- endif -%}
        {%- if found.pos == 0 -%}
          {%- set run.unresolved = true -%}
        {%- endif -%}
        {%- set run.pos = run.pos + [found.pos] -%}
      {%- else -%}
        {%- set run.open = false -%}
      {%- endif -%}
    {%- endfor -%}
    {%- if run.unresolved -%}
      {%- set run.order = range(run.pos | length) | list -%}
    {%- else -%}
      {%- for p in range(1, (ns.calls | length) + 1) -%}
        {%- for k in range(run.pos | length) -%}
          {%- if run.pos[k] == p -%}
            {%- set run.order = run.order + [k] -%}
          {%- endif -%}
        {%- endfor -%}
      {%- endfor -%}
    {%- endif -%}
    {%- for k in run.order -%}
      {%- set tm = messages[i + k] -%}
      {%- set ns.tool_index = ns.tool_index + 1 -%}
      {%- set tname = tm.get('tool', tm.get('name')) -%}
      {%- if run.pos[k] > 0 -%}
        {%- set pc = ns.calls[run.pos[k] - 1] -%}
        {%- set pname = pc.get('function', pc).get('name') -%}
        {%- if pname is not none -%}
          {%- set tname = pname -%}
        {%- endif -%}
      {%- endif -%}
      {%- if tname is none and ns.calls and ns.tool_index <= (ns.calls | length) -%}
        {%- set pc = ns.calls[ns.tool_index - 1] -%}
        {%- set tname = pc.get('function', pc)['name'] -%}
      {%- endif -%}
      {%- if tname is none -%}
        {{- raise_exception('Kimi K3 tool message has no resolvable tool name.') -}}
      {%- endif -%}
      <|open|>message role="tool" tool="{{ attr(tname) }}" index="{{ ns.tool_index }}"<|sep|>{{ content(tm.get('content')) }}<|close|>message<|sep|><|end_of_msg|>
    {%- endfor -%}
  {%- endif -%}
{%- endfor -%}
{%- if tool_choice is defined and tool_choice in ['required', 'none'] -%}
  {{- system_message('tool-choice', 'The system is invoked with `tool_choice=' ~ tool_choice ~ '`.\nYou MUST ' ~ ('call tools' if tool_choice == 'required' else 'NOT call any tools') ~ ' in the next message.') -}}
{%- endif -%}
{%- if response_format is defined and response_format is not none -%}
  {%- set rtype = response_format.get('type', response_format) if response_format is mapping else response_format -%}
  {%- if rtype == 'json_object' -%}
    {{- system_message('response-format', 'The system is invoked with `response_format=json_object`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting.') -}}
  {%- elif rtype == 'json_schema' -%}
    {%- set js = response_format.get('json_schema') if response_format is mapping else none -%}
    {%- if js is none -%}
      {%- set schema = none -%}
    {%- elif js is mapping -%}
      {%- set schema = js.get('schema', js.get('json_schema', js)) -%}
    {%- else -%}
      {%- set schema = js -%}
    {%- endif -%}
    {{- system_message('response-format', 'The system is invoked with `response_format=json_schema`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting.\nThe JSON data must match the following schema:\n```json\n' ~ (schema | tojson(separators=(',', ':'))) ~ '\n```') -}}
  {%- endif -%}
{%- endif -%}
{%- if add_generation_prompt -%}
  <|open|>message role="assistant"<|sep|><|open|>{{ 'think' if thinking else 'response' }}<|sep|>
{%- endif -%}
)K3JINJA";

constexpr std::string_view kOpen = "<|open|>";
constexpr std::string_view kClose = "<|close|>";
constexpr std::string_view kSep = "<|sep|>";

constexpr std::array<NamedSpecialToken, 16> kSpecials = {{
    {0, "[BOS]"},
    {1, "[EOS]"},
    {2, "<|end_of_msg|>"},
    {3, "<|open|>"},
    {4, "<|close|>"},
    {5, "<|sep|>"},
    {6, "[start_header_id]"},
    {7, "[end_header_id]"},
    {9, "[EOT]"},
    {18, "<|media_begin|>"},
    {19, "<|media_content|>"},
    {20, "<|media_end|>"},
    {21, "<|media_pad|>"},
    {65, "<osagent_mode>"},
    {254, "[UNK]"},
    {255, "[PAD]"},
}};
constexpr std::array<std::string_view, 4> kStructural = {"<|open|>", "<|close|>", "<|sep|>",
                                                         "<|end_of_msg|>"};

// Python's str.strip() whitespace for the characters that matter here (ASCII and the separators
// 0x1c-0x1f); other Unicode spaces are not treated as blank (see docs/chat_templates.md).
bool py_space(unsigned char c) { return std::isspace(c) || (c >= 0x1c && c <= 0x1f); }

bool py_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return py_space(static_cast<unsigned char>(c)); });
}

std::string_view py_strip(std::string_view s) {
  while (!s.empty() && py_space(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && py_space(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Segments as encoding_k3.py emits them: empty texts are dropped, the tag name and each attribute
// are text segments of their own, structure tokens are special segments.
class Writer {
 public:
  void control(std::string_view t) { add(t, true); }
  void text(std::string_view t) { add(t, false); }
  void open(std::string_view tag,
            std::initializer_list<std::pair<std::string_view, std::string_view>> attrs = {}) {
    control(kOpen);
    text(tag);
    for (const auto& [k, v] : attrs) {
      std::string a = " ";
      a += k;
      a += "=\"";
      a += k3_escape_attr(v);
      a += '"';
      text(a);
    }
    control(kSep);
  }
  void close(std::string_view tag) {
    control(kClose);
    text(tag);
    control(kSep);
  }
  void end_message() {
    close("message");
    control(kKimiK3EndOfMessage);
  }
  void system_message(std::string_view type, std::string_view body) {
    open("message", {{"role", "system"}, {"type", type}});
    text(py_strip(body));
    end_message();
  }
  std::vector<ChatSegment> take() { return std::move(segs_); }

 private:
  void add(std::string_view t, bool special) {
    if (!t.empty()) segs_.push_back({std::string(t), special});
  }
  std::vector<ChatSegment> segs_;
};

const char* xtml_type(const nlohmann::ordered_json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::boolean:
      return "boolean";
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_float:
      return "number";
    case nlohmann::json::value_t::string:
      return "string";
    case nlohmann::json::value_t::object:
      return "object";
    default:
      return "array";
  }
}

void render_assistant(Writer& w, const ChatMessage& m, size_t msg_index, bool thinking) {
  w.open("message", {{"role", "assistant"}});
  if (thinking) {
    w.open("think");
    if (!py_blank(m.reasoning)) w.text(m.reasoning);
    w.close("think");
  }
  w.open("response");
  w.text(m.content);
  w.close("response");
  if (!m.tool_calls.empty()) {
    w.open("tools");
    for (size_t c = 0; c < m.tool_calls.size(); ++c) {
      const ToolCall& call = m.tool_calls[c];
      const std::string index = std::to_string(c + 1);
      w.open("call", {{"tool", call.name}, {"index", index}});
      // The encoder parses the arguments string: blank is no arguments, a JSON object gives one
      // typed <argument> per key in document order, anything unparseable a raw <json> block.
      if (!py_blank(call.arguments)) {
        nlohmann::ordered_json args;
        bool parsed = true;
        // Rendering the arguments recurses once per nesting level; Python's json.loads stops
        // near 1000 levels (RecursionError), so a tighter bound here rejects nothing real.
        constexpr int kMaxDepth = 512;
        const auto check_depth = [&](int depth, nlohmann::ordered_json::parse_event_t,
                                     nlohmann::ordered_json&) {
          MD_CHECK(depth <= kMaxDepth,
                   "chat message {}: Kimi K3 tool call arguments nest deeper than {} levels "
                   "(call {})",
                   msg_index, kMaxDepth, c + 1);
          return true;
        };
        try {
          args = nlohmann::ordered_json::parse(call.arguments, check_depth);
        } catch (const nlohmann::json::parse_error&) {
          parsed = false;
        } catch (const nlohmann::json::out_of_range&) {
          // A number past the double range (1e400): Python would read it as inf, which the
          // renderer cannot represent in nlohmann::json, so it is refused by name.
          fail("chat message {}: Kimi K3 tool call arguments hold a number outside the double "
               "range (call {})",
               msg_index, c + 1);
        }
        if (!parsed) {
          w.open("json", {{"type", "object"}});
          w.text(call.arguments);
          w.close("json");
        } else {
          MD_CHECK(args.is_object(),
                   "chat message {}: Kimi K3 tool call arguments must be a JSON object (call {})",
                   msg_index, c + 1);
          for (const auto& [key, value] : args.items()) {
            w.open("argument", {{"key", key}, {"type", xtml_type(value)}});
            w.text(value.is_string() ? value.get_ref<const std::string&>()
                                     : python_json_dumps(value));
            w.close("argument");
          }
        }
      }
      w.close("call");
    }
    w.close("tools");
  }
  w.end_message();
}

}  // namespace

std::string k3_escape_attr(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '&')
      out += "&amp;";
    else if (c == '"')
      out += "&quot;";
    else
      out.push_back(c);
  }
  return out;
}

namespace k3 {

std::vector<ChatSegment> render(const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt,
                                const std::vector<nlohmann::json>& tools,
                                const ChatOptions& options) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    MD_CHECK(m.role == "system" || m.role == "user" || m.role == "assistant" || m.role == "tool",
             "chat message {}: unknown role '{}' (expected system, user, assistant or tool)", i,
             m.role);
    MD_CHECK(m.tool_calls.empty() || m.role == "assistant",
             "chat message {}: tool calls are only allowed on assistant messages (role '{}')", i,
             m.role);
  }
  const bool thinking = options.thinking;
  if (thinking && options.thinking_effort) {
    const std::string& e = *options.thinking_effort;
    MD_CHECK(e == "low" || e == "high" || e == "max",
             "Kimi K3 chat: unsupported thinking effort '{}' (supported: low, high, max)", e);
  }

  Writer w;
  if (!tools.empty()) {
    w.system_message("tool-declare",
                     "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n" +
                         python_json_dumps(nlohmann::json(tools), true) + "\n```");
  }
  if (thinking && options.thinking_effort && !options.thinking_effort->empty()) {
    w.system_message(
        "thinking-effort",
        "`thinking_effort` guides on how much to think in your thinking channel (not including "
        "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
        "Now the system is invoked with `thinking_effort=" +
            *options.thinking_effort + "`.");
  }

  // Tool results: each message of a run of tool messages is matched by tool_call_id to the calls
  // of the last assistant message before it and then named after its call; when all of them
  // match, the run is put in call order, otherwise it keeps its order (normalize_xtml_tool_
  // result_messages). `index` counts the tool messages since that assistant message.
  const std::vector<ToolCall>* calls = nullptr;
  int tool_index = 0;
  for (size_t i = 0; i < messages.size();) {
    const ChatMessage& m = messages[i];
    if (m.role == "user" || m.role == "system") {
      if (m.name.empty())
        w.open("message", {{"role", m.role}});
      else
        w.open("message", {{"role", m.role}, {"name", m.name}});
      w.text(m.content);
      w.end_message();
      ++i;
      continue;
    }
    if (m.role == "assistant") {
      calls = &m.tool_calls;
      tool_index = 0;
      render_assistant(w, m, i, thinking);
      ++i;
      continue;
    }
    size_t end = i;
    while (end < messages.size() && messages[end].role == "tool") ++end;
    std::vector<size_t> pos;  // 1-based call position per message of the run, 0 = no match
    bool unresolved = false;
    for (size_t k = i; k < end; ++k) {
      size_t p = 0;
      if (!messages[k].tool_call_id.empty() && calls) {
        for (size_t c = 0; c < calls->size() && p == 0; ++c)
          if ((*calls)[c].id == messages[k].tool_call_id) p = c + 1;
      }
      unresolved = unresolved || p == 0;
      pos.push_back(p);
    }
    std::vector<size_t> order(end - i);
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    if (!unresolved)
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return pos[a] < pos[b]; });
    for (size_t k : order) {
      const ChatMessage& t = messages[i + k];
      ++tool_index;
      std::string name;
      bool have_name = false;
      if (pos[k] > 0) {
        name = (*calls)[pos[k] - 1].name;
        have_name = true;
      } else if (!t.name.empty()) {
        name = t.name;
        have_name = true;
      } else if (calls && size_t(tool_index) <= calls->size()) {
        name = (*calls)[size_t(tool_index) - 1].name;
        have_name = true;
      }
      MD_CHECK(have_name,
               "chat message {}: Kimi K3 tool message has no resolvable tool name (give its "
               "tool_call_id or name)",
               i + k);
      const std::string index = std::to_string(tool_index);
      w.open("message", {{"role", "tool"}, {"tool", name}, {"index", index}});
      w.text(t.content);
      w.end_message();
    }
    i = end;
  }

  if (options.tool_choice == "required" || options.tool_choice == "none") {
    const bool required = options.tool_choice == "required";
    w.system_message("tool-choice", "The system is invoked with `tool_choice=" +
                                        options.tool_choice + "`.\nYou MUST " +
                                        (required ? "call tools" : "NOT call any tools") +
                                        " in the next message.");
  }
  const nlohmann::json& rf = options.response_format;
  const nlohmann::json rtype = rf.is_object() && rf.contains("type") ? rf["type"] : rf;
  constexpr std::string_view kRawJson =
      "Your response must be raw JSON data without markdown code blocks (```json) or any "
      "additional formatting.";
  if (rtype == "json_object") {
    w.system_message("response-format",
                     "The system is invoked with `response_format=json_object`.\n" +
                         std::string(kRawJson));
  } else if (rtype == "json_schema") {
    nlohmann::json schema;  // null unless given
    if (rf.is_object() && rf.contains("json_schema") && !rf["json_schema"].is_null()) {
      const nlohmann::json& js = rf["json_schema"];
      schema = !js.is_object()            ? js
               : js.contains("schema")      ? js["schema"]
               : js.contains("json_schema") ? js["json_schema"]
                                            : js;
    }
    w.system_message("response-format",
                     "The system is invoked with `response_format=json_schema`.\n" +
                         std::string(kRawJson) +
                         "\nThe JSON data must match the following schema:\n```json\n" +
                         python_json_dumps(schema, true) + "\n```");
  }

  if (add_generation_prompt) {
    w.open("message", {{"role", "assistant"}});
    w.open(thinking ? "think" : "response");
  }
  return w.take();
}

bool template_family(const std::string& src) {
  for (std::string_view t : kStructural)
    if (src.find(t) == std::string::npos) return false;
  return src.find("think") != std::string::npos && src.find("response") != std::string::npos;
}

}  // namespace k3

const std::string& kimi_k3_chat_template() {
  static const std::string text(kKimiK3Template);
  return text;
}

std::span<const NamedSpecialToken> kimi_k3_special_tokens() { return kSpecials; }

std::span<const std::string_view> kimi_k3_structural_tokens() { return kStructural; }

}  // namespace md
