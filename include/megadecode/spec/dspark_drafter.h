// The DSpark draft model (spec/draft_model.h) as a Drafter: the target's residual rows of every
// consumed token enter the draft's ring (update_context), and each proposal is one block from the
// anchor (draft): anchor + K - 1 mask rows give K Markov-biased greedy drafts. Greedy drafting
// makes the proposal a deterministic function of the context, so the verifier's acceptance rule
// for deterministic drafts is exact (docs/speculative.md).
#pragma once
#include <string_view>
#include <vector>

#include "megadecode/spec/draft_model.h"
#include "megadecode/spec/drafter.h"

namespace md {

class DSparkDrafter : public Drafter {
 public:
  // The model must outlive the drafter; one drafter holds one sequence's ring.
  explicit DSparkDrafter(const DraftModel& model);
  std::string_view name() const override { return "dspark"; }
  std::span<const int> aux_layers() const override { return model_.config().aux_layer_ids; }
  void reset() override { state_.reset(); }
  void observe(std::span<const int32_t> tokens, int64_t pos, std::span<const float> aux) override;
  void propose(std::span<const int32_t> context, std::span<int32_t> out) override;
  const DraftState& state() const { return state_; }

 private:
  const DraftModel& model_;
  DraftState state_;
  std::vector<int32_t> positions_;
};

}  // namespace md
