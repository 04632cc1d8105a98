// Chat templates: turns a conversation into the prompt text a checkpoint was trained on.
//
// This is not a Jinja engine. Each supported template kind is a hand-written renderer that
// reproduces, byte for byte, what transformers' apply_chat_template produces with that kind's
// Jinja source (checked against goldens rendered by tests/tokenizer/make_chat_golden.py). A
// checkpoint's template is mapped to a kind by detect_template(); anything unrecognised is an error
// that the user resolves by naming the kind (--chat-template).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace md {

enum class TemplateKind {
  kKimi,  // Kimi Linear / Kimi K2 Instruct: <|im_system|>…<|im_middle|>…<|im_end|>
};

struct ToolCall {
  std::string id;         // e.g. "functions.get_weather:0"; rendered verbatim
  std::string name;       // function name
  std::string arguments;  // JSON text, rendered verbatim (OpenAI sends arguments as a string)
};

struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant" | "tool"
  std::string content;
  std::string name;                  // optional; replaces the role name in the header when set
  std::string tool_call_id;          // tool results: the id of the call being answered
  std::vector<ToolCall> tool_calls;  // assistant messages only
};

// Renders `messages` (and the tool declarations, OpenAI function-tool objects) as the template of
// `kind` would. Throws md::Error on an unknown role or tool calls outside an assistant message.
std::string render_chat(TemplateKind kind, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, const std::vector<nlohmann::json>& tools = {});

// Maps a checkpoint's Jinja source to a kind: the exact known text (ignoring whitespace) or,
// failing that, one of the same family recognised by its distinctive markers. Throws md::Error
// ("unknown chat template ... use --chat-template") for anything else.
TemplateKind detect_template(const std::string& jinja_source);

// True when `jinja_source` is the known text of `kind` up to whitespace, i.e. the renderer is
// verified byte-exact for it (a family match by markers may differ in details).
bool template_is_exact(TemplateKind kind, const std::string& jinja_source);

// The --chat-template names: "kimi", "kimi-k2", "kimi-linear".
TemplateKind template_from_name(std::string_view name);
std::string_view template_name(TemplateKind kind);

// The Jinja source of the Kimi Linear / Kimi K2 Instruct chat template, as shipped in the
// checkpoint's tokenizer files (provenance in docs/chat_templates.md). make-model writes it into
// tokenizer_config.json so generated checkpoints carry the real template.
const std::string& kimi_linear_chat_template();

// JSON text exactly as Python's json.dumps(value, ensure_ascii=False) writes it (", " and ": "
// separators, shortest round-trip floats), which is what the templates' tojson filter emits.
std::string python_json_dumps(const nlohmann::json& value);

}  // namespace md
