// The CUDA backend of the plan executor (docs/cuda.md): the plan's instructions run as CUDA
// kernels, on a GPU or on the host simulation of the CUDA execution model (the same kernel
// sources, src/kernels/cuda).
//
//  * cuda-megakernel: one persistent block per SM (the count queried at run time), each walking
//    its queue of the plan; counters in device memory (release/acquire at device scope), a
//    watchdog and an abort flag.
//  * cuda-opbyop: one kernel launch per barrier phase of the plan, every block one instruction.
//
// Both run the same tiles with the same blocks, so they agree bit for bit with each other; they
// agree with the CPU executors within fp32 reordering (the reductions sum in another order; the
// bf16 rounding points are the same).
#pragma once
#include <functional>
#include <memory>

#include "megadecode/exec/executor.h"

namespace md {

enum class CudaTarget : uint8_t { kGpu, kSim };

class CudaExecutor final : public Executor {
 public:
  // An md::Error "no CUDA device: ..." when target is kGpu and there is none.
  CudaExecutor(Model& model, int max_batch, ExecutorKind kind, CudaTarget target,
               const ExecutorOptions& opt = {});
  ~CudaExecutor() override;

  void commit(SequenceState& seq, int k) override;
  const plan::Plan& plan(int batch, int rows = 1) override;
  StatePool& states() override;
  std::string_view name() const override;  // "cuda-megakernel" | "cuda-opbyop"
  const Model& model() const override;
  int workers() const override;  // blocks of the megakernel: the device's SMs
  int max_batch() const override;
  const StepStats& last_step_stats() const override;
  void set_watchdog_seconds(double s) override;
  // The draft plans (Executor::draft_step; rings from new_draft_ring, in device memory, freed
  // before the executor).
  bool runs_drafts() const override { return true; }
  void attach_draft(const DraftConfig& c, const DraftWeights& w) override;
  void draft_step(std::span<const DraftStepSeq> seqs) override;
  std::unique_ptr<DraftRingMemory> new_draft_ring(const DraftConfig& c) override;
  // The draft plan for a step shape (after attach_draft; compiled on first use and cached).
  const plan::Plan& draft_plan(int batch, int ctx_rows, int block_rows);
  ExecutorKind kind() const;
  CudaTarget target() const;
  std::string device_name() const;
  // The device's read bandwidth over `bytes` (GB/s; the simulation: the host's).
  double measure_read_bandwidth_gbps(size_t bytes);

  // Test hooks, as CpuExecutor's.
  void edit_instr_for_testing(int batch, uint32_t id, const std::function<void(plan::Instr&)>& f);

 protected:
  void run_step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids,
                std::span<const SampleRow> sampling, const StepOptions& options) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace md
