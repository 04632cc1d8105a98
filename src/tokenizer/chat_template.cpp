#include "megadecode/tokenizer/chat_template.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>

#include "chat_template_k3.h"
#include "megadecode/base/error.h"

namespace md {

namespace {

// The Kimi K2 Instruct chat template, byte for byte as vendored from the checkpoint's
// chat_template.jinja (see docs/chat_templates.md for where it was found). make_chat_golden.py
// reads the text between the JINJA delimiters below, so keep them intact.
const char* const kKimiTemplate = R"JINJA({%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>
  # Tools
  {{ tools | tojson }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
  {%- endif -%}

  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}

  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    {%- if message['content'] -%}{{ message['content'] }}{%- endif -%}
    <|tool_calls_section_begin|>
    {%- for tool_call in message['tool_calls'] -%}
      {%- set formatted_id = tool_call['id'] -%}
      <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- elif message['role'] == 'tool' -%}
    ## Return of {{ message.tool_call_id }}
    {{ message['content'] }}
  {%- elif message['content'] is string -%}
    {{ message['content'] }}
  {%- elif message['content'] is not none -%}
    {% for content in message['content'] -%}
      {% if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
        <|media_start|>image<|media_content|><|media_pad|><|media_end|>
      {% else -%}
        {{ content['text'] }}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}
)JINJA";

// Prompt pieces of the Kimi format, in the order the template emits them.
constexpr std::string_view kDefaultSystem =
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
    "<|im_end|>";
constexpr std::string_view kToolDeclareOpen =
    "<|im_system|>tool_declare<|im_middle|>\n  # Tools\n  ";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kImMiddle = "<|im_middle|>";
constexpr std::string_view kGenerationPrompt = "<|im_assistant|>assistant<|im_middle|>";

// Text the family always contains; used to recognise close variants of the template.
constexpr std::string_view kKimiMarkers[] = {
    "<|im_system|>",    "<|im_user|>",
    "<|im_assistant|>", "<|im_middle|>",
    "<|im_end|>",       "<|tool_calls_section_begin|>",
    "## Return of",     "You are Kimi, an AI assistant created by Moonshot AI.",
};

std::string strip_whitespace(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s)
    if (!std::isspace(static_cast<unsigned char>(c))) out.push_back(c);
  return out;
}

// Python's repr(float): shortest round-trip digits; exponent form when the decimal point would sit
// more than 16 places right or 4 places left of the first digit.
std::string python_float(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, std::fabs(v), std::chars_format::scientific);
  std::string_view sci(buf, size_t(res.ptr - buf));  // d[.ddd]e±XX
  size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e))
    if (c != '.') digits.push_back(c);
  int exp = 0;
  std::from_chars(sci.data() + e + (sci[e + 1] == '+' ? 2 : 1), sci.data() + sci.size(), exp);
  const int decpt = exp + 1;  // value = 0.DIGITS * 10^decpt
  const int nd = int(digits.size());
  std::string out = v < 0 ? "-" : "";
  if (decpt > 16 || decpt <= -4) {
    out += digits[0];
    if (nd > 1) {
      out.push_back('.');
      out.append(digits, 1, std::string::npos);
    }
    int ae = std::abs(exp);
    out += exp < 0 ? "e-" : "e+";
    if (ae < 10) out += '0';
    out += std::to_string(ae);
  } else if (decpt <= 0) {
    out.append("0.");
    out.append(size_t(-decpt), '0');
    out.append(digits);
  } else if (decpt >= nd) {
    out.append(digits);
    out.append(size_t(decpt - nd), '0');
    out.append(".0");
  } else {
    out.append(digits, 0, size_t(decpt));
    out.push_back('.');
    out.append(digits, size_t(decpt), std::string::npos);
  }
  return out;
}

void append_python_string(std::string& out, const std::string& s) {
  static const char* const kHex = "0123456789abcdef";
  out.push_back('"');
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out.push_back(kHex[c >> 4]);
          out.push_back(kHex[c & 15]);
        } else {
          out.push_back(ch);  // ensure_ascii=False: UTF-8 passes through
        }
    }
  }
  out.push_back('"');
}

template <class Json>
void append_python_json(std::string& out, const Json& v, bool compact) {
  using T = nlohmann::json::value_t;
  const char* const item_sep = compact ? "," : ", ";
  const char* const key_sep = compact ? ":" : ": ";
  switch (v.type()) {
    case T::null:
      out += "null";
      break;
    case T::boolean:
      out += v.template get<bool>() ? "true" : "false";
      break;
    case T::number_integer:
      out += std::to_string(v.template get<int64_t>());
      break;
    case T::number_unsigned:
      out += std::to_string(v.template get<uint64_t>());
      break;
    case T::number_float:
      out += python_float(v.template get<double>());
      break;
    case T::string:
      append_python_string(out, v.template get_ref<const std::string&>());
      break;
    case T::array: {
      out.push_back('[');
      bool first = true;
      for (const auto& e : v) {
        if (!first) out += item_sep;
        first = false;
        append_python_json(out, e, compact);
      }
      out.push_back(']');
      break;
    }
    case T::object: {
      // nlohmann::json keeps keys sorted, which is also the order the checkpoint's tokenizer
      // (deep_sort_dict in tokenization_kimi.py) gives the tools before rendering; ordered_json
      // keeps document order, as Python's json.loads does.
      out.push_back('{');
      bool first = true;
      for (const auto& [k, e] : v.items()) {
        if (!first) out += item_sep;
        first = false;
        append_python_string(out, k);
        out += key_sep;
        append_python_json(out, e, compact);
      }
      out.push_back('}');
      break;
    }
    case T::binary:
    case T::discarded:
      fail("chat template: cannot serialise a binary or discarded JSON value");
  }
}

