// The executor interface of the decode plan (docs/architecture.md "Executors"): what the
// generator, the benchmark and the CLI hold. A backend implements it by
// interpreting the plan's instructions: exec/cpu (CpuExecutor: persistent CPU threads, as a
// megakernel or op by op), later exec/cuda. Every backend computes, bit for bit, what
// Model::forward computes for each sequence fed one token at a time.
//
// A step feeds every sequence R >= 1 consecutive token rows (decode, a speculative verify, a
// prefill chunk); each row computes what a decode step of that token would, attending causally
// to the rows before it. A watchdog turns a step that stops progressing into an md::Error naming
// the stuck worker, instruction and counter instead of a hang.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/engine/model.h"
#include "megadecode/engine/sampler.h"
#include "megadecode/model/draft_weights.h"
#include "megadecode/plan/plan.h"

namespace md {

enum class ExecutorKind { kMegakernel, kOpByOp };
std::string_view executor_name(ExecutorKind k);
// "megakernel" | "opbyop"; anything else is an md::Error.
ExecutorKind parse_executor_kind(std::string_view name);

// Where a plan executor runs: CPU threads, a CUDA GPU, or the host simulation of the CUDA
// execution model (the CUDA kernels on this machine, exec/cuda_executor.h).
enum class DeviceKind : uint8_t { kCpu, kCuda, kCudaSim };
std::string_view device_kind_name(DeviceKind d);
// "cpu" | "cuda" | "cuda-sim"; anything else is an md::Error.
DeviceKind parse_device_kind(std::string_view name);

struct ExecutorOptions {
  DeviceKind device = DeviceKind::kCpu;
  int workers = 0;  // 0: one per online CPU; more workers than CPUs is allowed (they yield)
  bool pin = true;  // pin worker i to CPU i mod CPUs
  double watchdog_seconds = 10.0;
  bool profile = false;    // time every tile (StepStats::run_by_op); costs two clock reads a tile
  plan::PlanOptions plan;  // tiling and cost model; batch and workers are set per plan
  // The executor's state pool (at least max_batch sequences): every sequence it steps is made
  // by new_sequence() or imported into one with SequenceState::copy_from.
  PoolOptions states;
};

// What one step moved through memory (what the bench divides by the step time).
struct StepStats {
  int batch = 0;
  int rows = 1;              // token rows of the longest sequence
  int token_rows = 0;        // token rows of the step (summed over its sequences)
  int distinct_experts = 0;  // summed over MoE layers: experts selected by the batch
  double weight_bytes = 0;   // non-expert weights, embedding rows, the distinct experts
  double state_bytes = 0;    // KDA state read + written, conv caches read + written
  double cache_bytes = 0;    // MLA latent caches read once per sequence (pool storage type)
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
// The same with each sequence's row count.
StepStats decode_step_bytes(const Model& m, std::span<const int64_t> positions,
                            int distinct_experts, std::span<const int> rows);

// Which of a sequence's rows in a step return logits (and a sampled token).
enum class LogitRows : uint8_t { kNone, kLast, kAll };

// One sequence's part of a step: R consecutive tokens fed at its position. Sequences of one step
// may feed different R (decode rows beside prefill chunks or a verify).
struct StepSeq {
  SequenceState* seq = nullptr;
  std::span<const int32_t> tokens;
  LogitRows logits = LogitRows::kLast;
};

struct StepOptions {
  // Keep what commit() needs to cut the step back to a prefix of its rows, in the sequence's
  // slot of the state pool (its row log, PoolOptions::commit_rows): per KDA layer one copy of
  // the state and conv cache, plus 7C + H floats per row (for Kimi-Linear-48B 32 x 128 x 128 x
  // 4 B = 2 MiB of state per KDA layer, ~40 MiB a sequence). Needs rows <=
  // plan::kMaxChainedRows and <= the pool's commit rows.
  bool keep_for_commit = false;
  // Captures, for every token row of the step, the residual stream entering each listed layer
  // (the same rows Model::forward's AuxCapture gives, bit for bit): aux.out receives
  // [token rows of the step][aux.layers.size() * hidden], rows in step order (sequences in order,
  // each sequence's rows in order). Empty layers: nothing is captured.
  AuxCapture aux;
};

// The speculative draft's per-sequence context, owned by the caller (spec/draft_model.h's
// DraftState): per layer a ring of `window` key and value rows, and each slot's position.
struct DraftRing {
  float* keys = nullptr;         // [layers][window][kv width]
  float* values = nullptr;       // [layers][window][kv width]
  int32_t* positions = nullptr;  // [window], -1: empty
};

// A sequence's draft ring in an executor's memory (Executor::new_draft_ring): the ring its draft
// steps read and write, in device memory for a GPU executor, freed with the object.
class DraftRingMemory {
 public:
  virtual ~DraftRingMemory() = default;
  virtual DraftRing ring() const = 0;
  virtual void clear() = 0;  // every slot empty (positions -1), keys and values 0
  // A host copy: keys and values [layers][window][kv width], positions [window].
  virtual void read(std::vector<float>& keys, std::vector<float>& values,
                    std::vector<int32_t>& positions) const = 0;
};

// One sequence's part of a draft step (Executor::draft_step): first its context rows enter the
// ring (DraftModel::update_context), then, when tokens is not empty, a block of tokens.size()
// rows from the anchor drafts that many tokens (DraftModel::draft).
struct DraftStepSeq {
  DraftRing ring;
  std::span<const float> ctx_aux;          // [ctx rows][the draft's context width]
  std::span<const int32_t> ctx_positions;  // [ctx rows], >= 0
  int32_t anchor = 0;
  int64_t anchor_position = 0;
  std::span<int32_t> tokens;  // the drafts; the same size for every sequence of a step
  // Optional [tokens.size()][...] outputs, as DraftOutputs (null: not wanted).
  float* hidden = nullptr;
  float* base_logits = nullptr;
  float* biased_logits = nullptr;
};

// Logit rows of a step: the sum over its sequences of 0, 1 or R.
int logit_row_count(std::span<const StepSeq> seqs);

// How a logit row's next token is drawn inside the step: by a SampleRow (engine/sampler.h), plain
// data (parameters, penalty counts, the draw's uniform) that Sampler::prepare makes from a
// sequence's sampler, the default being greedy (argmax, ties to the lowest id).
class Executor {
 public:
  virtual ~Executor() = default;
  Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // The general step: every sequence feeds its R tokens (1 <= R <= plan::kMaxRows, R may differ
  // between sequences), row i at position pos + i. logits receives [logit rows][vocab]
  // (logit_row_count: in sequence order, rows in order; bf16-valued in BF16 precision, as
  // Model::forward), next_ids (if not null) the token sampled for each logit row by sampling[j]
  // (one row per logit row, or empty: greedy). logits may be null when next_ids is not: then only
  // the tokens come back (a CUDA executor's logits stay on the device). options.aux (if it lists
  // layers) receives the step's aux hidden states, copied out after the step from buffers the
  // plan writes anyway (no instruction is added). Each sequence advances by R. The batch may differ
  // from step to step (1..max_batch distinct sequences of this model). Bad input (shape, token id,
  // a foreign or repeated sequence, an aux layer id outside 1 .. num_layers - 1, aux layers without
  // an output buffer) is an md::Error before anything changes; a step that fails
  // while running (watchdog) leaves the batch's states undefined.
  void step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids = nullptr,
            std::span<const SampleRow> sampling = {}, const StepOptions& options = {}) {
    run_step(seqs, logits, next_ids, sampling, options);
  }
  // A decode step: one token per sequence, its next-token logits at logits[b * vocab], and
  // (with next_ids) the token sampled inside the step.
  void step(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens, float* logits,
            int32_t* next_ids = nullptr, std::span<const SampleRow> sampling = {});

