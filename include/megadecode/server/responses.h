// OpenAI response bodies: completions and chat, whole and as stream chunks.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "megadecode/server/engine_loop.h"
#include "megadecode/server/request.h"
#include "megadecode/server/tool_calls.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace md::server {

struct ResponseMeta {
  std::string id;  // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;
  std::string model;
};

// A choice's events gathered (non-streamed responses).
struct ChoiceResult {
  std::string text, reasoning;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs, prompt_logprobs;
  std::string finish_reason;
  std::string stop_string;  // the stop string that ended it (empty: none)
  std::string error;
  int prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  void add(ChoiceEvent&& e);
};

// vLLM's `stop_reason` of a choice: the stop string that ended it, or the id of one of the
// request's stop_token_ids that did; null otherwise (the model's end of turn, a length cut).
nlohmann::json stop_reason_json(const CompletionRequest& req, const std::string& finish_reason,
                                const std::string& stop_string, const std::vector<int32_t>& tokens);

// `usage`, with prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache restored.
nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

// Ids of the tool calls a format does not carry (Kimi K3): "call_<the response id's hex>_<choice>_"
// then the call's number in the choice, so they are unique in the response.
std::string tool_call_id_prefix(const ResponseMeta& meta, size_t choice);
// "tool_calls" when the output held complete tool calls and the model ended its turn ("stop");
// otherwise the sampler's reason ("length": cut short, "abort"), with the calls still reported.
std::string tool_calls_finish_reason(const std::string& finish_reason, size_t calls);

// Completions "logprobs": {tokens, token_logprobs, top_logprobs, text_offset}; `leading_null`:
// the first entry is a prompt's first token (no logprob). text_offset starts at `offset` and
// advances by each token's text (its bytes, invalid UTF-8 replaced), streamed or not.
nlohmann::json completion_logprobs(const std::vector<TokenLogprob>& lps, const Tokenizer& tok,
                                   size_t offset, bool leading_null = false, int32_t first_id = -1);
// Completions echo: the prompt's entries (first token without a logprob), then the generated
// tokens', text offsets running on after the prompt text.
nlohmann::json echo_logprobs(const std::vector<int32_t>& prompt,
                             const std::vector<TokenLogprob>& prompt_lps,
                             const std::vector<TokenLogprob>& lps, const Tokenizer& tok);
// Chat "logprobs": {"content": [{token, logprob, bytes, top_logprobs}]}.
nlohmann::json chat_logprobs(const std::vector<TokenLogprob>& lps, const Tokenizer& tok);

nlohmann::json completion_body(const CompletionRequest& req, const std::vector<ChoiceResult>& rs,
                               const ResponseMeta& meta, const Tokenizer& tok);
nlohmann::json chat_body(const CompletionRequest& req, const std::vector<ChoiceResult>& rs,
                         const ResponseMeta& meta, const Tokenizer& tok);

nlohmann::json completion_chunk(const ResponseMeta& meta, int index, const std::string& text,
                                nlohmann::json logprobs, std::optional<std::string> finish);
nlohmann::json chat_chunk(const ResponseMeta& meta, int index, nlohmann::json delta,
                          nlohmann::json logprobs, std::optional<std::string> finish);

// JSON text for the wire (invalid UTF-8 replaced rather than thrown on).
std::string dump(const nlohmann::json& j);

// A stream chunk whose only varying field is one text (a plain completion chunk, a chat chunk
// whose delta is just content): dumped once with kMarker where the text goes, then every chunk is
// the dump's two halves around dump(text), which is byte for byte dump() of the whole chunk with
// that text (a JSON string serialises the same wherever it sits). It saves building and walking
// the chunk's JSON tree for every token (~5 us of a ~6 us render, on the engine thread).
class ChunkTemplate {
 public:
  static constexpr const char* kMarker = "\x01megadecode-chunk-text\x01";
  ChunkTemplate() = default;
  // `chunk` holds kMarker as exactly one string value (else valid() is false).
  explicit ChunkTemplate(const nlohmann::json& chunk);
  bool valid() const { return valid_; }
  // "data: " + dump(the chunk with `text`) + "\n\n".
  std::string sse(const std::string& text) const;

 private:
  std::string head_, tail_;
  bool valid_ = false;
};

}  // namespace md::server
