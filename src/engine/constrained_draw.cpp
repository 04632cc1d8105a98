// Host draws under a constraint and a logit bias (engine/constrained_draw.h).
#include "megadecode/engine/constrained_draw.h"

#include <limits>

namespace md {

int32_t constrained_draw(const TokenConstraint* constraint,
                         std::span<const std::pair<int32_t, float>> bias,
                         std::span<const float> logits, const SampleRow& row, int32_t drawn,
                         ConstrainedDrawScratch& s) {
  const size_t V = logits.size();
  auto plain = [&] { return drawn >= 0 ? drawn : sample_row(row, logits, s.sample); };
  bool masked = constraint != nullptr;
  if (masked) {
    s.mask.resize(V);
    if (constraint->allowed(s.mask) == 0) {
      if (bias.empty()) return plain();  // nothing allowed: nothing to enforce
      masked = false;
    } else if (bias.empty() && row.greedy() && drawn >= 0 && size_t(drawn) < V &&
               s.mask[size_t(drawn)]) {
      return drawn;
    }
  } else if (bias.empty()) {
    return plain();
  }
  s.masked.assign(logits.begin(), logits.end());
  for (const auto& [id, b] : bias)
    if (id >= 0 && size_t(id) < V) s.masked[size_t(id)] += b;
  if (masked && !constraint->broken())
    for (size_t i = 0; i < V; ++i)
      if (!s.mask[i]) s.masked[i] = -std::numeric_limits<float>::infinity();
  return sample_row(row, s.masked, s.sample);
}

}  // namespace md
