// Chat and completion chunks of a streamed response (stream_renderer.h).
#include <fmt/format.h>

#include "megadecode/base/util.h"
#include "stream_renderer.h"

namespace md::server {

using nlohmann::json;

ChatStreamRenderer::ChatStreamRenderer(CompletionRequest req, ResponseMeta meta,
                                       const Tokenizer& tok, size_t choices)
    : req_(std::move(req)),
      meta_(std::move(meta)),
      tok_(tok),
      text_offset_(choices, 0),
      echoed_(choices, false),
      plain_(choices) {
  if (req_.tools_given)
    for (size_t i = 0; i < choices; ++i)
      tools_.emplace_back(req_.chat_template, tool_call_id_prefix(meta_, i));
}

std::string ChatStreamRenderer::start() {
  std::string out;
  if (req_.kind != RequestKind::kChat) return out;
  for (size_t i = 0; i < text_offset_.size(); ++i) {
    json j =
        chat_chunk(meta_, int(i), {{"role", "assistant"}, {"content", ""}}, nullptr, std::nullopt);
    if (req_.include_usage) j["usage"] = nullptr;
    out += "data: " + dump(j) + "\n\n";
  }
  return out;
}

const ChunkTemplate& ChatStreamRenderer::plain_chunk(size_t i) {
  ChunkTemplate& t = plain_[i];
  if (!t.valid()) {
    json j = req_.kind == RequestKind::kChat
                 ? chat_chunk(meta_, int(i), {{"content", ChunkTemplate::kMarker}}, nullptr,
                              std::nullopt)
                 : completion_chunk(meta_, int(i), ChunkTemplate::kMarker, nullptr, std::nullopt);
    if (req_.include_usage) j["usage"] = nullptr;
    t = ChunkTemplate(j);
  }
  return t;
}

std::string ChatStreamRenderer::event(ChoiceEvent& e) {
  const CompletionRequest& r = req_;
  const bool chat = r.kind == RequestKind::kChat;
  std::string out;
  const size_t i = size_t(e.choice);
  if (!e.tokens.empty() && totals_.first_token == 0) totals_.first_token = now_seconds();
  // The common event, text and nothing else: from the choice's template (what the general path
  // below builds, byte for byte; tested).
  const bool plain = e.error.empty() && !e.finish_reason && !r.logprobs &&
                     (chat ? !r.tools_given && e.reasoning.empty() : !(r.echo && !echoed_[i]));
  if (plain && plain_chunk(i).valid()) {
    if (!e.text.empty() || !e.tokens.empty()) out = plain_[i].sse(e.text);
    return out;
  }
  auto send = [&](json j) {
    if (r.include_usage && !j.contains("usage")) j["usage"] = nullptr;
    if (e.finish_reason)  // vLLM's: the stop string or the request's stop id that ended it
      j["choices"][0]["stop_reason"] =
          stop_reason_json(r, *e.finish_reason, e.stop_string, e.tokens);
    out += "data: " + dump(j) + "\n\n";
  };
  if (!e.error.empty()) {
    ApiError err(500, e.error, "", "engine_error");
    out += "data: " + dump(err.to_json()) + "\n\n";
  } else if (chat) {
    json delta = json::object();
    std::string text = std::move(e.text);
    if (!e.reasoning.empty()) delta["reasoning_content"] = e.reasoning;
    std::string finish = e.finish_reason.value_or("");
    if (r.tools_given) {
      // Content goes out as it comes unless it may begin a tool-call section; a call goes out
      // as its header completes (index, id, name), then its arguments in pieces.
      ToolCallStream& tc = tools_[i];
      ToolCallDelta d = tc.feed(text);
      if (e.finish_reason) {
        ToolCallDelta rest = tc.finish();
        d.content += rest.content;
        for (auto& p : rest.pieces) {
          if (!p.first && !d.pieces.empty() && d.pieces.back().index == p.index)
            d.pieces.back().arguments += p.arguments;
          else
            d.pieces.push_back(std::move(p));
        }
        finish = tool_calls_finish_reason(finish, tc.calls());
      }
      text = std::move(d.content);
      if (!d.pieces.empty()) {
        json calls = json::array();
        for (const ToolCallPiece& p : d.pieces) calls.push_back(tool_call_piece_json(p));
        delta["tool_calls"] = std::move(calls);
      }
    }
    // A token whose text is held back (an incomplete UTF-8 sequence, a possible stop string)
    // still gets its chunk, with empty content, as vLLM sends it: a client sees every token
    // arrive. (A tool-call parser's held-back content sends nothing, as vLLM's parsers do.)
    if (!text.empty() || (!r.tools_given && !e.tokens.empty() && delta.empty()))
      delta["content"] = text;
    json lp = r.logprobs && !e.logprobs.empty() ? chat_logprobs(e.logprobs, tok_) : json(nullptr);
    if (!delta.empty() || !lp.is_null() || e.finish_reason)
      send(chat_chunk(meta_, int(i), delta, lp,
                      e.finish_reason ? std::optional<std::string>(finish) : std::nullopt));
  } else {
    json lp = nullptr;
    std::string text = std::move(e.text);
    if (r.echo && !echoed_[i]) {
      // The prompt goes out with the choice's first event, which carries its logprobs.
      echoed_[i] = true;
      const std::vector<int32_t>& prompt = r.prompts[i / size_t(r.n)];
      if (r.logprobs) lp = echo_logprobs(prompt, e.prompt_logprobs, e.logprobs, tok_);
      text = sanitize_utf8(tok_.decode(prompt, false)) + text;
    } else if (r.logprobs && !e.logprobs.empty()) {
      lp = completion_logprobs(e.logprobs, tok_, text_offset_[i]);
    }
    if (lp.is_object() && !lp["tokens"].empty())  // the next offsets go on from the last token
      text_offset_[i] =
          lp["text_offset"].back().get<size_t>() + lp["tokens"].back().get<std::string>().size();
    if (!text.empty() || !e.tokens.empty() || !lp.is_null() || e.finish_reason)
      send(completion_chunk(meta_, int(i), text, lp, e.finish_reason));
  }
  if (e.finish_reason || !e.error.empty()) {
    // A prompt counts once however many choices it has.
    if (chat ? i == 0 : i % size_t(r.n) == 0) {
      totals_.prompt_tokens += e.prompt_tokens;
      totals_.cached_tokens += e.cached_tokens;
    }
    totals_.completion_tokens += e.completion_tokens;
  }
  return out;
}

std::string ChatStreamRenderer::end() {
  std::string out;
  if (req_.include_usage) {
    const bool chat = req_.kind == RequestKind::kChat;
    const json u = {{"id", meta_.id},
                    {"object", chat ? "chat.completion.chunk" : "text_completion"},
                    {"created", meta_.created},
                    {"model", meta_.model},
                    {"choices", json::array()},
                    {"usage", usage_json(totals_.prompt_tokens, totals_.completion_tokens,
                                         totals_.cached_tokens)}};
    out += "data: " + dump(u) + "\n\n";
  }
  out += "data: [DONE]\n\n";
  return out;
}

}  // namespace md::server
