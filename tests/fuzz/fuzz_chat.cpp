// libFuzzer harness for chat rendering: arbitrary conversations through both the Kimi and the
// Kimi K3 formats (render_chat and render_chat_segments), plus template detection. Rendering may
// fail only with md::Error, the same way for both entry points, and the segments must concatenate
// to the rendered string; anything else is a finding.
//
// Input layout (chosen so that byte mutations stay meaningful):
//   byte 0   switches: bit 0 add_generation_prompt, bit 1 thinking, bits 2-4 thinking_effort,
//            bits 5-6 tool_choice, bit 7 "the first record is JSON" (tools / response schema)
//   byte 1   response_format shape (see kResponseFormats)
//   then records separated by 0x1E; a message record has fields separated by 0x1F:
//            role, content, name, tool_call_id, reasoning, then (id, name, arguments) per tool
//            call. A one-byte role picks system/user/assistant/tool; longer ones are used as is.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/tokenizer/chat_template.h"

namespace {

using nlohmann::json;

void check(bool ok) {
  if (!ok) abort();
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (;;) {
    const size_t p = s.find(sep);
    out.push_back(s.substr(0, p));
    if (p == std::string_view::npos) return out;
    s.remove_prefix(p + 1);
  }
}

md::ChatMessage decode_message(std::string_view record) {
  static constexpr std::string_view kRoles[] = {"system", "user", "assistant", "tool"};
  const std::vector<std::string_view> f = split(record, '\x1f');
  md::ChatMessage m;
  m.role = f[0].size() == 1 ? kRoles[static_cast<unsigned char>(f[0][0]) % 4] : f[0];
  std::string* const fields[] = {&m.content, &m.name, &m.tool_call_id, &m.reasoning};
  for (size_t i = 0; i < 4 && i + 1 < f.size(); ++i) *fields[i] = f[i + 1];
  for (size_t i = 5; i < f.size(); i += 3) {
    md::ToolCall call;
    call.id = f[i];
    if (i + 1 < f.size()) call.name = f[i + 1];
    if (i + 2 < f.size()) call.arguments = f[i + 2];
    m.tool_calls.push_back(std::move(call));
  }
  return m;
}

// Tools and schemas reach render_chat already parsed (a request's JSON); nesting is bounded here
// as a request parser would bound it, since serialising them recurses per level.
struct TooDeep {};
std::optional<json> decode_json(std::string_view text) {
  try {
    return json::parse(text, [](int depth, json::parse_event_t, json&) {
      if (depth > 64) throw TooDeep{};
      return true;
    });
  } catch (const json::exception&) {
  } catch (const TooDeep&) {
  }
  return std::nullopt;
}

struct Outcome {
  bool ok = false;
  std::string text;
};

void render_both(md::TemplateKind kind, const std::vector<md::ChatMessage>& messages, bool gen,
                 const std::vector<json>& tools, const md::ChatOptions& options) {
  Outcome whole, parts;
  try {
    whole.text = md::render_chat(kind, messages, gen, tools, options);
    whole.ok = true;
  } catch (const md::Error&) {
  }
  try {
    for (const md::ChatSegment& s : md::render_chat_segments(kind, messages, gen, tools, options)) {
      // K3 segments are what gets tokenized one by one; the encoder drops empty ones.
      if (kind == md::TemplateKind::kKimiK3) check(!s.text.empty());
      parts.text += s.text;
    }
    parts.ok = true;
  } catch (const md::Error&) {
  }
  check(whole.ok == parts.ok && whole.text == parts.text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t sw = data[0], rf_kind = data[1];
  std::string_view rest(reinterpret_cast<const char*>(data + 2), size - 2);
  std::vector<std::string_view> records = split(rest, '\x1e');

  md::ChatOptions options;
  options.thinking = sw & 2;
  static const std::optional<std::string> kEfforts[] = {std::nullopt, "low",    "high", "max",
                                                        "",           "medium", "MAX",  "max"};
  options.thinking_effort = kEfforts[(sw >> 2) & 7];
  static const char* const kToolChoices[] = {"", "required", "none", "auto"};
  options.tool_choice = kToolChoices[(sw >> 5) & 3];

  std::vector<json> tools;
  json schema;
  if (sw & 0x80) {
    if (std::optional<json> j = decode_json(records.front())) {
      schema = *j;
      if (j->is_array()) {
        for (const json& t : *j) tools.push_back(t);
      } else {
        tools.push_back(*j);
      }
    }
    records.erase(records.begin());
  }
  // The response_format shapes the K3 renderer distinguishes (null leaves it out).
  const json kResponseFormats[] = {
      nullptr,
      {{"type", "json_object"}},
      {{"type", "json_schema"}, {"json_schema", {{"schema", schema}}}},
      {{"type", "json_schema"}, {"json_schema", schema}},
      {{"type", "json_schema"}},
      "json_schema",
      schema,
  };
  options.response_format = kResponseFormats[rf_kind % std::size(kResponseFormats)];

  std::vector<md::ChatMessage> messages;
  for (std::string_view r : records) messages.push_back(decode_message(r));
  if (rest.empty()) messages.clear();  // an empty conversation is a case of its own

  for (md::TemplateKind kind : {md::TemplateKind::kKimi, md::TemplateKind::kKimiK3})
    render_both(kind, messages, sw & 1, tools, options);

  // The first message's content as a checkpoint's Jinja source: a kind or md::Error.
  const std::string source = messages.empty() ? std::string() : messages[0].content;
  try {
    (void)md::detect_template(
        source, [&](std::string_view t) { return source.find(t) != std::string::npos; });
  } catch (const md::Error&) {
  }
  return 0;
}
