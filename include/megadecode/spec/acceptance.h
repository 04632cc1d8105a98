// The acceptance rule of a speculative verify step (docs/speculative.md "Acceptance and
// exactness"). The verify step fed the anchor and K drafts d_1..d_K; its row i holds the target's
// logits for the position after d_i (row 0: after the anchor). For drafts that are deterministic
// functions of the context (n-gram lookup, greedy DSpark), exact speculative rejection sampling is:
// for i = 0, 1, ..: let p_i be the distribution sample_row would draw row i's token from (the
// same SampleDistribution, penalties counted over the history and d_1..d_i); accept d_{i+1} with
// probability p_i(d_{i+1}); at the first rejection draw the correction from p_i with d_{i+1}
// removed and renormalised; if all K are accepted draw the bonus token from p_K. Each emitted
// token then has exactly the distribution plain sampling gives it. A greedy row's p_i is its
// argmax with probability 1, so greedy acceptance is "the leading drafts equal to the target's
// choices" and the correction or bonus is the target's choice.
#pragma once
#include <cstdint>
#include <functional>
#include <span>

#include "megadecode/engine/sampler.h"

namespace md {

struct Acceptance {
  int accepted = 0;    // leading drafts accepted (0 .. K)
  int32_t token = -1;  // the bonus token (accepted == K) or the correction
};

// Greedy rows, decided inside the step: choices[i] is the target's token of verify row i
// (K + 1 of them). Accepted: the leading drafts equal to the choices; the token: the choice after
// them. forced >= 0 (the benchmark's fixed acceptance length, <= K) accepts exactly that many
// instead (the emitted tokens are then not the model's).
Acceptance accept_greedy(std::span<const int32_t> drafts, std::span<const int32_t> choices,
                         int forced = -1);

// Sampled rows (any SampleRow, greedy included) from the step's logits [K + 1][vocab].
// row(i) gives verify row i's SampleRow (its penalties over the history and drafts[0, i));
// uniform() the sequence's next uniform in [0, 1), taken only where a decision is random
// (p strictly between 0 and 1, and each correction or bonus draw). forced: as above.
Acceptance accept_sampled(std::span<const int32_t> drafts, std::span<const float> logits,
                          const std::function<SampleRow(int)>& row,
                          const std::function<double()>& uniform, SampleScratch& scratch,
                          int forced = -1);

}  // namespace md
