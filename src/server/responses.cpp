#include "megadecode/server/responses.h"

#include <algorithm>

namespace md::server {

using nlohmann::json;

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

ChunkTemplate::ChunkTemplate(const json& chunk) {
  const std::string whole = dump(chunk), marker = dump(json(kMarker));
  const size_t at = whole.find(marker);
  if (at == std::string::npos || whole.find(marker, at + 1) != std::string::npos) return;
  head_ = "data: " + whole.substr(0, at);
  tail_ = whole.substr(at + marker.size()) + "\n\n";
  valid_ = true;
}

std::string ChunkTemplate::sse(const std::string& text) const {
  const std::string t = dump(json(text));
  std::string out;
  out.reserve(head_.size() + t.size() + tail_.size());
  out += head_;
  out += t;
  out += tail_;
  return out;
}

void ChoiceResult::add(ChoiceEvent&& e) {
  text += e.text;
  reasoning += e.reasoning;
  tokens.insert(tokens.end(), e.tokens.begin(), e.tokens.end());
  for (auto& l : e.logprobs) logprobs.push_back(std::move(l));
  if (!e.prompt_logprobs.empty()) prompt_logprobs = std::move(e.prompt_logprobs);
  if (e.finish_reason) {
    finish_reason = *e.finish_reason;
    stop_string = e.stop_string;
  }
  if (!e.error.empty()) error = e.error;
  if (e.finish_reason || !e.error.empty()) {
    prompt_tokens = e.prompt_tokens;
    completion_tokens = e.completion_tokens;
    cached_tokens = e.cached_tokens;
  }
}

json stop_reason_json(const CompletionRequest& req, const std::string& finish_reason,
                      const std::string& stop_string, const std::vector<int32_t>& tokens) {
  if (finish_reason != "stop") return nullptr;
  if (!stop_string.empty()) return stop_string;
  const std::vector<int32_t>& ids = req.sampling.stop_token_ids;
  const size_t n = std::min(req.user_stop_ids, ids.size());
  if (!tokens.empty() && std::find(ids.begin(), ids.begin() + ptrdiff_t(n), tokens.back()) !=
                             ids.begin() + ptrdiff_t(n))
    return tokens.back();
  return nullptr;
}

std::string tool_calls_finish_reason(const std::string& finish_reason, size_t calls) {
  return calls > 0 && finish_reason == "stop" ? "tool_calls" : finish_reason;
}

json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

std::string tool_call_id_prefix(const ResponseMeta& meta, size_t choice) {
  const size_t dash = meta.id.rfind('-');
  return "call_" + meta.id.substr(dash == std::string::npos ? 0 : dash + 1) + "_" +
         std::to_string(choice) + "_";
}

namespace {

std::string token_text(const Tokenizer& tok, int32_t id) {
  return sanitize_utf8(tok.token_bytes(id));
}

json token_bytes_json(const Tokenizer& tok, int32_t id) {
  json b = json::array();
  for (unsigned char c : tok.token_bytes(id)) b.push_back(int(c));
  return b;
}

}  // namespace

json completion_logprobs(const std::vector<TokenLogprob>& lps, const Tokenizer& tok, size_t offset,
                         bool leading_null, int32_t first_id) {
  json tokens = json::array(), token_lps = json::array(), tops = json::array(),
       offsets = json::array();
  auto add = [&](int32_t id, json lp, json top) {
    const std::string t = token_text(tok, id);
    tokens.push_back(t);
    token_lps.push_back(std::move(lp));
    tops.push_back(std::move(top));
    offsets.push_back(offset);
    offset += t.size();
  };
  if (leading_null) add(first_id, nullptr, nullptr);
  for (const TokenLogprob& l : lps) {
    json top = json::object();
    for (const auto& [id, lp] : l.top) top[token_text(tok, id)] = lp;
    add(l.id, l.logprob, l.top.empty() ? json(nullptr) : top);
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_lps},
          {"top_logprobs", tops},
          {"text_offset", offsets}};
}

