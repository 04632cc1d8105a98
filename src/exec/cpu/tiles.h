// The CPU interpreter of one instruction (tiles.cpp) and the per-step context it reads.
#pragma once
#include <cstdint>
#include <vector>

#include "megadecode/base/dtype.h"
#include "megadecode/kernels/cpu/ops.h"
#include "megadecode/model/config.h"
#include "megadecode/plan/plan.h"

namespace md::exec {

// A weight-table entry bound to memory: a [rows, cols] matrix or an fp32 vector (rows = 1).
struct WeightView {
  const void* data = nullptr;
  DType dtype = DType::BF16;
  int64_t rows = 0, cols = 0;
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
  float eps = 0, latent_eps = 0;
  cpu::RouterParams router;
  uint8_t* arena = nullptr;
  const WeightView* weights = nullptr;
  int batch = 0;
  const int32_t* tokens = nullptr;
  float* logits = nullptr;
  const SeqView* seqs = nullptr;  // [b * layers + l]
  const int64_t* pos = nullptr;   // [b]: position of this step's token (cache rows before it)
};

// Scratch owned by one worker; sized by scratch_floats() for the plan.
struct Scratch {
  std::vector<float> f;
  std::vector<int> i;
};
size_t scratch_floats(const plan::Plan& p);
size_t scratch_ints(const plan::Plan& p);

void run_instr(const StepCtx& s, const plan::Instr& in, Scratch& sc);

// Hints the first cache lines of the tile's weights (the tile after the current one).
void prefetch_instr(const StepCtx& s, const plan::Instr& in);

}  // namespace md::exec
