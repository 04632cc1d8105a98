// The CPU interpreter of one instruction (tiles.cpp) and the per-step context it reads.
#pragma once
#include <cstdint>
#include <vector>

#include "megadecode/base/dtype.h"
#include "megadecode/engine/sampler.h"
#include "megadecode/kernels/cpu/ops.h"
#include "megadecode/model/config.h"
#include "megadecode/model/weights.h"
#include "megadecode/plan/plan.h"

namespace md::exec {

// A weight-table entry bound to memory: a [rows, cols] matrix or an fp32 vector (rows = 1).
// An MXFP4 matrix (dtype U8) is its packed codes (data, [rows, cols/2]) and E8M0 scales
// ([rows, cols/32]).
struct WeightView {
  const void* data = nullptr;
  DType dtype = DType::BF16;
  int64_t rows = 0, cols = 0;
  const uint8_t* scales = nullptr;
};

// How the kSample tile picks sequence b's next token: its sampler (penalties look at history),
// or greedy argmax (ties to the lowest id) when sampler is null.
struct SampleBinding {
  Sampler* sampler = nullptr;
  const int32_t* history = nullptr;
  size_t history_len = 0;
};

// Per (sequence, layer) state pointers, resolved before every step.
struct SeqView {
  float* kda_state = nullptr;
  float* conv_cache = nullptr;
  float* mla_cache = nullptr;
};

struct StepCtx {
  const plan::Plan* plan = nullptr;
  const ModelConfig* cfg = nullptr;
  bool rnd = true;  // Precision::BF16
  // beta = sigmoid(b) rounded to bf16 (Kimi Linear's bf16 reference; K3 keeps it in fp32).
  bool round_beta = true;
  float eps = 0, latent_eps = 0;
  cpu::RouterParams router;
  uint8_t* arena = nullptr;
  const WeightView* weights = nullptr;
  int batch = 0;
  const int32_t* tokens = nullptr;
  float* logits = nullptr;
  const SeqView* seqs = nullptr;  // [b * layers + l]
  const int64_t* pos = nullptr;   // [b]: position of this step's token (cache rows before it)
  const SampleBinding* sampling = nullptr;  // [b], or null: greedy for every sequence
};

// Scratch owned by one worker; sized by scratch_floats() for the plan.
struct Scratch {
  std::vector<float> f;
  std::vector<int> i;
};
size_t scratch_floats(const plan::Plan& p);
size_t scratch_ints(const plan::Plan& p);

void run_instr(const StepCtx& s, const plan::Instr& in, Scratch& sc);

// The model memory a weight-table entry names (bind.cpp).
WeightView bind_weight(const ModelWeights& w, const plan::WeightRef& r);

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

 private:
  struct Range {
    const char* base = nullptr;
    size_t row_bytes = 0;
    uint32_t rows = 0;
  };
  void add(const void* base, size_t row_bytes, uint32_t rows);
  Range r_[3];
  std::vector<int> mark_;  // expert marks for resolving a slot
  int n_ = 0, cur_ = 0;
  uint32_t group_ = 0, row_ = 0;
  size_t col_ = 0, budget_ = 0;
};

}  // namespace md::exec
