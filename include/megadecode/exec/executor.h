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
// A step feeds every sequence R >= 1 consecutive token rows (decode, a speculative verify, a
// prefill chunk); each row computes what a decode step of that token would.
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

#include "megadecode/base/threads.h"
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
  int rows = 1;              // token rows per sequence
  int distinct_experts = 0;  // summed over MoE layers: experts selected by the batch
  double weight_bytes = 0;   // non-expert weights, embedding rows, the distinct experts
  double state_bytes = 0;    // KDA state read + written, conv caches read + written
  double cache_bytes = 0;    // MLA latent caches read once per sequence (fp32 storage)
  double total() const { return weight_bytes + state_bytes + cache_bytes; }
  // Timing of the step (executors only): wall time of the workers' run, and the time workers
  // spent waiting (on counters or barriers) summed over workers, also split by the op of the
  // tile waited for (opbyop: the op of the phase before the barrier).
  double seconds = 0;
  double wait_seconds = 0;
  std::array<double, plan::kNumOps> wait_by_op{};
  std::array<double, plan::kNumOps> run_by_op{};  // with ExecutorOptions::profile: tile time
};

// The bytes a step of `rows` token rows per sequence moves for sequences whose caches hold
// `positions[b]` tokens before the step, when the rows select `distinct_experts` experts in all
// (summed over MoE layers; for sequences decoded one at a time, B * top_k * MoE layers).
StepStats decode_step_bytes(const Model& m, std::span<const int64_t> positions,
                            int distinct_experts, int rows = 1);

// Which of a sequence's rows in a step return logits (and a sampled token).
enum class LogitRows : uint8_t { kNone, kLast, kAll };

// One sequence's part of a step: R consecutive tokens fed at its position (R is the same for
// every sequence of a step).
struct StepSeq {
  SequenceState* seq = nullptr;
  std::span<const int32_t> tokens;
  LogitRows logits = LogitRows::kLast;
};

struct StepOptions {
  // Keep what commit() needs to cut the step back to a prefix of its rows: per KDA layer one
  // copy of the state and conv cache, plus 7C + H floats per row (SequenceState::RowLog; for
  // Kimi-Linear-48B 32 x 128 x 128 x 4 B = 2 MiB of state per KDA layer, ~40 MiB a sequence).
  // Needs rows <= plan::kMaxChainedRows.
  bool keep_for_commit = false;
};

// Logit rows of a step: the sum over its sequences of 0, 1 or R.
int logit_row_count(std::span<const StepSeq> seqs);

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

  // The general step: every sequence feeds its R tokens (1 <= R <= plan::kMaxRows, the same R for
  // all), row i at position pos + i, attending causally to the rows before it. logits receives
  // [logit rows][vocab] (logit_row_count: in sequence order, rows in order), next_ids (if not
  // null) the token sampled for each logit row, by sampling[j] (one spec per logit row, or
  // empty: greedy). Each sequence advances by R.
  void step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids = nullptr,
            std::span<const SampleSpec> sampling = {}, const StepOptions& options = {});

  // After a step with keep_for_commit: cut the sequence back to the first k of that step's R
  // rows (0 <= k <= R): its KDA states, conv and MLA caches become exactly those of a sequence
  // that was fed only those k tokens, and pos = pos before the step + k. Reads no weights (the
  // KDA recurrence of the k rows is replayed from the row log). Any other call is an md::Error.
  void commit(SequenceState& seq, int k);

  // Feeds a prompt through the plan in steps of at most `chunk` rows (the last one shorter);
  // logits (if not null) receives the last row's [vocab].
  void prefill(SequenceState& seq, std::span<const int32_t> ids, float* logits, int chunk = 16);

  // The plan for a step shape (compiled on first use and cached).
  const plan::Plan& plan(int batch, int rows = 1);

  const Model& model() const;
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
  ThreadPool& pool_for_commit();  // the workers' pool (commit's replay runs on it)
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace md
