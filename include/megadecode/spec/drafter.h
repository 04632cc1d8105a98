// What proposes the tokens a speculative step verifies (docs/speculative.md "The loop"): a drafter
// sees the sequence's tokens (and, if it asks for them, the target's residual rows of every token
// the target consumed) and proposes the next K tokens. Drafters here are deterministic functions of
// what they have seen, which is what the acceptance rule (spec/acceptance.h) relies on for exact
// sampling: a deterministic draft x is accepted with probability p(x).
#pragma once
#include <cstdint>
#include <span>
#include <string_view>

namespace md {

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::string_view name() const = 0;

  // Target layer ids whose input residual rows observe() wants (AuxCapture's ids); empty: none,
  // and the decoder captures nothing.
  virtual std::span<const int> aux_layers() const { return {}; }

  // A new sequence starts: forget everything observed.
  virtual void reset() = 0;

  // The target consumed `tokens` at positions pos, pos + 1, ... (a prefill chunk, or the
  // committed rows of a verify step: the anchor and the accepted drafts). aux holds their rows
  // [tokens.size()][aux_layers().size() * hidden] when aux_layers() is not empty.
  virtual void observe(std::span<const int32_t> tokens, int64_t pos,
                       std::span<const float> aux) = 0;

  // Proposes out.size() tokens (1 .. 15) to follow `context`: every token of the sequence, the
  // last one being the anchor (decided but not yet consumed by the target, at position
  // context.size() - 1). Any valid ids will do: a bad draft costs speed, never correctness.
  virtual void propose(std::span<const int32_t> context, std::span<int32_t> out) = 0;

  // Batched proposals (several sequences' drafters in one step, e.g. one draft plan step on an
  // executor): drafters with the same non-null batch_key() are of one kind and may be proposed
  // together by any of them, which fills outs[i] (all of one size) for group[i] as
  // group[i]->propose(contexts[i], outs[i]) would. The default proposes one by one.
  virtual const void* batch_key() const { return nullptr; }
  virtual void propose_together(std::span<Drafter* const> group,
                                std::span<const std::span<const int32_t>> contexts,
                                std::span<const std::span<int32_t>> outs) {
    for (size_t i = 0; i < group.size(); ++i) group[i]->propose(contexts[i], outs[i]);
  }
};

}  // namespace md
