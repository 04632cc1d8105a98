// Internal to the engine: the per-layer ops of the reference forward path (Model::forward), split
// by architecture part (attention: forward_attention.cpp; FFN and MoE: forward_ffn.cpp; the
// residual stream, block attention residuals and logits: model.cpp). Kimi Linear and Kimi K3 run
// through the same functions; K3's extensions are switched by the ModelConfig.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <span>

#include "megadecode/base/threads.h"
#include "megadecode/engine/model.h"
#include "megadecode/kernels/cpu/ops.h"

namespace md::fwd {

// Y[b][r] = W X[b] for one weight matrix (BF16, F32 or MXFP4), B input vectors.
struct MatJob {
  const Mat* w;
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
  int B;
};

// Runs several matmuls in one parallel region: the union of their rows is split evenly (in
// blocks of 16 rows) across the workers. A row's result does not depend on the split.
void run_matmuls(ThreadPool& pool, std::span<const MatJob> jobs, bool x_bf16);

struct Forward {
  const ModelConfig& c;
  const ModelWeights& w;
  const Numerics& num;
  ThreadPool& pool;

  bool rnd() const { return num.round_bf16; }
  void round(float* x, int64_t n) const {
    if (rnd()) cpu::round_bf16_inplace(x, n);
  }
  void matmuls(std::initializer_list<MatJob> jobs) const {
    run_matmuls(pool, std::span<const MatJob>(jobs.begin(), jobs.size()), rnd());
  }

  // Each reads h [T][D] (the normed layer input) and writes out [T][D]; attention updates the
  // sequence's state for layer l.
  void kda(int l, SequenceState& s, const float* h, int T, float* out) const;
  void mla(int l, SequenceState& s, const float* h, int T, float* out) const;
  void dense_ffn(const FfnWeights& f, const float* h, int T, float* out) const;
  void moe(int l, const float* h, int T, float* out) const;
};

}  // namespace md::fwd
