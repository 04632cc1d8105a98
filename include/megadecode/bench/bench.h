// The engine's benchmarks as a library (the CLI's `bench` and scripts call them):
// decode speed per batch size and executor against the machine's read bandwidth measured in the
// same run; prompt prefill through the plan in chunks of rows against the reference path's
// prefill; and the cost of a multi-row verify step against a decode step. Executors are
// interleaved repetition by repetition, and ratios are medians of per-repetition ratios
// (medians, same-run ratios). Every figure belongs to the machine it ran on
// (this_machine()).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "megadecode/engine/model.h"
#include "megadecode/exec/executor.h"
#include "megadecode/spec/drafter.h"

namespace md::bench {

struct Machine {
  std::string cpu_model;
  int cores = 0;
  std::string matmul_isa, kda_isa;
};
Machine this_machine();

// progress(fraction done, what is running now)
using Progress = std::function<void(double, const std::string&)>;

double median(std::vector<double> v);

// ---- decode ---------------------------------------------------------------------------------

struct DecodeOptions {
  std::vector<int> batches{1};
  std::vector<std::string> executors{"megakernel", "opbyop", "reference"};
  int steps = 16, reps = 5, context = 16;
  int workers = 0;                       // 0: one per CPU
  DeviceKind device = DeviceKind::kCpu;  // where the plan executors run
  // Time every tile (ExecutorOptions::profile) and report, per op, the workers' run and wait
  // time per step (DecodeCell::run_ms_by_op / wait_ms_by_op): where a step's time goes.
  bool profile = false;
  Progress progress;
};

struct DecodeCell {
  int batch = 0;
  std::string executor;
  std::vector<double> ms_reps;  // ms per step, per repetition
  double ms = 0;                // median
  double bytes = 0;             // per step (StepStats)
  double tokens_per_s = 0, gbps = 0, pct_of_bandwidth = 0;
  // A distributed rank (mpirun): this rank's bytes per step are `bytes`; its time inside the
  // collectives per step (median over repetitions, measured around the runtime's calls) and
  // the calls per step.
  double collective_ms = 0, collective_calls = 0;
  // DecodeOptions::profile (plan executors): ms per step summed over the workers, per op
  // (plan::Op), over all timed steps.
  std::vector<double> run_ms_by_op, wait_ms_by_op;
};

struct DecodeResult {
  std::vector<DecodeCell> cells;
  std::map<int, double> megakernel_over_opbyop;  // per batch: median of per-rep speed ratios
  std::vector<double> bandwidth_samples_gbps;    // one before each repetition
  double bandwidth_gbps = 0;                     // their median
  int workers = 0, reference_threads = 0;
  std::string device = "cpu";  // where the plan executors ran (a CUDA device's name)
  int64_t max_pos = 0;
  double peak_rss_bytes = 0;
};

// Each batch: B sequences prefilled with `context` random tokens, then `steps` greedy decode
// steps per executor and repetition, every block restarting from the same prefilled state.
DecodeResult run_decode(Model& m, const DecodeOptions& o);

// ---- collectives (a distributed run) -------------------------------------------------------

struct CollectiveOptions {
  std::vector<int> batches{1};
  int iters = 200;
};
struct CollectiveCell {
  int batch = 0;
  std::string what;                  // the collective and the plan op it serves
  double bytes = 0;                  // this rank's message
  double us_median = 0, us_p90 = 0;  // per call, after a barrier (all ranks start together)
};
// Each message a decode step of each batch size sends (sizes from the full model's geometry),
// timed call by call on the model's communicator. An md::Error unless the model is sharded.
std::vector<CollectiveCell> run_collectives(Model& m, const CollectiveOptions& o);

// ---- prefill --------------------------------------------------------------------------------

struct PrefillOptions {
  int prompt = 512;
  std::vector<int> chunks{8, 16, 32, 64};  // token rows per plan step
  std::vector<std::string> executors{"megakernel", "opbyop"};
  bool reference = true;  // also time Model::forward's one-call prefill
  int reps = 3, workers = 0;
  Progress progress;
};

struct PrefillCell {
  std::string executor;  // "reference": Model::forward
  int chunk = 0;         // 0 for the reference
  std::vector<double> seconds_reps;
  double seconds = 0, tokens_per_s = 0, gflops = 0;
  double over_reference = 0;  // median of per-rep reference / this time (speed ratio)
};

struct PrefillResult {
  std::vector<PrefillCell> cells;
  double flops_per_token = 0;  // 2 x the matmul weights a token multiplies (lm_head excluded)
  // The machine's bf16 dot-product rate: this engine's GEMM on an L2-resident weight block at
  // 16 rows, all workers (what prefill could reach if it were compute-bound everywhere).
  double bf16_peak_gflops = 0;
  int best_chunk = 0;  // the fastest chunk of the first executor
};
PrefillResult run_prefill(Model& m, const PrefillOptions& o);

// ---- verify ---------------------------------------------------------------------------------

struct VerifyOptions {
  int rows = 8;  // the anchor + rows - 1 drafted tokens of one sequence
  int context = 64, steps = 8, reps = 5, workers = 0;
  std::vector<std::string> executors{"megakernel", "opbyop"};
  Progress progress;
};

struct VerifyCell {
  std::string executor;
  double decode_ms = 0;           // one decode step at batch 1 (median)
  double verify_ms = 0;           // one step of `rows` rows, kept for a commit (median)
  double commit_ms = 0;           // commit to half the rows (median)
  double verify_over_decode = 0;  // median of per-rep ratios
};
struct VerifyResult {
  int rows = 0;
  std::vector<VerifyCell> cells;
  double bandwidth_gbps = 0;
};
VerifyResult run_verify(Model& m, const VerifyOptions& o);

// ---- mixed ----------------------------------------------------------------------------------

// `batch` sequences decoding one row each beside one sequence prefilling `chunk` rows, all at
// `context`: one mixed step against a decode step of the batch plus the chunk's own step.
struct MixedOptions {
  int batch = 4, chunk = 16;
  int context = 64, steps = 8, reps = 5, workers = 0;
  bool profile = false;  // time every tile (ExecutorOptions::profile), per op and way
  std::vector<std::string> executors{"megakernel", "opbyop"};
  Progress progress;
};

struct MixedCell {
  std::string executor;
  double mixed_ms = 0;             // one mixed step (median)
  double separate_ms = 0;          // the decode step + the chunk's step (median)
  double separate_over_mixed = 0;  // median of per-rep ratios
  // With MixedOptions::profile: per plan op, ms a step summed over the workers (tile time and
  // wait time), for the mixed step and for the two separate steps together; empty otherwise.
  std::vector<double> mixed_run_ms_by_op, mixed_wait_ms_by_op;
  std::vector<double> separate_run_ms_by_op, separate_wait_ms_by_op;
};
struct MixedResult {
  int batch = 0, chunk = 0;
  std::vector<MixedCell> cells;
  double bandwidth_gbps = 0;
};
MixedResult run_mixed(Model& m, const MixedOptions& o);

// ---- speculative ----------------------------------------------------------------------------

// Greedy speculative decoding of one sequence (spec/speculative.h) against plain batch-1 greedy
// decode steps of the same executor, interleaved rep by rep: each block prefills `context`
// random tokens, then runs `steps` plain decode steps or `steps` speculative steps. One cell per
// executor and acceptance mode: the model's own acceptance (fixed = -1) or each fixed acceptance
// length (benchmark mode: exactly that many drafts accepted a step, so the step's cost is
// measured at a known verify length whatever the weights).
struct SpeculativeBenchOptions {
  int num_draft_tokens = 7;        // K: every verify step has K + 1 rows
  std::vector<int> fixed_lengths;  // empty: {-1} (the model's acceptance)
  int steps = 16, reps = 5, context = 16, workers = 0;
  std::vector<std::string> executors{"megakernel"};
  DeviceKind device = DeviceKind::kCpu;
  Progress progress;
  // The agreeing draft (`--speculative oracle`, bench only): proposes plain greedy decoding's own
  // continuation, recorded first, so every draft is accepted by the model's own acceptance
  // rule (not forced) and the emitted tokens are checked against the recording. make_drafter
  // is not used.
  bool oracle = false;
  // Sequences speculated together (step_batch: one verify of K + 1 rows each, drafters on one
  // executor propose in one draft step), each against plain decode at the same batch; empty: {1}.
  std::vector<int> batches;
};

struct SpeculativeCell {
  std::string executor;
  int batch = 1;       // sequences a step (the times are per batched step, tokens/s summed)
  int fixed = -1;      // the fixed acceptance length, -1: the model's
  double step_ms = 0;  // one speculative step: draft + verify + accept + commit (median)
  double draft_ms = 0, verify_ms = 0;  // of which drafting (and context update), verify step
  double accepted_per_step = 0;        // drafts accepted a step (mean over all reps)
  double tokens_per_step = 0;          // tokens emitted a step (accepted + 1)
  double tokens_per_s = 0;             // speculative (median of reps)
  double plain_ms = 0;                 // one plain decode step at batch 1 (median)
  double plain_tokens_per_s = 0;
  double speedup = 0;  // median of per-rep speculative / plain tokens/s
};

struct SpeculativeBenchResult {
  std::string drafter;
  int num_draft_tokens = 0;
  std::vector<SpeculativeCell> cells;
  double bandwidth_gbps = 0;
};
// make_drafter makes the drafter for each executor (a DSpark draft runs on it when it runs
// draft plans).
SpeculativeBenchResult run_speculative(
    Model& m, const std::function<std::unique_ptr<Drafter>(Executor*)>& make_drafter,
    const SpeculativeBenchOptions& o);

}  // namespace md::bench
