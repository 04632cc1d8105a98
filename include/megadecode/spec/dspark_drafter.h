// The DSpark draft model (spec/draft_model.h) as a Drafter: the target's residual rows of every
// consumed token enter the draft's ring (update_context), and each proposal is one block from the
// anchor (draft): anchor + K - 1 mask rows give K Markov-biased greedy drafts. Greedy drafting
// makes the proposal a deterministic function of the context, so the verifier's acceptance rule
// for deterministic drafts is exact (docs/speculative.md).
//
// Where it runs: on the host (DraftModel's forward), or, given an executor that runs draft plans
// (Executor::runs_drafts), as the draft plan on that executor's workers. Then observe() only
// stages the rows, and the next propose() runs one draft step that appends them and drafts the
// block (the speculative step is two plan executions: the verify and this one;
// docs/speculative.md "The draft plan"); drafters on one executor propose together in one batched
// draft step (propose_together). Both paths draft the same tokens bit for bit.
#pragma once
#include <memory>
#include <string_view>
#include <vector>

#include "megadecode/exec/executor.h"
#include "megadecode/spec/draft_model.h"
#include "megadecode/spec/drafter.h"

namespace md {

class DSparkDrafter : public Drafter {
 public:
  // The model (and the executor, if any) must outlive the drafter; one drafter holds one
  // sequence's ring. With an executor that runs draft plans the draft is attached to it (once
  // per model) and runs there; otherwise (null, or a backend without draft plans) on the host.
  explicit DSparkDrafter(const DraftModel& model, Executor* executor = nullptr);
  std::string_view name() const override { return "dspark"; }
  std::span<const int> aux_layers() const override { return model_.config().aux_layer_ids; }
  void reset() override;
  void observe(std::span<const int32_t> tokens, int64_t pos, std::span<const float> aux) override;
  void propose(std::span<const int32_t> context, std::span<int32_t> out) override;
  const void* batch_key() const override { return ex_; }
  void propose_together(std::span<Drafter* const> group,
                        std::span<const std::span<const int32_t>> contexts,
                        std::span<const std::span<int32_t>> outs) override;

  // Whether the draft runs as plan steps on an executor.
  bool on_executor() const { return ex_ != nullptr; }
  // Applies the staged context rows now (the executor path; a no-op on the host).
  void flush();
  // The ring (after flush() on the executor path: staged rows are not in it yet; there, a host
  // copy of the executor's ring, read back by this call).
  const DraftState& state() const;

 private:
  DraftStepSeq step_seq(std::span<const int32_t> context, std::span<int32_t> out);
  void staged_done();

  const DraftModel& model_;
  Executor* ex_ = nullptr;  // runs the draft plans; null: the host forward
  // The ring: in the executor's memory on the executor path (state_ then only counts the rows
  // and holds state()'s copies), in state_ on the host.
  std::unique_ptr<DraftRingMemory> ring_;
  mutable DraftState state_;
  std::vector<int32_t> positions_;
  std::vector<float> aux_;  // staged context rows (executor path)
};

}  // namespace md
