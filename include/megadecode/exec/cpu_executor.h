// The CPU backend of the plan executor (docs/architecture.md "Executors"):
//
//  * megakernel: W persistent threads pinned to cores, each walking its own instruction queue;
//    between tiles a worker only waits for the counters its next tile names (acquire), and
//    signals its own (release) when done. No barrier inside a step.
//  * opbyop: the same instructions, grouped into barrier phases (one op, or several independent
//    ops); every worker runs its share of a phase, then all meet at a barrier.
//
// Both compute, bit for bit, what Model::forward computes for each sequence fed one token at a
// time (same kernels, same rounding points; matmul rows do not depend on how they are split or
// batched).
#pragma once
#include <functional>
#include <memory>

#include "megadecode/base/threads.h"
#include "megadecode/exec/executor.h"

namespace md {

class CpuExecutor final : public Executor {
 public:
  CpuExecutor(Model& model, int max_batch, int workers, ExecutorKind kind);
  CpuExecutor(Model& model, int max_batch, ExecutorKind kind, const ExecutorOptions& opt);
  ~CpuExecutor() override;

  void commit(SequenceState& seq, int k) override;
  const plan::Plan& plan(int batch, int rows = 1) override;
  StatePool& states() override;
  std::string_view name() const override;
  const Model& model() const override;
  int workers() const override;
  int max_batch() const override;
  const StepStats& last_step_stats() const override;
  void set_watchdog_seconds(double s) override;
  ExecutorKind kind() const;
  bool runs_drafts() const override { return true; }
  void attach_draft(const DraftConfig& c, const DraftWeights& w) override;
  void draft_step(std::span<const DraftStepSeq> seqs) override;
  // The draft plan for a step shape (after attach_draft; compiled on first use and cached).
  const plan::Plan& draft_plan(int batch, int ctx_rows, int block_rows);

  // Test hooks: edit one instruction of the cached plan for `batch` (its global copy and its
  // queue copy), e.g. an unreachable wait or the kFlagTestStall flag; drop_plans() forgets all
  // plans (and counters) so the next step recompiles.
  void edit_instr_for_testing(int batch, uint32_t id, const std::function<void(plan::Instr&)>& f);
  void drop_plans();

 protected:
  void run_step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids,
                std::span<const SampleRow> sampling, const StepOptions& options) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace md
