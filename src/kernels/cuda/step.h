// What a CUDA kernel of the decode plan reads: the step's tables and pointers, all in device
// memory (plain data, filled by the host executor, src/exec/cuda, and passed by value to every
// launch). The CUDA twin of exec::StepCtx (src/exec/cpu/tiles.h), field for field where they
// share a meaning.
#pragma once
#include <cstdint>

#include "megadecode/engine/numerics.h"
#include "megadecode/engine/sampler.h"
#include "megadecode/kernels/cpu/mla.h"
#include "megadecode/plan/ops.h"
#include "megadecode/plan/plan.h"

namespace md::cuda {

// Threads of every tile's block (both executors: the same block, the same summation orders).
inline constexpr uint32_t kTileThreads = 256;
// The weight stream of a GEMV tile: stages of kStageBytes in shared memory, filled by bulk async
// copies while the block computes on the previous ones. A stage's whole rows go one to a warp, so
// a stage should hold one row per warp: 36 KiB is 8 of Kimi-Linear's 2304-wide bf16 rows (16 KiB
// held 3: 5 of the 8 warps idled on every chunk, and 48 KiB in flight fed an SM about 2-6 GB/s on
// an H200, bench/RESULTS.md). 4 x 36 KiB plus the work area stays under sm_80's 163 KiB.
inline constexpr uint32_t kStages = 4;
inline constexpr uint32_t kStageBytes = 36 << 10;
// Shared memory of a tile block: the stages, 128 bytes for their mbarriers (and the megakernel's
// stop word after them: gemv.cuh block_word), and a work area for the tiles' reductions and small
// vectors (kWorkFloats).
inline constexpr uint32_t kWorkFloats = 4096;
inline constexpr uint32_t kSmemBytes = kStages * kStageBytes + 128 + kWorkFloats * 4;

// A weight's encoding on the device (model/weights.h Mat: its DType and WeightQuant together).
enum class WDType : uint8_t { kBF16, kF32, kMXFP4, kInt4, kInt8, kFp8 };

// A weight-table entry in device memory ([rows, cols]), in the host's layouts (model/weights.h
// Mat): bf16 / fp32 values; MXFP4 codes [rows, cols/2] with E8M0 scales [rows, cols/32]; int4
// codes [rows, cols/2] (q + 8, low nibble first) or int8 codes [rows, cols] (q + 128) with bf16
// scales [rows, cols/group]; FP8 e4m3 values [rows, cols] with fp32 scales [rows, cols/group].
struct DevWeight {
  const void* data = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0, cols = 0;
  WDType dtype = WDType::kBF16;
  // Quantized formats: columns per scale (32 for MXFP4, a multiple of 32), scales per row
  // (cols / group), and log2(group) when it is a power of two (a shift, not a division), else -1.
  int32_t group = 0, row_groups = 0;
  int8_t group_shift = -1;
};

// Per (sequence, layer) state in the device state pool (exec::SeqView's fields).
struct DevSeq {
  float* kda_state = nullptr;
  float* conv_cache = nullptr;
  float* kda_state0 = nullptr;  // null: no row log this step
  float* conv0 = nullptr;
  float* rowlog = nullptr;
  cpu::LatentCache mla;  // plain data: base, page table (device pointers), layout
  // A draft plan's: the sequence's ring of this layer (keys and values [window][kv width]) and
  // the positions its slots hold (-1: empty), in device memory (Executor::new_draft_ring).
  float* ring_k = nullptr;
  float* ring_v = nullptr;
  int32_t* ring_pos = nullptr;
};

// A draft plan's geometry (the DraftConfig fields its tiles read).
struct DevDraft {
  int heads = 0, kv_heads = 0, head_dim = 0, window = 0, markov_rank = 0;
  double rope_theta = 0;
};

// A commit's KDA replay (Device::run_commit, tiles_attention.cuh kda_commit_block): per KDA
// layer the sequence's state and conv cache, their copies from before the step, and its row log
// (device pointers into the state pool); block i replays head i % heads of layer i / heads over
// the first `rows` rows of the step.
struct DevCommitLayer {
  float* kda_state = nullptr;
  float* conv_cache = nullptr;
  const float* kda_state0 = nullptr;
  const float* conv0 = nullptr;
  const float* rowlog = nullptr;
};
struct DevCommit {
  const DevCommitLayer* layers = nullptr;
  int n_layers = 0, rows = 0;
  int heads = 0, head_dim = 0, conv = 0;
};

// The model's shape as the tiles need it (a subset of ModelConfig, which holds host vectors).
struct DevCfg {
  int64_t hidden = 0, vocab = 0;
  int kda_heads = 0, kda_head_dim = 0, kda_conv = 0;
  float kda_gate_lower_bound = 0;
  int mla_heads = 0, nope = 0, rope = 0, v_head = 0, kv_lora = 0, q_lora = 0;
  int num_layers = 0, num_experts = 0, top_k = 0;
  int64_t moe_inter = 0, expert_dim = 0;
  int64_t kda_dim() const { return int64_t(kda_heads) * kda_head_dim; }
  int64_t mla_cache_width() const { return kv_lora + rope; }
};

// The megakernel's per-block report for the watchdog (read by the host after a failed step).
struct DevStatus {
  uint32_t instr = plan::kNone;    // the instruction it is on
  uint32_t counter = plan::kNone;  // the counter it waits on (kNone: running)
  uint32_t target = 0;
  uint32_t state = 0;  // 0 idle, 1 running, 2 waiting, 3 stalled (test hook), 4 finished
};

// One logit row's SampleRow with its penalty pairs at penalties[pen0 .. pen0 + npen).
struct DevSample {
  float temperature = 0, top_p = 1, min_p = 0;
  int32_t top_k = 0;
  float repetition_penalty = 1, presence_penalty = 0, frequency_penalty = 0;
  uint32_t pen0 = 0, npen = 0;
  double uniform = 0;
};

struct DevStep {
  const plan::Instr* instrs = nullptr;  // the plan's global order
  const plan::BufferDesc* buffers = nullptr;
  const DevWeight* weights = nullptr;
  uint8_t* arena = nullptr;
  Numerics num;
  DevCfg cfg;
  int batch = 0, rows = 1, n = 0;
  const int32_t* tokens = nullptr;
  float* logits = nullptr;
  int n_logits = 0;
  const int32_t* logit_of_row = nullptr;
  const DevSeq* seqs = nullptr;  // [b * layers + l]
  const int64_t* pos = nullptr;
  const int32_t* row0 = nullptr;
  const int32_t* seq_of_row = nullptr;
  // A draft plan's: its geometry and the context rows of the step (batch * the plan's rows per
  // sequence).
  DevDraft draft;
  int n_ctx = 0;
  // Sampling (engine/sampler.h SampleRow, as plain device data): one row per logit row, or null
  // for greedy rows everywhere; the penalty pairs of all rows; [n_logits][vocab] scratch for the
  // penalised logits.
  const DevSample* sampling = nullptr;
  const PenaltyCount* penalties = nullptr;
  float* sample_work = nullptr;
  // A distributed rank's greedy exchange (docs/distributed.md, "CUDA ranks"): when set, every
  // logit row is greedy and only this rank's vocabulary block [vocab_lo, vocab_hi) of it was
  // computed, so the sample tile writes the block's (max, id) pair ([n_logits][2] floats, the
  // id's bits as they are; id -1 when the block is all -inf) instead of a next id.
  float* greedy_pairs = nullptr;
  int64_t vocab_lo = 0, vocab_hi = 0;
  // The phase kernel: the phase's instruction ids.
  const uint32_t* phase_ids = nullptr;
  // The megakernel: per block its queue (instruction ids, offsets [queue_off[b], queue_off[b+1])),
  // the counters, the step epoch, the abort flag and the status board.
  // A distributed plan runs the megakernel in segments between its collectives: then block b's
  // instructions this launch are queue_ids[queue_off[b] .. queue_end[b]) (else up to
  // queue_off[b + 1]).
  const uint32_t* queue_ids = nullptr;
  const uint32_t* queue_off = nullptr;
  const uint32_t* queue_end = nullptr;
  const uint32_t* per_step = nullptr;  // [counters]
  uint32_t* counters = nullptr;
  uint32_t epoch = 0;
  uint32_t* abort = nullptr;
  DevStatus* status = nullptr;
  uint64_t watchdog_ns = 0;
};

}  // namespace md::cuda
