// Token sampling with the semantics of vLLM / Hugging Face generation, and a stop-string matcher
// for streaming output.
//
// Order of operations in Sampler::sample (the same order vLLM and HF apply them):
//   1. repetition penalty on every id seen in prompt+output (divide positive logits, multiply
//      negative ones by the penalty),
//   2. frequency and presence penalties (OpenAI style) on ids seen in the generated output only,
//   3. temperature (0 => greedy argmax, ties to the lowest id),
//   4. top-k, 5. top-p (nucleus), 6. min-p, 7. a draw from the seeded RNG.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/base/util.h"

namespace md {

struct SamplingParams {
  float temperature = 1.0f;         // 0 => greedy
  int top_k = 0;                    // 0 = off
  float top_p = 1.0f;               // in (0, 1]; 1 = off
  float min_p = 0.0f;               // in [0, 1]; 0 = off
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  float presence_penalty = 0.0f;    // in [-2, 2]
  float frequency_penalty = 0.0f;   // in [-2, 2]
  uint64_t seed = 0;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop_strings;
  int max_tokens = 256;  // >= 1

  // Throws md::Error naming the first invalid field.
  void validate() const;
  bool greedy() const { return temperature == 0.0f; }
};

// Samples one sequence. Keeps per-sequence state (RNG stream, token counts for the penalties), so
// use one Sampler per sequence and pass a history that only grows by appending.
class Sampler {
 public:
  Sampler(const SamplingParams& params, int64_t vocab);

  // `history` is prompt + generated ids. Unless set_prompt_length() was called, the history seen
  // by the first call is taken to be the prompt and everything appended later counts as output
  // (presence/frequency penalties look at output ids only, as in vLLM).
  int32_t sample(std::span<const float> logits, std::span<const int32_t> history);

  // Marks history[0, n) as the prompt (resets the penalty counts).
  void set_prompt_length(size_t n);

  // Applies steps 1-2 in place; exposed so the penalties can be checked against hand-computed
  // values.
  void penalize(std::span<float> logits, std::span<const int32_t> history);

  const SamplingParams& params() const { return params_; }
  int64_t vocab() const { return vocab_; }

 private:
  bool has_penalties() const;
  void update_counts(std::span<const int32_t> history);
  int32_t argmax(std::span<const float> logits) const;
  int32_t draw(std::span<const float> logits);

  SamplingParams params_;
  int64_t vocab_;
  Rng rng_;
  std::optional<size_t> prompt_len_;

  // Incremental penalty state: counts_ of each id in the output, seen_ for prompt+output, and the
  // ids touched so far (so applying the penalties costs O(distinct ids), not O(vocab)).
  size_t counted_len_ = 0;
  std::vector<int32_t> counts_;
  std::vector<uint8_t> seen_;
  std::vector<int32_t> touched_;

  // Scratch buffers reused across calls.
  std::vector<float> work_;
  struct Cand {
    int32_t id;
    float x;  // logit / temperature
    float w;  // exp(x - max x)
  };
  std::vector<Cand> cands_;
  std::vector<double> bucket_mass_;
  std::vector<float> weights_;
};

// Incremental stop-string detection over streamed text. feed() returns the text that is safe to
// show now: anything that might still turn out to be the start of a stop string is held back until
// the next feed() or flush(). When a stop string completes, the text before it is returned, the
// stop string itself is dropped, and every later feed() returns nothing.
class StopMatcher {
 public:
  struct Result {
    std::string text;
    bool stopped = false;
  };

  explicit StopMatcher(std::vector<std::string> stops);

  Result feed(std::string_view chunk);
  // Releases held-back text when generation ends without a stop string.
  std::string flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

}  // namespace md
