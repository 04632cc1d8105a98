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

// The largest logit of `logits` and its id (first_id + its index; ties to the lowest id; -inf
// entries never win: all -inf gives id -1). A NaN is an md::Error naming its id. What a greedy
// row draws, and what each rank of a distributed step finds in its vocabulary block before the
// ranks exchange their (value, id) pairs (exec/cpu/tiles_dist.cpp).
struct LogitMax {
  float value;
  int32_t id;
};
LogitMax logit_max(std::span<const float> logits, int32_t first_id = 0);

// One logit row's sampling as plain data: what a plan's sample instruction reads (a device
// backend copies it as it is; no host object behind it). Sampler::prepare builds it from the
// sequence's parameters, penalty counts and RNG stream. The default is greedy.
struct PenaltyCount {
  int32_t id;            // an id seen in prompt + output
  int32_t output_count;  // how often it occurs in the output (frequency / presence penalties)
};
struct SampleRow {
  float temperature = 0.0f;  // 0: greedy (argmax of the penalised logits, ties to the lowest id)
  int32_t top_k = 0;
  float top_p = 1.0f, min_p = 0.0f;
  float repetition_penalty = 1.0f, presence_penalty = 0.0f, frequency_penalty = 0.0f;
  double uniform = 0.0;  // the draw's uniform in [0, 1), from the sequence's RNG stream
  const PenaltyCount* penalties = nullptr;  // the ids the penalties apply to (any order)
  uint32_t num_penalties = 0;
  bool greedy() const { return temperature == 0.0f; }
  bool has_penalties() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
};

// Working memory of sample_row, grown to the vocabulary on first use and then reused (one per
// thread that samples).
struct SampleScratch {
  struct Cand {
    int32_t id;
    float x;  // logit / temperature
    float w;  // exp(x - max x)
  };
  std::vector<float> work;
  std::vector<Cand> cands;
  std::vector<double> bucket_mass;
};

// The distribution one row's token is drawn from: steps 1-6 above applied to the row's logits.
// Token support[i].id has probability support[i].w / total; every other id has probability 0.
// The support is listed in the order the draw walks it (ids ascending without top-k / top-p,
// otherwise the kept candidates). A greedy row's distribution is its argmax with weight 1. It
// points into the scratch it was made with (valid until that scratch is used again).
struct SampleDistribution {
  std::span<const SampleScratch::Cand> support;
  double total = 0;  // sum of the support's weights (> 0)
  // w / total of `id`, 0 outside the support.
  double probability(int32_t id) const;
};

// Steps 1-6 of one row on plain data: what sample_row draws from, and what a speculative verifier
// accepts or rejects a drafted token against (spec/acceptance.h). NaN logits or all -inf are an
// md::Error.
SampleDistribution sample_distribution(const SampleRow& row, std::span<const float> logits,
                                       SampleScratch& scratch);
// Step 7: the token of `uniform` in [0, 1): the first support entry at which the running weight
// sum passes uniform * total. With `excluded` >= 0 that token is taken out and the rest
// renormalised (a rejected draft's residual distribution); if nothing else is left, `excluded`.
int32_t draw_from(const SampleDistribution& d, double uniform, int32_t excluded = -1);

// The sampling math of one row on plain data (steps 1-7 above: draw_from(sample_distribution,
// row.uniform)), the same for the host Sampler and a plan's sample tile. NaN logits or all -inf
// are an md::Error.
int32_t sample_row(const SampleRow& row, std::span<const float> logits, SampleScratch& scratch);
// Steps 1-2 in place.
void apply_penalties(const SampleRow& row, std::span<float> logits);

// Samples one sequence. Keeps per-sequence state (RNG stream, token counts for the penalties), so
// use one Sampler per sequence and pass a history that only grows by appending.
class Sampler {
 public:
  Sampler(const SamplingParams& params, int64_t vocab);

  // `history` is prompt + generated ids. Unless set_prompt_length() was called, the history seen
  // by the first call is taken to be the prompt and everything appended later counts as output
  // (presence/frequency penalties look at output ids only, as in vLLM).
  int32_t sample(std::span<const float> logits, std::span<const int32_t> history);

  // The plain-data form of the next sample (what sample() computes with): the parameters, the
  // penalty counts of `history` and the next uniform of the RNG stream (taken now: a non-greedy
  // prepare advances the stream as a sample does). Its penalties point into this sampler and
  // stay valid until the next prepare/sample.
  SampleRow prepare(std::span<const int32_t> history);
  // prepare without taking a uniform (the row's `uniform` is 0): the parameters and penalty
  // counts a speculative verifier needs for each drafted position, whose draws it takes itself
  // with uniform().
  SampleRow prepare_without_draw(std::span<const int32_t> history) {
    return row_without_draw(history);
  }
  // The next uniform in [0, 1) of this sequence's RNG stream.
  double uniform() { return rng_.uniform(); }

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
  SampleRow row_without_draw(std::span<const int32_t> history);

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
  std::vector<PenaltyCount> entries_;  // prepare's plain-data copy of the counts
  SampleScratch scratch_;
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
  // The stop string that completed (the earliest in the text; the first listed of those ending
  // there); empty before one does.
  const std::string& matched() const;

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
  int matched_ = -1;
};

}  // namespace md
