// The Anthropic Messages API over the chat path: POST /v1/messages (whole, or streamed as its
// typed events) and POST /v1/messages/count_tokens, as Anthropic-compatible clients (the
// `anthropic` SDK, coding agents pointed at a local base URL) send them. `system`, the `messages`
// and their content blocks (text, tool_use, tool_result, thinking) become the chat messages the
// model's template renders; `tools` (custom tools with an `input_schema`), `tool_choice`,
// `thinking`, `output_config` and `stop_sequences` become what the chat fields of the same
// meaning do (docs/server.md "Anthropic Messages API"). The output is content blocks: the think
// channel's text (Kimi K3) a `thinking` block, the answer a `text` block, each tool call a
// `tool_use` block. Errors take Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/server/output_segments.h"
#include "megadecode/server/request.h"
#include "megadecode/server/responses.h"

namespace md::server {

// One validated /v1/messages request: the chat choice the engine runs.
struct MessagesRequest {
  CompletionRequest chat;
};

// Throws ApiError naming the field at fault (`param`; the Anthropic error shape carries it in
// the message).
MessagesRequest parse_messages_request(std::string_view body, const ParseContext& ctx);
// /v1/messages/count_tokens: the prompt's tokens for the same body (max_tokens not needed).
int64_t count_message_tokens(std::string_view body, const ParseContext& ctx);

// {"type": "error", "error": {"type": "invalid_request_error" | "authentication_error" |
// "not_found_error" | "request_too_large" | "overloaded_error" | "api_error", "message"}}.
nlohmann::json anthropic_error(const ApiError& e);

// A message's content blocks built from the engine's events (OutputSegments' cut), and with
// `events` its streamed events: message_start, ping, per block content_block_start /
// content_block_delta (text_delta, thinking_delta, input_json_delta) / content_block_stop, then
// message_delta (stop_reason, usage) and message_stop. The whole message is the same either way.
class MessageBuilder : private OutputSegments::Sink {
 public:
  MessageBuilder(std::shared_ptr<const MessagesRequest> req, ResponseMeta meta, bool events);
  std::string open();  // message_start and a ping (events only)
  void add(ChoiceEvent& e) { segments_.add(e); }
  void finish();  // message_delta and message_stop, or an error event
  std::string take_events();
  nlohmann::json message() const;  // the whole message (after finish)
  const OutputSegments& segments() const { return segments_; }

 private:
  using Kind = OutputSegments::Kind;
  void begin(Kind kind, const ToolCallPiece* call) override;
  void delta(Kind kind, const std::string& text, std::vector<TokenLogprob> lps) override;
  void end(Kind kind, bool cut) override;
  void emit(const char* type, nlohmann::json body);
  nlohmann::json usage() const;
  std::string stop_reason() const;

  const std::shared_ptr<const MessagesRequest> req_;
  const ResponseMeta meta_;
  const bool events_;
  OutputSegments segments_;
  nlohmann::json blocks_ = nlohmann::json::array();
  std::string out_;
};

}  // namespace md::server