std::string render_kimi(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                        const std::vector<nlohmann::json>& tools) {
  std::string out;
  if (!tools.empty()) {
    out += kToolDeclareOpen;
    out += python_json_dumps(nlohmann::json(tools));
    out += kImEnd;
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const bool assistant = m.role == "assistant";
    MD_CHECK(m.role == "system" || m.role == "user" || assistant || m.role == "tool",
             "chat message {}: unknown role '{}' (expected system, user, assistant or tool)", i,
             m.role);
    MD_CHECK(m.tool_calls.empty() || assistant,
             "chat message {}: tool calls are only allowed on assistant messages (role '{}')", i,
             m.role);
    if (i == 0 && m.role != "system") out += kDefaultSystem;
    // The header names the role's marker and then `name or role`; every role other than user and
    // assistant (system, tool) shares the system marker.
    out += m.role == "user" ? "<|im_user|>" : assistant ? "<|im_assistant|>" : "<|im_system|>";
    out += m.name.empty() ? m.role : m.name;
    out += kImMiddle;
    if (assistant && !m.tool_calls.empty()) {
      out += m.content;
      out += "<|tool_calls_section_begin|>";
      for (const ToolCall& tc : m.tool_calls) {
        out += "<|tool_call_begin|>";
        out += tc.id;
        out += "<|tool_call_argument_begin|>";
        out += tc.arguments;
        out += "<|tool_call_end|>";
      }
      out += "<|tool_calls_section_end|>";
    } else if (m.role == "tool") {
      // The template's indentation before the content is literal text, hence the four spaces.
      out += "## Return of ";
      out += m.tool_call_id;
      out += "\n    ";
      out += m.content;
    } else {
      out += m.content;
    }
    out += kImEnd;
  }
  if (add_generation_prompt) out += kGenerationPrompt;
  return out;
}

}  // namespace

std::string python_json_dumps(const nlohmann::json& value, bool compact) {
  std::string out;
  append_python_json(out, value, compact);
  return out;
}

std::string python_json_dumps(const nlohmann::ordered_json& value, bool compact) {
  std::string out;
  append_python_json(out, value, compact);
  return out;
}

std::vector<ChatSegment> render_chat_segments(TemplateKind kind,
                                              const std::vector<ChatMessage>& messages,
                                              bool add_generation_prompt,
                                              const std::vector<nlohmann::json>& tools,
                                              const ChatOptions& options) {
  switch (kind) {
    case TemplateKind::kKimi:
      return {{render_kimi(messages, add_generation_prompt, tools), true}};
    case TemplateKind::kKimiK3:
      return k3::render(messages, add_generation_prompt, tools, options);
  }
  fail("chat template: unsupported template kind {}", int(kind));
}

std::string render_chat(TemplateKind kind, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, const std::vector<nlohmann::json>& tools,
                        const ChatOptions& options) {
  if (kind == TemplateKind::kKimi) return render_kimi(messages, add_generation_prompt, tools);
  std::string out;
  for (const ChatSegment& s :
       render_chat_segments(kind, messages, add_generation_prompt, tools, options))
    out += s.text;
  return out;
}

bool template_is_exact(TemplateKind kind, const std::string& jinja_source) {
  switch (kind) {
    case TemplateKind::kKimi:
      return strip_whitespace(jinja_source) == strip_whitespace(kimi_linear_chat_template());
    case TemplateKind::kKimiK3:
      return strip_whitespace(jinja_source) == strip_whitespace(kimi_k3_chat_template());
  }
  return false;
}

TemplateKind detect_template(const std::string& jinja_source,
                             const std::function<bool(std::string_view)>& has_special_token) {
  if (jinja_source.empty() && has_special_token) {
    bool k3 = true;
    for (std::string_view t : kimi_k3_structural_tokens()) k3 = k3 && has_special_token(t);
    if (k3) return TemplateKind::kKimiK3;
  }
  return detect_template(jinja_source);
}

TemplateKind detect_template(const std::string& jinja_source) {
  if (template_is_exact(TemplateKind::kKimi, jinja_source)) return TemplateKind::kKimi;
  if (template_is_exact(TemplateKind::kKimiK3, jinja_source)) return TemplateKind::kKimiK3;
  if (k3::template_family(jinja_source)) return TemplateKind::kKimiK3;
  // Family match: every Kimi marker present and no thinking section (the K2 Thinking / K2.5
  // templates share the markers but render <think> blocks, which this renderer does not).
  bool kimi = std::all_of(std::begin(kKimiMarkers), std::end(kKimiMarkers),
                          [&](auto m) { return jinja_source.find(m) != std::string::npos; });
  if (kimi && jinja_source.find("<think>") == std::string::npos) return TemplateKind::kKimi;
  fail(
      "unknown chat template (neither the Kimi Linear / Kimi K2 Instruct nor the Kimi K3 format); "
      "use --chat-template kimi or --chat-template kimi-k3 to render with a known template");
}

TemplateKind template_from_name(std::string_view name) {
  if (name == "kimi" || name == "kimi-k2" || name == "kimi-linear") return TemplateKind::kKimi;
  if (name == "kimi-k3" || name == "k3") return TemplateKind::kKimiK3;
  fail("unknown chat template name '{}' (known: kimi, kimi-k2, kimi-linear, kimi-k3, k3)", name);
}

std::string_view template_name(TemplateKind kind) {
  switch (kind) {
    case TemplateKind::kKimi:
      return "kimi";
    case TemplateKind::kKimiK3:
      return "kimi-k3";
  }
  return "unknown";
}

const std::string& kimi_linear_chat_template() {
  static const std::string text(kKimiTemplate);
  return text;
}

}  // namespace md
