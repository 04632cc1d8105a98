// The reference path (Model::forward) behind the Executor interface, so that what drives the
// plan executors (the server's engine loop) can also run on the oracle: each sequence of a step
// runs its rows through Model::forward, one sequence after another, and each logit row is
// sampled with sample_row, the math the plan's sample tile uses. No plan, no commit (the
// reference keeps no row log), so it serves correctness checks rather than speed.
#pragma once
#include <memory>

#include "megadecode/exec/executor.h"

namespace md {

class ReferenceExecutor final : public Executor {
 public:
  // A state pool of its own (at least max_batch sequences), as the plan executors have.
  ReferenceExecutor(Model& model, int max_batch, const PoolOptions& states = {});
  ~ReferenceExecutor() override;

  void commit(SequenceState& seq, int k) override;  // an md::Error: not supported
  StatePool& states() override { return *pool_; }
  const plan::Plan& plan(int batch, int rows = 1) override;  // an md::Error: no plan
  std::string_view name() const override { return "reference"; }
  const Model& model() const override { return model_; }
  int workers() const override { return 1; }
  int max_batch() const override { return max_batch_; }
  const StepStats& last_step_stats() const override { return stats_; }
  void set_watchdog_seconds(double) override {}

 protected:
  void run_step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids,
                std::span<const SampleRow> sampling, const StepOptions& options) override;

 private:
  Model& model_;
  int max_batch_;
  std::unique_ptr<StatePool> pool_;
  StepStats stats_;
  std::vector<float> scratch_logits_;
  std::vector<float> all_logits_;  // the step's logits when only next_ids are wanted
  SampleScratch sample_scratch_;
};

}  // namespace md
