// The CPU interpreter of one instruction (tiles.cpp: dense ops, FFN, sampling;
// tiles_attention.cpp: KDA and MLA) and the per-step context it reads.
#pragma once
#include <cstdint>
#include <vector>

#include "megadecode/base/dtype.h"
#include "megadecode/base/threads.h"
#include "megadecode/engine/model.h"
#include "megadecode/engine/numerics.h"
#include "megadecode/engine/sampler.h"
#include "megadecode/engine/state_pool.h"
#include "megadecode/kernels/cpu/mla.h"
#include "megadecode/kernels/cpu/ops.h"
#include "megadecode/kernels/cpu/stream_hint.h"
#include "megadecode/model/config.h"
#include "megadecode/model/draft_weights.h"
#include "megadecode/model/weights.h"
#include "megadecode/plan/plan.h"

namespace md::dist {
class Communicator;
}

namespace md::exec {

// A weight-table entry bound to memory: a [rows, cols] matrix or an fp32 vector (rows = 1).
// An MXFP4 matrix (dtype U8) is its packed codes (data, [rows, cols/2]) and E8M0 scales
// ([rows, cols/32]).
struct WeightView {
  const void* data = nullptr;
  DType dtype = DType::BF16;
  int64_t rows = 0, cols = 0;
  const uint8_t* scales = nullptr;
  WeightQuant quant = WeightQuant::kNone;  // Mat's meaning (model/weights.h)
  int32_t group = 0;
  uint8_t int_act_bits = 0;             // Mat's meaning
  const int8_t* zero_points = nullptr;  // Mat's meaning (asymmetric int4)
  const int32_t* col_perm = nullptr;    // Mat's meaning (activation-ordered groups)
};

// Per (sequence, layer) state pointers, resolved before every step. With a row log (a step
// that may be committed to a prefix of its rows), a KDA core tile first copies its heads' state
// and conv channels to kda_state0 / conv0, and records every row's recurrence inputs in rowlog
// ([rows][RowLog layout], see kda_row_log_floats), which is all a commit needs to replay a
// prefix. All of it lives in the sequence's slot and pages of the executor's state pool.
struct SeqView {
  float* kda_state = nullptr;
  float* conv_cache = nullptr;
  cpu::LatentCache mla;         // MLA layers: the sequence's latent-cache pages
  float* kda_state0 = nullptr;  // null: no row log this step
  float* conv0 = nullptr;
  float* rowlog = nullptr;
  // A draft plan's (Plan::draft): the sequence's ring of this layer, [window][kv width] keys and
  // values, and the slot positions [window] (shared by the layers).
  float* ring_k = nullptr;
  float* ring_v = nullptr;
  int32_t* ring_pos = nullptr;
};

struct StepCtx {
  const plan::Plan* plan = nullptr;
  const ModelConfig* cfg = nullptr;
  Numerics num;  // the model's numeric policy (rounding points, router, activation)
  uint8_t* arena = nullptr;
  const WeightView* weights = nullptr;
  int batch = 0;  // sequences
  int rows = 1;   // the plan's token rows per sequence: each sequence's row count is at most this
  int n = 0;      // token rows of the step (the sum of the sequences' rows; <= batch * rows)
  const int32_t* tokens = nullptr;  // [n]
  float* logits = nullptr;          // [n_logits][vocab]
  int n_logits = 0;
  const int32_t* logit_of_row = nullptr;  // [n]: the row's logit-row index, or -1
  const SeqView* seqs = nullptr;          // [b * layers + l]
  const int64_t* pos = nullptr;  // [b]: position of the sequence's first row (cache rows before)
  const SampleRow* sampling = nullptr;  // [n_logits], or null: greedy for every row
  // Sequence and position of token row t.
  // Sequence b's token rows are [row0[b], row0[b + 1]) (compact, in sequence order; a step may
  // give sequences different row counts: decode rows beside prefill chunks).
  const int32_t* row0 = nullptr;        // [batch + 1]
  const int32_t* seq_of_row = nullptr;  // [n]
  int seq_of(int t) const { return seq_of_row[t]; }
  int first_row(int b) const { return row0[b]; }
  int rows_of(int b) const { return row0[b + 1] - row0[b]; }
  int64_t pos_of(int t) const { return pos[seq_of_row[t]] + (t - row0[seq_of_row[t]]); }
  // A draft plan's context rows: batch * Plan::draft.ctx_rows of them (sequence b's are
  // [b * ctx_rows, (b + 1) * ctx_rows); the unused ones have position -1).
  int n_ctx = 0;
  // A distributed rank's communicator (the plan's collectives; null otherwise).
  dist::Communicator* comm = nullptr;
  // A distributed step whose caller wants only the drawn tokens, every row greedy without
  // penalties (the same on every rank: the inputs are): kLogitsGather exchanges each rank's
  // (max, id) per row instead of its vocabulary block and writes the next ids; kSample is then
  // a no-op. (The executor decides, per step.)
  bool greedy_exchange = false;
};

// Scratch owned by one worker; sized by scratch_floats() for the plan.
struct Scratch {
  std::vector<float> f;
  std::vector<int> i;
  SampleScratch sample;  // the sample tile's (grows to the vocabulary once)
};
size_t scratch_floats(const plan::Plan& p);
size_t scratch_ints(const plan::Plan& p);

void run_instr(const StepCtx& s, const plan::Instr& in, Scratch& sc);

// Replays the first k rows of the row log of a KDA layer's heads [h0, h1) onto its state (which
// the caller restored from kda_state0), as the KDA core tiles computed them; and rebuilds the
// conv cache of channels [c0, c1) as it was after those k rows (commit to a prefix).
void replay_kda_rows(const ModelConfig& c, const SeqView& v, int k, int h0, int h1, float* scratch);

// Executor::commit on the CPU (commit.cpp): checks the row log, replays the prefix's KDA
// recurrence (on `pool`) and truncates the MLA caches.
void commit_rows(const ModelConfig& c, SequenceState& seq, int k, ThreadPool& pool);

namespace detail {

// An instruction's operands (Instr::args ..), resolved against the step.
struct Args {
  const StepCtx& s;
  const plan::BufferDesc* a;
  int layer;
  // Activation row t (token row, or for compact buffers the logit row).
  float* f(int i, int t = 0) const {
    return reinterpret_cast<float*>(s.arena + a[i].offset + a[i].stride * uint64_t(t));
  }
  int32_t* ints(int i, int t = 0) const {
    return reinterpret_cast<int32_t*>(s.arena + a[i].offset + a[i].stride * uint64_t(t));
  }
  int64_t ld(int i) const { return int64_t(a[i].stride / 4); }
  const WeightView& w(int i, int e = 0) const { return s.weights[a[i].offset + uint64_t(e)]; }
  const float* vec(int i) const { return static_cast<const float*>(w(i).data); }
  bool present(int i) const { return a[i].kind != plan::BufKind::kNull; }
  const SeqView& seq(int b) const {
    return s.seqs[size_t(b) * size_t(s.cfg->num_layers) + size_t(layer)];
  }
};

inline void maybe_round(float* x, int64_t n, bool round) {
  if (round) cpu::round_bf16_inplace(x, n);
}

// Y[t][0 .. r1-r0) = W[r0:r1] X[t] for B rows, the reference's matmul for those rows (a row's
// result does not depend on the range or batch it is computed in).
void gemv_rows(const WeightView& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
               float* Y, int64_t ldy, bool x_bf16);

// The attention tiles (tiles_attention.cpp).
void kda_core_tile(const StepCtx& s, const plan::Instr& in, const Args& a, Scratch& sc);
void mla_latent_tile(const StepCtx& s, const plan::Instr& in, const Args& a, Scratch& sc);
void mla_core_tile(const StepCtx& s, const plan::Instr& in, const Args& a, Scratch& sc);
void mla_merge_tile(const StepCtx& s, const plan::Instr& in, const Args& a, Scratch& sc);
void mla_q_up_tile(const StepCtx& s, const plan::Instr& in, const Args& a, Scratch& sc);

// The draft plan's tiles (tiles_draft.cpp).
void draft_ctx_proj_tile(const StepCtx& s, const plan::Instr& in, const Args& a);
void draft_ctx_norm_tile(const StepCtx& s, const plan::Instr& in, const Args& a);
void draft_ctx_write_tile(const StepCtx& s, const plan::Instr& in, const Args& a, Scratch& sc);
void draft_attn_tile(const StepCtx& s, const plan::Instr& in, const Args& a, Scratch& sc);
void draft_markov_tile(const StepCtx& s, const plan::Instr& in, const Args& a, Scratch& sc);
void draft_pick_tile(const StepCtx& s, const plan::Instr& in, const Args& a);
// A distributed rank's collectives (tiles_dist.cpp), over StepCtx::comm.
void all_reduce_tile(const StepCtx& s, const plan::Instr& in, const Args& a);
void logits_gather_tile(const StepCtx& s, const plan::Instr& in, const Args& a);
void all_gather_tile(const StepCtx& s, const plan::Instr& in, const Args& a);
// Scratch floats and ints the draft tiles of a draft plan need.
size_t draft_scratch_floats(const plan::Plan& p);
size_t draft_scratch_ints(const plan::Plan& p);

}  // namespace detail

// The model memory a weight-table entry names (bind.cpp); a draft plan's, in the draft's weights.
WeightView bind_weight(const ModelWeights& w, const plan::WeightRef& r);
WeightView bind_draft_weight(const DraftWeights& w, const plan::WeightRef& r);

// Streams a tile's weights towards the core (L2) ahead of the tile: set up when the previous
// tile is done, advanced a few lines at a time while the worker waits for the tile's inputs, so
// that waiting time becomes memory traffic. Lines come in the order the GEMV kernel reads them
// (16-row groups, 64-byte column chunks, row by row), so a partial prefetch is the useful part.
class Prefetcher {
 public:
  // The tile's weight ranges. An expert tile's weights depend on the router's output: they are
  // prefetched only when the caller knows that output is visible to this thread
  // (expert_ids_visible: an earlier tile of this worker in the same step acquired the router's
  // counter, directly or through an expert tile of the layer); otherwise nothing is prefetched.
  void start(const StepCtx& s, const plan::Instr& in, bool expert_ids_visible = false);
  // Issues up to `lines` prefetches; false when the tile is covered (or the budget is spent).
  bool step(int lines);
  bool done() const { return cur_ >= n_; }
  // The tile's ranges as byte spans, in order (at most max): the streams its GEMV calls read
  // (cpu::set_upcoming_streams). Returns how many were written.
  int spans(cpu::ByteSpan* out, int max) const;

 private:
  struct Range {
    const char* base = nullptr;
    size_t row_bytes = 0;
    uint32_t rows = 0;
  };
  void add(const void* base, size_t row_bytes, uint32_t rows);
  Range r_[3];
  std::vector<int> mark_;  // expert marks and the distinct list, for resolving a slot
  int n_ = 0, cur_ = 0;
  uint32_t group_ = 0, row_ = 0;
  size_t col_ = 0, budget_ = 0;
};

}  // namespace md::exec