  // After a step with keep_for_commit: cut the sequence back to the first k of that step's R
  // rows (0 <= k <= R): its KDA states, conv and MLA caches become exactly those of a sequence
  // that was fed only those k tokens, and pos = pos before the step + k. Reads no weights (the
  // KDA recurrence of the k rows is replayed from the row log). Any other call is an md::Error.
  virtual void commit(SequenceState& seq, int k) = 0;

  // dst (a sequence of this executor's pool) becomes a copy of src (SequenceState::copy_from):
  // the serving loop's prefix cache keeps and restores states this way. A distributed leader
  // (StepLeader) has every rank copy its own slices.
  virtual void copy_sequence(SequenceState& dst, const SequenceState& src) { dst.copy_from(src); }

  // The speculative draft's plans (plan::compile_draft_plan) on this executor's workers:
  // attach_draft binds a draft (config and weights outlive the executor's use of them), then
  // draft_step runs one draft step for up to max_batch sequences (each with at most
  // plan::kMaxRows context rows; the block sizes equal), computing bit for bit what
  // DraftModel::update_context and DraftModel::draft compute in the model's precision. Backends
  // without draft plans say so with runs_drafts() == false (the drafter then runs on the host);
  // calling them is an md::Error. Bad input is an md::Error before anything changes.
  virtual bool runs_drafts() const { return false; }
  virtual void attach_draft(const DraftConfig& c, const DraftWeights& w);
  virtual void draft_step(std::span<const DraftStepSeq> seqs);
  // An empty ring for a draft of config c, in the memory this executor's draft steps use (host
  // memory here; a GPU executor's device memory). A DraftStepSeq's ring on a GPU executor must
  // come from here.
  virtual std::unique_ptr<DraftRingMemory> new_draft_ring(const DraftConfig& c);

  // Feeds a prompt through the plan in steps of at most `chunk` rows (the last one shorter);
  // logits (if not null) receives the last row's [vocab].
  void prefill(SequenceState& seq, std::span<const int32_t> ids, float* logits, int chunk = 16);

  // A fresh sequence of this executor's state pool (an md::Error naming the budget when the
  // pool is full); the pool itself (its budget, what is in use).
  SequenceState new_sequence() { return states().acquire(); }
  virtual StatePool& states() = 0;

  // The plan for a step shape (compiled on first use and cached).
  virtual const plan::Plan& plan(int batch, int rows = 1) = 0;

  virtual std::string_view name() const = 0;  // e.g. "megakernel", "opbyop"
  virtual const Model& model() const = 0;
  virtual int workers() const = 0;
  virtual int max_batch() const = 0;
  // The last step's bytes and times (valid until the next step).
  virtual const StepStats& last_step_stats() const = 0;
  virtual void set_watchdog_seconds(double s) = 0;

 protected:
  virtual void run_step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids,
                        std::span<const SampleRow> sampling, const StepOptions& options) = 0;
};

// CPU workers when ExecutorOptions::workers is 0: cpus_per_rank of the model's world (one per CPU
// the process may use; a distributed rank that its launcher did not bind: its share).
int default_cpu_workers(const Model& m);
// ExecutorOptions::workers for a bench that was given none: default_cpu_workers on the CPU; 0 on
// a CUDA device, whose executors then run one block per SM (not one per host CPU).
int default_workers(const Model& m, DeviceKind device);

// A plan executor of the given kind on opt.device (CPU threads, or a CUDA executor).
std::unique_ptr<Executor> make_executor(Model& model, ExecutorKind kind, int max_batch,
                                        const ExecutorOptions& opt = {});

}  // namespace md