json echo_logprobs(const std::vector<int32_t>& prompt, const std::vector<TokenLogprob>& prompt_lps,
                   const std::vector<TokenLogprob>& lps, const Tokenizer& tok) {
  const size_t prompt_text = sanitize_utf8(tok.decode(prompt, false)).size();
  json all = completion_logprobs(prompt_lps, tok, 0, true, prompt[0]);
  json gen = completion_logprobs(lps, tok, prompt_text);
  for (const char* k : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
    for (auto& v : gen[k]) all[k].push_back(v);
  return all;
}

json chat_logprobs(const std::vector<TokenLogprob>& lps, const Tokenizer& tok) {
  json content = json::array();
  for (const TokenLogprob& l : lps) {
    json top = json::array();
    for (const auto& [id, lp] : l.top)
      top.push_back(
          {{"token", token_text(tok, id)}, {"logprob", lp}, {"bytes", token_bytes_json(tok, id)}});
    content.push_back({{"token", token_text(tok, l.id)},
                       {"logprob", l.logprob},
                       {"bytes", token_bytes_json(tok, l.id)},
                       {"top_logprobs", top}});
  }
  return {{"content", content}};
}

json completion_body(const CompletionRequest& req, const std::vector<ChoiceResult>& rs,
                     const ResponseMeta& meta, const Tokenizer& tok) {
  json choices = json::array();
  int64_t prompt = 0, completion = 0, cached = 0;
  for (size_t i = 0; i < rs.size(); ++i) {
    const ChoiceResult& r = rs[i];
    const std::vector<int32_t>& p = req.prompts[i / size_t(req.n)];
    std::string text = r.text;
    json logprobs = nullptr;
    if (req.echo) {
      const std::string ptext = sanitize_utf8(tok.decode(p, false));
      text = ptext + text;
      if (req.logprobs) logprobs = echo_logprobs(p, r.prompt_logprobs, r.logprobs, tok);
    } else if (req.logprobs) {
      logprobs = completion_logprobs(r.logprobs, tok, 0);
    }
    choices.push_back(
        {{"index", i},
         {"text", text},
         {"logprobs", logprobs},
         {"finish_reason", r.finish_reason},
         {"stop_reason", stop_reason_json(req, r.finish_reason, r.stop_string, r.tokens)}});
    // Each prompt counts once, whatever n is (as the OpenAI API counts it).
    if (i % size_t(req.n) == 0) {
      prompt += r.prompt_tokens;
      cached += r.cached_tokens;
    }
    completion += r.completion_tokens;
  }
  return {{"id", meta.id},           {"object", "text_completion"},
          {"created", meta.created}, {"model", meta.model},
          {"choices", choices},      {"usage", usage_json(prompt, completion, cached)}};
}

json chat_body(const CompletionRequest& req, const std::vector<ChoiceResult>& rs,
               const ResponseMeta& meta, const Tokenizer& tok) {
  json choices = json::array();
  int64_t prompt = 0, completion = 0, cached = 0;
  for (size_t i = 0; i < rs.size(); ++i) {
    const ChoiceResult& r = rs[i];
    json msg = {{"role", "assistant"}, {"content", r.text}};
    std::string finish = r.finish_reason;
    if (req.tools_given) {
      const ToolCallSplit split =
          split_tool_calls(req.chat_template, r.text, tool_call_id_prefix(meta, i));
      // (An empty, closed section is markup too: the stream drops it, so the message does.)
      msg["content"] = split.content;
      if (!split.calls.empty()) {
        if (split.content.empty()) msg["content"] = nullptr;
        json calls = json::array();
        for (const ParsedToolCall& c : split.calls) calls.push_back(tool_call_json(c));
        msg["tool_calls"] = std::move(calls);
        finish = tool_calls_finish_reason(finish, split.calls.size());
      }
    }
    if (!r.reasoning.empty()) msg["reasoning_content"] = r.reasoning;
    choices.push_back(
        {{"index", i},
         {"message", msg},
         {"logprobs", req.logprobs ? chat_logprobs(r.logprobs, tok) : json(nullptr)},
         {"finish_reason", finish},
         {"stop_reason", stop_reason_json(req, r.finish_reason, r.stop_string, r.tokens)}});
    if (i == 0) {
      prompt = r.prompt_tokens;
      cached = r.cached_tokens;
    }
    completion += r.completion_tokens;
  }
  return {{"id", meta.id},           {"object", "chat.completion"},
          {"created", meta.created}, {"model", meta.model},
          {"choices", choices},      {"usage", usage_json(prompt, completion, cached)}};
}

json completion_chunk(const ResponseMeta& meta, int index, const std::string& text, json logprobs,
                      std::optional<std::string> finish) {
  return {{"id", meta.id},
          {"object", "text_completion"},
          {"created", meta.created},
          {"model", meta.model},
          {"choices", json::array({{{"index", index},
                                    {"text", text},
                                    {"logprobs", std::move(logprobs)},
                                    {"finish_reason", finish ? json(*finish) : json(nullptr)}}})}};
}

json chat_chunk(const ResponseMeta& meta, int index, json delta, json logprobs,
                std::optional<std::string> finish) {
  return {{"id", meta.id},
          {"object", "chat.completion.chunk"},
          {"created", meta.created},
          {"model", meta.model},
          {"choices", json::array({{{"index", index},
                                    {"delta", std::move(delta)},
                                    {"logprobs", std::move(logprobs)},
                                    {"finish_reason", finish ? json(*finish) : json(nullptr)}}})}};
}

}  // namespace md::server
