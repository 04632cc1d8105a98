// The Messages API's output: content blocks built from the engine's events, the message object
// and its streamed events (server/anthropic_api.h).
#include <fmt/format.h>

#include "megadecode/base/util.h"
#include "megadecode/server/anthropic_api.h"
#include "stream_renderer.h"

namespace md::server {

using nlohmann::json;

MessageBuilder::MessageBuilder(std::shared_ptr<const MessagesRequest> req, ResponseMeta meta,
                               bool events)
    : req_(std::move(req)),
      meta_(std::move(meta)),
      events_(events),
      segments_(*this, req_->chat.tools_given, req_->chat.chat_template,
                "toolu_" + meta_.id.substr(meta_.id.find('_') + 1) + "_") {}

void MessageBuilder::emit(const char* type, json body) {
  if (!events_) return;
  body["type"] = type;
  out_ += fmt::format("event: {}\ndata: {}\n\n", type, dump(body));
}

std::string MessageBuilder::take_events() {
  std::string s;
  s.swap(out_);
  return s;
}

// Anthropic counts the prompt's tokens read from the cache apart from the others.
json MessageBuilder::usage() const {
  const OutputSegments& g = segments_;
  return {{"input_tokens", g.prompt_tokens() - g.cached_tokens()},
          {"cache_creation_input_tokens", 0},
          {"cache_read_input_tokens", g.cached_tokens()},
          {"output_tokens", g.completion_tokens()}};
}

std::string MessageBuilder::stop_reason() const {
  const OutputSegments& g = segments_;
  if (g.finish_reason() == "length") return "max_tokens";
  if (!g.stop_string().empty()) return "stop_sequence";
  return g.calls() > 0 ? "tool_use" : "end_turn";
}

std::string MessageBuilder::open() {
  const json start = {{"id", meta_.id},
                      {"type", "message"},
                      {"role", "assistant"},
                      {"model", meta_.model},
                      {"content", json::array()},
                      {"stop_reason", nullptr},
                      {"stop_sequence", nullptr},
                      {"usage",
                       {{"input_tokens", req_->chat.prompts.at(0).size()},
                        {"cache_creation_input_tokens", 0},
                        {"cache_read_input_tokens", 0},
                        {"output_tokens", 0}}}};
  emit("message_start", {{"message", start}});
  emit("ping", json::object());
  return take_events();
}

void MessageBuilder::begin(Kind kind, const ToolCallPiece* call) {
  json block;
  if (kind == Kind::kReasoning)
    block = {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}};
  else if (kind == Kind::kText)
    block = {{"type", "text"}, {"text", ""}};
  else
    block = {
        {"type", "tool_use"}, {"id", call->id}, {"name", call->name}, {"input", json::object()}};
  emit("content_block_start", {{"index", blocks_.size()}, {"content_block", block}});
  blocks_.push_back(std::move(block));
}

void MessageBuilder::delta(Kind kind, const std::string& text, std::vector<TokenLogprob>) {
  if (!events_) return;
  // Once a token: written around the text's JSON string (dump()'s text, keys sorted; tested).
  const char* key = kind == Kind::kReasoning ? "thinking"
                    : kind == Kind::kText    ? "text"
                                             : "partial_json";
  const char* type = kind == Kind::kReasoning ? "thinking_delta"
                     : kind == Kind::kText    ? "text_delta"
                                              : "input_json_delta";
  out_ += fmt::format(
      "event: content_block_delta\ndata: {{\"delta\":{{\"{}\":{},\"type\":\"{}\"}},\"index\":{},"
      "\"type\":\"content_block_delta\"}}\n\n",
      key, dump(json(text)), type, blocks_.size() - 1);
}

void MessageBuilder::end(Kind kind, bool) {
  json& block = blocks_.back();
  const std::string& text = segments_.text();
  if (kind == Kind::kReasoning) {
    block["thinking"] = text;
  } else if (kind == Kind::kText) {
    block["text"] = text;
  } else {
    // The arguments as an object; text that is not one (the model's own markup, unconstrained)
    // is kept whole under "arguments" rather than dropped.
    json input = json::parse(text, nullptr, false);
    block["input"] = input.is_object() ? input : json{{"arguments", text}};
  }
  emit("content_block_stop", {{"index", blocks_.size() - 1}});
}

void MessageBuilder::finish() {
  segments_.finish();
  const OutputSegments& g = segments_;
  if (!g.error().empty()) {
    emit("error", {{"error", {{"type", "api_error"}, {"message", g.error()}}}});
    return;
  }
  const std::string stop = stop_reason();
  emit("message_delta",
       {{"delta",
         {{"stop_reason", stop},
          {"stop_sequence", g.stop_string().empty() ? json(nullptr) : json(g.stop_string())}}},
        {"usage", usage()}});
  emit("message_stop", json::object());
}

json MessageBuilder::message() const {
  const OutputSegments& g = segments_;
  return {{"id", meta_.id},
          {"type", "message"},
          {"role", "assistant"},
          {"model", meta_.model},
          {"content", blocks_},
          {"stop_reason", stop_reason()},
          {"stop_sequence", g.stop_string().empty() ? json(nullptr) : json(g.stop_string())},
          {"usage", usage()}};
}

std::unique_ptr<StreamRenderer> messages_stream_renderer(std::shared_ptr<const MessagesRequest> req,
                                                         ResponseMeta meta) {
  return std::make_unique<BuilderStreamRenderer<MessageBuilder>>(nullptr, std::move(req),
                                                                 std::move(meta), /*events=*/true);
}

}  // namespace md::server
