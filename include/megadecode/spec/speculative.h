// The speculative decoding loop over a plan executor (docs/speculative.md "The loop"). One step
// for a sequence whose history ends in the anchor (the latest decided token, not yet consumed):
//   1. the drafter proposes K tokens d_1..d_K;
//   2. one verify step of K + 1 rows [anchor, d_1..d_K], logits (or in-step greedy choices) for
//      every row, kept for a commit, the drafter's aux rows captured;
//   3. acceptance (spec/acceptance.h): a leading drafts accepted, plus the bonus / correction;
//   4. commit(seq, a + 1): the sequence has consumed the anchor and the accepted drafts;
//   5. the drafter observes the committed rows; d_1..d_a and the new token are emitted and the
//      new token is the next anchor.
// Emitted tokens are those plain decoding gives (greedy: identical; sampling: the same
// distribution), whatever the drafter proposes.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "megadecode/engine/sampler.h"
#include "megadecode/exec/executor.h"
#include "megadecode/spec/drafter.h"

namespace md {

inline constexpr int kMaxDraftTokens = 15;  // K + 1 verify rows within a commit's row log (16)

struct SpeculativeOptions {
  int num_draft_tokens = 4;  // K, 1 .. kMaxDraftTokens
  // >= 0: benchmark mode, every step accepts exactly this many drafts (<= K) whatever the target
  // says (the seed's fixed acceptance length; the emitted tokens are not the model's).
  int fixed_acceptance_length = -1;
  int prefill_chunk = 16;  // token rows per prefill step (<= plan::kMaxChainedRows with aux)
};
// Throws an md::Error naming the bad option.
void validate(const SpeculativeOptions& o);

// Counters since construction (or reset_stats): what the CLI, the bench and a server report.
struct SpeculativeStats {
  int64_t steps = 0;     // verify steps
  int64_t drafted = 0;   // drafted tokens verified (K a step)
  int64_t accepted = 0;  // drafts accepted
  int64_t emitted = 0;   // tokens the steps emitted (accepted + 1 a step, fewer where a stop
                         // or the token budget cut a step short)
  int64_t batches = 0;   // executor steps (a batched step verifies several sequences: steps
                         // counts each sequence's)
  // accepted_at[k]: steps whose draft k + 1 was accepted (so accepted_at[0] >= accepted_at[1]..)
  std::array<int64_t, kMaxDraftTokens> accepted_at{};
  double draft_seconds = 0, verify_seconds = 0, accept_seconds = 0, commit_seconds = 0;
  double acceptance_rate() const { return drafted ? double(accepted) / double(drafted) : 0; }
  double accepted_per_step() const { return steps ? double(accepted) / double(steps) : 0; }
  double tokens_per_step() const { return steps ? double(emitted) / double(steps) : 0; }
  double seconds() const {
    return draft_seconds + verify_seconds + accept_seconds + commit_seconds;
  }
};

// One sequence of a batched speculative step (SpeculativeDecoder::step_batch).
struct SpecSeq {
  SequenceState* seq = nullptr;
  std::vector<int32_t>* history = nullptr;  // as step(): every token, the last the anchor
  Sampler* sampler = nullptr;               // as step(); null: greedy without penalties
  Drafter* drafter = nullptr;               // this sequence's (it holds the sequence's context)
  bool logits = false;                      // emit receives each token's verify-row logits
  // Each emitted token (already appended to history) and, with `logits`, the [vocab] logits of
  // the verify row that chose it (else empty). False ends this sequence's step there.
  std::function<bool(int32_t, std::span<const float>)> emit;
};

// Rows of other sequences that ride in a batched speculative step (serve: prompt chunks beside
// the verifies), fed as given and consumed whole: each at most plan::kMaxChainedRows rows (the
// step keeps every sequence's rows for a commit). Their logit rows (logit_row_count(seqs), after
// the verifies' in the step) draw their tokens with `sampling` (one per logit row; empty:
// greedy) into next_ids, and their logits go to `logits` when it is not null; with aux layers
// their rows' aux states go to `aux` ([their rows][aux width], in order).
struct SpecExtra {
  std::span<const StepSeq> seqs;
  std::span<const SampleRow> sampling;
  int32_t* next_ids = nullptr;
  float* logits = nullptr;
  std::span<float> aux;
};

class SpeculativeDecoder {
 public:
  // The executor and drafter outlive the decoder. Sequences are the executor's (batch 1).
  SpeculativeDecoder(Executor& executor, Drafter& drafter, const SpeculativeOptions& o);
  // Without a drafter of its own, for step_batch only: every sequence brings its drafter, whose
  // aux_layers() must be these.
  SpeculativeDecoder(Executor& executor, std::span<const int> aux_layers,
                     const SpeculativeOptions& o);

  // A new sequence starts (the drafter forgets the old one).
  void reset() {
    if (drafter_) drafter_->reset();
  }

  // Feeds `ids` to `seq` through the plan in chunks (capturing the drafter's aux rows, which it
  // observes); logits (if not null) receives the last row's [vocab].
  void prefill(SequenceState& seq, std::span<const int32_t> ids, float* logits);

  // One speculative step. history: every token of the sequence, the last being the anchor;
  // seq has consumed all but that one (seq.pos == history.size() - 1). sampler: the sequence's
  // (its parameters, penalty counts and RNG stream; history[0, prompt) set as its prompt), or
  // null for greedy without penalties. Each emitted token is appended to history and handed to
  // emit; when emit returns false the step ends there (the sequence is committed to match:
  // it has consumed all of history but the last token). Returns false when emit stopped it.
  bool step(SequenceState& seq, std::vector<int32_t>& history, Sampler* sampler,
            const std::function<bool(int32_t)>& emit);

  // The same step for several sequences at once (each with its own drafter, sampler and emit):
  // one verify step of K + 1 rows per sequence, then per sequence acceptance, emits, commit and
  // the drafter's observe, as step() does for one. An md::Error before anything changes for a
  // malformed sequence.
  // extra: other sequences' rows fed in the same executor step (see SpecExtra).
  void step_batch(std::span<SpecSeq> seqs, const SpecExtra& extra = {});

  const SpeculativeStats& stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }
  const SpeculativeOptions& options() const { return o_; }
  Drafter& drafter() { return *drafter_; }

 private:
  Executor& ex_;
  Drafter* drafter_ = nullptr;  // step() and prefill()'s
  SpeculativeOptions o_;
  std::vector<int> aux_layers_;
  SpeculativeStats stats_;
  int64_t aux_width_ = 0;  // aux floats a token row
  std::vector<int32_t> rows_, choices_, hist_;
  std::vector<StepSeq> steps_;
  std::vector<int64_t> pos0_;
  std::vector<float> logits_, aux_;
  SampleScratch scratch_;
};

}  // namespace md
