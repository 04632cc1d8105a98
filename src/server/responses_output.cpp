// The Responses API's output: items built from the engine's events, the response object, its
// streamed events, and the store of finished responses (server/responses_api.h).
#include <fmt/format.h>

#include <algorithm>

#include "megadecode/base/util.h"
#include "megadecode/server/responses_api.h"
#include "stream_renderer.h"

namespace md::server {

using nlohmann::json;

// ---- the store ----------------------------------------------------------------------------------

void ResponseStore::put(const std::string& id, std::shared_ptr<const StoredResponse> r) {
  if (capacity_ == 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  if (auto it = map_.find(id); it != map_.end()) {
    order_.erase(it->second.at);
    map_.erase(it);
  }
  order_.push_front(id);
  map_[id] = Entry{std::move(r), order_.begin()};
  while (map_.size() > capacity_) {
    map_.erase(order_.back());
    order_.pop_back();
  }
}

std::shared_ptr<const StoredResponse> ResponseStore::get(const std::string& id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = map_.find(id);
  if (it == map_.end()) return nullptr;
  order_.splice(order_.begin(), order_, it->second.at);
  return it->second.r;
}

bool ResponseStore::erase(const std::string& id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = map_.find(id);
  if (it == map_.end()) return false;
  order_.erase(it->second.at);
  map_.erase(it);
  return true;
}

size_t ResponseStore::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return map_.size();
}

json input_items_page(const json& items, const std::string& order, const std::string& limit,
                      const std::string& after) {
  if (!order.empty() && order != "asc" && order != "desc")
    throw invalid_field("order", "'order' must be asc or desc");
  int n = 20;
  if (!limit.empty()) {
    const bool digits = limit.size() <= 3 && std::all_of(limit.begin(), limit.end(), [](char c) {
                          return c >= '0' && c <= '9';
                        });
    n = digits ? std::stoi(limit) : 0;
    if (n < 1 || n > 100) throw invalid_field("limit", "'limit' must be an integer in [1, 100]");
  }
  std::vector<const json*> all;
  for (const json& it : items) all.push_back(&it);
  if (order != "asc") std::reverse(all.begin(), all.end());  // newest first by default
  size_t from = 0;
  if (!after.empty()) {
    auto at = std::find_if(all.begin(), all.end(),
                           [&](const json* it) { return it->value("id", std::string()) == after; });
    if (at == all.end())
      throw invalid_field("after", fmt::format("no input item '{}' in this response", after));
    from = size_t(at - all.begin()) + 1;
  }
  json data = json::array();
  for (size_t i = from; i < all.size() && data.size() < size_t(n); ++i) data.push_back(*all[i]);
  return {{"object", "list"},
          {"data", data},
          {"first_id", data.empty() ? json(nullptr) : data.front()["id"]},
          {"last_id", data.empty() ? json(nullptr) : data.back()["id"]},
          {"has_more", from + data.size() < all.size()}};
}

// ---- the builder --------------------------------------------------------------------------------

ResponseBuilder::ResponseBuilder(std::shared_ptr<const ResponsesRequest> req, ResponseMeta meta,
                                 const Tokenizer& tok, bool events)
    : req_(std::move(req)),
      meta_(std::move(meta)),
      tok_(tok),
      events_(events),
      segments_(*this, req_->chat.tools_given, req_->chat.chat_template,
                "call_" + meta_.id.substr(meta_.id.find('_') + 1) + "_") {}

void ResponseBuilder::emit(const char* type, json body) {
  if (!events_) return;
  body["type"] = type;
  body["sequence_number"] = sequence_++;
  out_ += fmt::format("event: {}\ndata: {}\n\n", type, dump(body));
}

std::string ResponseBuilder::take_events() {
  std::string s;
  s.swap(out_);
  return s;
}

json ResponseBuilder::skeleton(const char* status) const {
  json r = {{"id", meta_.id},       {"object", "response"},    {"created_at", meta_.created},
            {"status", status},     {"error", nullptr},        {"incomplete_details", nullptr},
            {"model", meta_.model}, {"output", json::array()}, {"usage", nullptr}};
  for (const auto& [k, v] : req_->echo.items()) r[k] = v;
  return r;
}

std::string ResponseBuilder::open() {
  emit("response.created", {{"response", skeleton("in_progress")}});
  emit("response.in_progress", {{"response", skeleton("in_progress")}});
  return take_events();
}

void ResponseBuilder::begin(Kind kind, const ToolCallPiece* call) {
  json item;
  const json index = items_.size();
  if (kind == Kind::kReasoning) {
    item = {{"id", response_id("rs")},
            {"type", "reasoning"},
            {"summary", json::array()},
            {"content", json::array()},
            {"status", "in_progress"}};
  } else if (kind == Kind::kText) {
    item = {{"id", response_id("msg")},
            {"type", "message"},
            {"role", "assistant"},
            {"status", "in_progress"},
            {"content", json::array()}};
  } else {
    item = {{"id", response_id("fc")}, {"type", "function_call"}, {"call_id", call->id},
            {"name", call->name},      {"arguments", ""},         {"status", "in_progress"}};
  }
  emit("response.output_item.added", {{"output_index", index}, {"item", item}});
  if (kind == Kind::kReasoning)
    emit("response.content_part.added", {{"item_id", item["id"]},
                                         {"output_index", index},
                                         {"content_index", 0},
                                         {"part", {{"type", "reasoning_text"}, {"text", ""}}}});
  if (kind == Kind::kText)
    emit("response.content_part.added", {{"item_id", item["id"]},
                                         {"output_index", index},
                                         {"content_index", 0},
                                         {"part",
                                          {{"type", "output_text"},
                                           {"text", ""},
                                           {"annotations", json::array()},
                                           {"logprobs", json::array()}}}});
  item_id_json_ = dump(item["id"]);
  items_.push_back(std::move(item));
  logprobs_ = json::array();
}

void ResponseBuilder::end(Kind kind, bool cut) {
  json& item = items_.back();
  const json index = items_.size() - 1;
  const std::string& text = segments_.text();
  if (kind == Kind::kReasoning) {
    const json part = {{"type", "reasoning_text"}, {"text", text}};
    emit("response.reasoning_text.done",
         {{"item_id", item["id"]}, {"output_index", index}, {"content_index", 0}, {"text", text}});
    emit("response.content_part.done",
         {{"item_id", item["id"]}, {"output_index", index}, {"content_index", 0}, {"part", part}});
    item["content"] = json::array({part});
  } else if (kind == Kind::kText) {
    json part = {{"type", "output_text"}, {"text", text}, {"annotations", json::array()}};
    part["logprobs"] = logprobs_;
    emit("response.output_text.done", {{"item_id", item["id"]},
                                       {"output_index", index},
                                       {"content_index", 0},
                                       {"text", text},
                                       {"logprobs", json::array()}});
    emit("response.content_part.done",
         {{"item_id", item["id"]}, {"output_index", index}, {"content_index", 0}, {"part", part}});
    item["content"] = json::array({part});
  } else {
    item["arguments"] = text;
    emit("response.function_call_arguments.done", {{"item_id", item["id"]},
                                                   {"output_index", index},
                                                   {"name", item["name"]},
                                                   {"arguments", text}});
  }
  item["status"] = cut ? "incomplete" : "completed";
  emit("response.output_item.done", {{"output_index", index}, {"item", item}});
}

namespace {

// A token's entry: output_text's logprobs carry the bytes, a delta event's do not.
json logprob_json(const Tokenizer& tok, int32_t id, float lp, bool bytes) {
  json e = {{"token", sanitize_utf8(tok.token_bytes(id))}, {"logprob", lp}};
  if (bytes) {
    json b = json::array();
    for (unsigned char c : tok.token_bytes(id)) b.push_back(int(c));
    e["bytes"] = std::move(b);
  }
  return e;
}

}  // namespace

void ResponseBuilder::delta(Kind kind, const std::string& text, std::vector<TokenLogprob> lps) {
  const json& item = items_.back();
  const size_t index = items_.size() - 1;
  if (kind == Kind::kCall) {
    emit("response.function_call_arguments.delta",
         {{"item_id", item["id"]}, {"output_index", index}, {"delta", text}});
    return;
  }
  if (kind == Kind::kReasoning || !req_->chat.logprobs) {
    // The common event, once a token: written around the delta's JSON string rather than built
    // as a tree and dumped (the same text: the keys in dump()'s sorted order; tested).
    if (!events_) return;
    const bool reasoning = kind == Kind::kReasoning;
    const char* type = reasoning ? "response.reasoning_text.delta" : "response.output_text.delta";
    out_ += fmt::format(
        "event: {}\ndata: {{\"content_index\":0,\"delta\":{},\"item_id\":{},{}\"output_index\":{},"
        "\"sequence_number\":{},\"type\":\"{}\"}}\n\n",
        type, dump(json(text)), item_id_json_, reasoning ? "" : "\"logprobs\":[],", index,
        sequence_++, type);
    return;
  }
  json event_lps = json::array();
  for (const TokenLogprob& l : lps) {
    json top = json::array(), top_full = json::array();
    for (const auto& [id, lp] : l.top) {
      top.push_back(logprob_json(tok_, id, lp, false));
      top_full.push_back(logprob_json(tok_, id, lp, true));
    }
    json e = logprob_json(tok_, l.id, l.logprob, false),
         full = logprob_json(tok_, l.id, l.logprob, true);
    e["top_logprobs"] = std::move(top);
    full["top_logprobs"] = std::move(top_full);
    event_lps.push_back(std::move(e));
    logprobs_.push_back(std::move(full));
  }
  emit("response.output_text.delta", {{"item_id", item["id"]},
                                      {"output_index", index},
                                      {"content_index", 0},
                                      {"delta", text},
                                      {"logprobs", event_lps}});
}

void ResponseBuilder::finish() {
  segments_.finish();
  const json r = response();
  const std::string status = r["status"];
  emit(status == "completed"    ? "response.completed"
       : status == "incomplete" ? "response.incomplete"
                                : "response.failed",
       {{"response", r}});
}

json ResponseBuilder::response() const {
  const OutputSegments& g = segments_;
  std::string status = "completed";
  if (!g.error().empty() || g.finish_reason() == "abort")
    status = "failed";
  else if (g.finish_reason() == "length")
    status = "incomplete";
  json r = skeleton(status.c_str());
  r["output"] = items_;
  if (status == "incomplete") r["incomplete_details"] = {{"reason", "max_output_tokens"}};
  if (status == "failed")
    r["error"] = {{"code", "server_error"},
                  {"message", g.error().empty() ? "the request was cancelled" : g.error()}};
  r["usage"] = {
      {"input_tokens", g.prompt_tokens()},
      {"input_tokens_details", {{"cached_tokens", g.cached_tokens()}, {"cache_write_tokens", 0}}},
      {"output_tokens", g.completion_tokens()},
      {"output_tokens_details", {{"reasoning_tokens", g.reasoning_tokens()}}},
      {"total_tokens", g.prompt_tokens() + g.completion_tokens()}};
  return r;
}

std::shared_ptr<const StoredResponse> ResponseBuilder::stored() const {
  auto s = std::make_shared<StoredResponse>();
  s->response = response();
  s->input_items = req_->input_items;
  s->conversation = req_->conversation;
  ChatMessage m;
  m.role = "assistant";
  for (const json& it : items_) {
    const std::string type = it["type"];
    if (type == "reasoning") {
      for (const json& p : it["content"]) m.reasoning += p["text"].get<std::string>();
    } else if (type == "message") {
      for (const json& p : it["content"]) m.content += p["text"].get<std::string>();
    } else {
      m.tool_calls.push_back({it["call_id"], it["name"], it["arguments"]});
    }
  }
  s->conversation.push_back(std::move(m));
  return s;
}

// ---- the stream ---------------------------------------------------------------------------------

std::unique_ptr<StreamRenderer> responses_stream_renderer(
    std::shared_ptr<const ResponsesRequest> req, ResponseMeta meta, const Tokenizer& tok,
    std::shared_ptr<ResponseStore> store) {
  if (!req->store) store = nullptr;
  const std::string id = meta.id;
  return std::make_unique<BuilderStreamRenderer<ResponseBuilder>>(
      [store = std::move(store), id](const ResponseBuilder& b) {
        if (store) store->put(id, b.stored());
      },
      std::move(req), std::move(meta), tok, /*events=*/true);
}

}  // namespace md::server
