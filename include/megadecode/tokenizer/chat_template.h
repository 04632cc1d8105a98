// Chat templates: turns a conversation into the prompt text a checkpoint was trained on.
//
// This is not a Jinja engine. Each supported template kind is a hand-written renderer that
// reproduces, byte for byte, what transformers' apply_chat_template produces with that kind's
// Jinja source (checked against goldens rendered by tests/tokenizer/make_chat_golden.py). A
// checkpoint's template is mapped to a kind by detect_template(); anything unrecognised is an error
// that the user resolves by naming the kind (--chat-template).
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace md {

enum class TemplateKind {
  kKimi,    // Kimi Linear / Kimi K2 Instruct: <|im_system|>…<|im_middle|>…<|im_end|>
  kKimiK3,  // Kimi K3 "XTML": <|open|>message role="…"<|sep|>…<|close|>message<|sep|><|end_of_msg|>
};

struct ToolCall {
  std::string id;         // e.g. "functions.get_weather:0"; rendered verbatim
  std::string name;       // function name
  std::string arguments;  // JSON text (OpenAI sends arguments as a string). kKimi renders it
                          // verbatim; kKimiK3 parses a JSON object into typed arguments (key
                          // order kept) and renders anything unparseable as a raw json block
};

struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant" | "tool"
  std::string content;
  std::string name;                  // optional; replaces the role name in the header when set
  std::string tool_call_id;          // tool results: the id of the call being answered
  std::vector<ToolCall> tool_calls;  // assistant messages only
  std::string reasoning;             // assistant: think-channel text (kKimiK3; kKimi ignores it)
};

// Per-request switches of templates that have them (kKimiK3); kKimi ignores them all. The defaults
// are what Kimi K3's tokenizer (tokenization_kimi.py apply_chat_template) uses.
struct ChatOptions {
  bool thinking = true;  // think channels in assistant turns; the generation prompt opens think
  // A "thinking-effort" system message ahead of the conversation when thinking: "low", "high" or
  // "max" (anything else, "" included, is rejected); nullopt leaves the message out.
  std::optional<std::string> thinking_effort = std::string("max");
  std::string tool_choice;        // "required" or "none" append a tool-choice system message
  nlohmann::json response_format;  // {"type": "json_object"} or {"type": "json_schema",
                                   // "json_schema": {"schema": {...}}} append a format message
};

// Renders `messages` (and the tool declarations, OpenAI function-tool objects) as the template of
// `kind` would. Throws md::Error on an unknown role or tool calls outside an assistant message.
std::string render_chat(TemplateKind kind, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, const std::vector<nlohmann::json>& tools = {},
                        const ChatOptions& options = {});

// The same conversation as pieces to tokenize one by one: `allow_special` pieces are template
// markup (special-token strings become their ids), the others are message text (tokenized as plain
// text, so "<|open|>" typed by a user stays text). Kimi K3's tokenizer encodes its chats this way
// (_encode_chat_segments); for kKimi, whose checkpoint tokenizes the rendered string as a whole,
// this is one allow_special piece. Concatenated, the pieces are render_chat()'s string.
struct ChatSegment {
  std::string text;
  bool allow_special = false;
};
std::vector<ChatSegment> render_chat_segments(TemplateKind kind,
                                              const std::vector<ChatMessage>& messages,
                                              bool add_generation_prompt,
                                              const std::vector<nlohmann::json>& tools = {},
                                              const ChatOptions& options = {});

// Maps a checkpoint's Jinja source to a kind: the exact known text (ignoring whitespace) or,
// failing that, one of the same family recognised by its distinctive markers. Throws md::Error
// ("unknown chat template ... use --chat-template") for anything else.
TemplateKind detect_template(const std::string& jinja_source);

// The kind for a checkpoint: detect_template(jinja_source) when it has a template; a checkpoint
// with none whose tokenizer has all of kimi_k3_structural_tokens() (has_special_token(content)) is
// Kimi K3, which ships its chat format as Python (encoding_k3.py) instead of a Jinja template.
TemplateKind detect_template(const std::string& jinja_source,
                             const std::function<bool(std::string_view)>& has_special_token);

// True when `jinja_source` is the known text of `kind` up to whitespace, i.e. the renderer is
// verified byte-exact for it (a family match by markers may differ in details).
bool template_is_exact(TemplateKind kind, const std::string& jinja_source);

// The --chat-template names: "kimi", "kimi-k2", "kimi-linear"; "kimi-k3", "k3".
TemplateKind template_from_name(std::string_view name);
std::string_view template_name(TemplateKind kind);

// The Jinja source of the Kimi Linear / Kimi K2 Instruct chat template, as shipped in the
// checkpoint's tokenizer files (provenance in docs/chat_templates.md). make-model writes it into
// tokenizer_config.json so generated checkpoints carry the real template.
const std::string& kimi_linear_chat_template();

// A Jinja template equivalent to Kimi K3's Python chat encoder, written for this project from the
// encoder's documented behaviour (docs/chat_templates.md): the oracle of the kKimiK3 goldens, and
// the text detect_template() knows exactly. Kimi K3 checkpoints ship no Jinja template, so
// make-model should not write this one into K3 checkpoints (see kimi_k3_special_tokens()).
const std::string& kimi_k3_chat_template();

// Kimi K3's named special tokens, as offsets from the first special id (163584 in the released
// vocabulary, i.e. the number of BPE ranks); offsets 254 and 255 are [UNK] and [PAD], the last two
// of the 256 special ids. Everything else in the 256 is reserved. A K3 checkpoint's tokenizer
// needs these (the structural four at least) for the kKimiK3 format to tokenize and stop.
struct NamedSpecialToken {
  int32_t offset;
  std::string_view content;
};
std::span<const NamedSpecialToken> kimi_k3_special_tokens();
// The four XTML structure tokens: <|open|>, <|close|>, <|sep|>, <|end_of_msg|>.
std::span<const std::string_view> kimi_k3_structural_tokens();
// The token that ends a K3 message (its config.json eos_token_id, 163586): generation stops there.
inline constexpr std::string_view kKimiK3EndOfMessage = "<|end_of_msg|>";

// JSON text exactly as Python's json.dumps(value, ensure_ascii=False) writes it (", " and ": "
// separators, or "," and ":" with `compact`; shortest round-trip floats), which is what the
// templates' tojson filter emits. The ordered_json overload keeps the keys in document order (as
// Python's json.loads does); nlohmann::json objects come out sorted.
// Kimi K3's attribute escaping in its markup (& -> &amp;, " -> &quot;), as its template writes
// tool names and argument keys.
std::string k3_escape_attr(std::string_view v);
std::string python_json_dumps(const nlohmann::json& value, bool compact = false);
std::string python_json_dumps(const nlohmann::ordered_json& value, bool compact = false);

}  // namespace md
