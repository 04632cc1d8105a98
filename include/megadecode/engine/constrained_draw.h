// A token drawn on the host under a constraint and/or a logit bias: the server's engine loop and
// the CLI's generator (text/generator.h) both draw this way, so that a constrained choice samples
// alike wherever it runs.
//
// The row's logits get the bias added and the ids the constraint refuses set to -inf, and are
// drawn by the same SampleRow (its uniform included) the step drew `drawn` with. Without a bias,
// the step's own draw stands when the constraint allows it and the row is greedy (the argmax of
// the allowed ids is then the same id). A constraint with nothing allowed (it cannot happen with
// the programs the server builds) leaves the draw unconstrained rather than failing.
#pragma once
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "megadecode/engine/sampler.h"
#include "megadecode/engine/token_constraint.h"

namespace md {

struct ConstrainedDrawScratch {
  std::vector<uint8_t> mask;
  std::vector<float> masked;
  SampleScratch sample;
};

// constraint: null for none; drawn: the step's draw by `row` (-1: none, the host draws).
int32_t constrained_draw(const TokenConstraint* constraint,
                         std::span<const std::pair<int32_t, float>> bias,
                         std::span<const float> logits, const SampleRow& row, int32_t drawn,
                         ConstrainedDrawScratch& scratch);

}  // namespace md
