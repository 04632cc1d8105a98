// Executors of the decode plan on CPU threads (docs/architecture.md "Executors").
//
//  * megakernel: W persistent threads pinned to cores, each walking its own instruction queue;
//    between tiles a worker only waits for the counters its next tile names (acquire), and
//    signals its own (release) when done. No barrier inside a step.
//  * opbyop: the same instructions, grouped into barrier phases (one op, or several independent
//    ops); every worker runs its share of a phase, then all meet at a barrier.
//
// Both compute, bit for bit, what Model::forward computes for each sequence decoded alone (same
// kernels, same rounding points; matmul rows do not depend on how they are split or batched).
// A watchdog turns a step that stops progressing into an md::Error naming the stuck worker,
// instruction and counter instead of a hang.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "megadecode/engine/model.h"
#include "megadecode/engine/sampler.h"
#include "megadecode/plan/plan.h"

namespace md {

enum class ExecutorKind { kMegakernel, kOpByOp };
std::string_view executor_name(ExecutorKind k);
// "megakernel" | "opbyop"; anything else is an md::Error.
ExecutorKind parse_executor_kind(std::string_view name);

struct ExecutorOptions {
  int workers = 0;  // 0: one per online CPU; more workers than CPUs is allowed (they yield)
  bool pin = true;  // pin worker i to CPU i mod CPUs
  double watchdog_seconds = 10.0;
  bool profile = false;    // time every tile (StepStats::run_by_op); costs two clock reads a tile
  plan::PlanOptions plan;  // tiling and cost model; batch and workers are set per plan
};

// What one step moved through memory (what the bench divides by the step time).
struct StepStats {
  int batch = 0;
  int distinct_experts = 0;  // summed over MoE layers: experts selected by the batch
  double weight_bytes = 0;   // non-expert weights, embedding rows, the distinct experts
  double state_bytes = 0;    // KDA state read + written, conv caches read + written
  double cache_bytes = 0;    // MLA latent caches read (fp32 storage)
  double total() const { return weight_bytes + state_bytes + cache_bytes; }
  // Timing of the step (executors only): wall time of the workers' run, and the time workers
  // spent waiting (on counters or barriers) summed over workers, also split by the op of the
  // tile waited for (opbyop: the op of the phase before the barrier).
  double seconds = 0;
  double wait_seconds = 0;
  std::array<double, plan::kNumOps> wait_by_op{};
  std::array<double, plan::kNumOps> run_by_op{};  // with ExecutorOptions::profile: tile time
};

// The bytes a decode step moves for sequences whose caches hold `positions[b]` tokens before the
// step, when the batch selects `distinct_experts` experts in all (summed over MoE layers; for
// sequences decoded one at a time, B * top_k * MoE layers).
StepStats decode_step_bytes(const Model& m, std::span<const int64_t> positions,
                            int distinct_experts);

class DecodeExecutor {
 public:
  DecodeExecutor(Model& model, int max_batch, int workers, ExecutorKind kind);
  DecodeExecutor(Model& model, int max_batch, ExecutorKind kind, const ExecutorOptions& opt);
  ~DecodeExecutor();
  DecodeExecutor(const DecodeExecutor&) = delete;
  DecodeExecutor& operator=(const DecodeExecutor&) = delete;

  // One decode step: sequence b consumes tokens[b] at its own position and logits[b * vocab ..]
  // receives its next-token logits (bf16-valued in BF16 precision, as Model::forward). The batch
  // may differ from step to step (1..max_batch distinct sequences of this model). Bad input
  // (batch size, token id, a foreign or repeated sequence) is an md::Error before anything
  // changes. A step that fails while running (watchdog) leaves the batch's states undefined.
  void step(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens, float* logits);

  // The same step with sampling inside the plan (the kSample instructions, one per sequence
  // range, after the lm_head blocks): next_ids[b] receives sequence b's next token, drawn by
  // sampling[b].sampler from its logits (penalties see sampling[b].history), or the greedy
  // argmax (ties to the lowest id) when sampling is empty or sampler is null. A sampler must
  // not be shared by two sequences of the step.
  struct SampleSpec {
    Sampler* sampler = nullptr;
    std::span<const int32_t> history;
  };
  void step(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens, float* logits,
            int32_t* next_ids, std::span<const SampleSpec> sampling = {});

  // The plan for a batch size (compiled on first use and cached).
  const plan::Plan& plan(int batch);

  int workers() const;
  int max_batch() const;
  ExecutorKind kind() const;
  const StepStats& last_step_stats() const;
  void set_watchdog_seconds(double s);

  // Test hooks: edit one instruction of the cached plan for `batch` (its global copy and its
  // queue copy), e.g. an unreachable wait or the kFlagTestStall flag; drop_plans() forgets all
  // plans (and counters) so the next step recompiles.
  void edit_instr_for_testing(int batch, uint32_t id, const std::function<void(plan::Instr&)>& f);
  void drop_plans();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace md
