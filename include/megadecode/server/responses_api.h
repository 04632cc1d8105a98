// The OpenAI Responses API over the chat path: POST /v1/responses (whole or streamed as typed
// events), GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items. A request's
// `instructions` and `input` items (messages, function calls and their outputs, reasoning)
// become the chat messages the model's template renders; `tools` (function tools), `tool_choice`,
// `text.format` and `reasoning.effort` become what the chat fields of the same meaning do
// (docs/server.md "Responses API"). The output is built as items: the think channel's text
// (Kimi K3) a `reasoning` item, the answer a `message` item with one `output_text` part, each
// tool call a `function_call` item. With `store` (the default, as OpenAI's) the finished response
// is kept in a bounded in-memory store, so a later request can go on from it with
// `previous_response_id` (its conversation, less its instructions, comes first) and clients can
// fetch it again.
#pragma once
#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "megadecode/server/engine_loop.h"
#include "megadecode/server/output_segments.h"
#include "megadecode/server/request.h"
#include "megadecode/server/responses.h"
#include "megadecode/server/tool_calls.h"
#include "megadecode/tokenizer/chat_template.h"

namespace md::server {

// A finished response as the store keeps it.
struct StoredResponse {
  nlohmann::json response;     // the response object, as it was returned
  nlohmann::json input_items;  // this request's input items (ids added), in order
  // The conversation for previous_response_id: the previous turns, this input, this output
  // (an assistant message with its reasoning and tool calls); never the instructions.
  std::vector<ChatMessage> conversation;
};

// Finished responses by id, the least recently used dropped beyond the capacity. Thread-safe.
class ResponseStore {
 public:
  explicit ResponseStore(size_t capacity) : capacity_(capacity) {}
  void put(const std::string& id, std::shared_ptr<const StoredResponse> r);
  std::shared_ptr<const StoredResponse> get(const std::string& id);  // null when unknown
  bool erase(const std::string& id);
  size_t size() const;
  size_t capacity() const { return capacity_; }

 private:
  const size_t capacity_;
  mutable std::mutex mu_;
  std::list<std::string> order_;  // most recently used first
  struct Entry {
    std::shared_ptr<const StoredResponse> r;
    std::list<std::string>::iterator at;
  };
  std::unordered_map<std::string, Entry> map_;
};

// One validated /v1/responses request.
struct ResponsesRequest {
  CompletionRequest chat;  // what the engine runs: one chat choice
  // The request's settings the response object repeats (instructions, tools, tool_choice,
  // temperature, text, reasoning, metadata, ...), normalised.
  nlohmann::json echo;
  bool store = true;
  nlohmann::json input_items;             // the input as items, ids added
  std::vector<ChatMessage> conversation;  // previous turns + this input (no instructions)
};

// Throws ApiError naming the field at fault (404 for an unknown previous_response_id). `store`:
// where previous responses are looked up (null: none kept, so previous_response_id is a 404).
ResponsesRequest parse_responses_request(std::string_view body, const ParseContext& ctx,
                                         ResponseStore* store);

// A response id ("resp_" + 32 hex digits) and the ids of its items ("msg_", "rs_", "fc_").
std::string response_id(const char* prefix);

// The output of one response built from the engine's events (OutputSegments' cut): the think
// channel's text a `reasoning` item, answer text a `message` item, each tool call a
// `function_call` item. With `events`, each change is also rendered as the Responses API's
// streamed events (`event: TYPE` / `data: {...}` pairs with running sequence numbers), the
// response.created / in_progress opening and the final response.completed / incomplete /
// failed included; the whole response object is the same either way.
class ResponseBuilder : private OutputSegments::Sink {
 public:
  ResponseBuilder(std::shared_ptr<const ResponsesRequest> req, ResponseMeta meta,
                  const Tokenizer& tok, bool events);
  std::string open();  // response.created and response.in_progress (events only)
  void add(ChoiceEvent& e) { segments_.add(e); }  // one engine event
  void finish();                                  // the output ended (after the last event)
  std::string take_events();                      // the events rendered since the last call
  nlohmann::json response() const;                // the response object (status from the finish)
  // What the store keeps of it (after finish).
  std::shared_ptr<const StoredResponse> stored() const;
  const OutputSegments& segments() const { return segments_; }

 private:
  using Kind = OutputSegments::Kind;
  void begin(Kind kind, const ToolCallPiece* call) override;
  void delta(Kind kind, const std::string& text, std::vector<TokenLogprob> lps) override;
  void end(Kind kind, bool cut) override;
  void emit(const char* type, nlohmann::json body);
  nlohmann::json skeleton(const char* status) const;

  const std::shared_ptr<const ResponsesRequest> req_;
  const ResponseMeta meta_;
  const Tokenizer& tok_;
  const bool events_;
  OutputSegments segments_;
  nlohmann::json items_ = nlohmann::json::array();     // the output items so far
  nlohmann::json logprobs_ = nlohmann::json::array();  // the open message's
  std::string item_id_json_;                           // the open item's id, as JSON text
  std::string out_;
  int64_t sequence_ = 0;
};

// GET /v1/responses/{id}/input_items: {"object": "list", "data", "first_id", "last_id",
// "has_more"} with `order` ("asc" | "desc", default desc), `limit` (1..100, default 20) and
// `after` (an item id) from the query.
nlohmann::json input_items_page(const nlohmann::json& items, const std::string& order,
                                const std::string& limit, const std::string& after);

}  // namespace md::server
