// Shared device helpers of the CUDA tiles: bf16 conversions with the host's rounding (round to
// nearest even, NaN kept), the activations, RMSNorm over a block, and an instruction's operands
// resolved against the step (the CUDA twin of exec::detail::Args).
#pragma once
#include "megadecode/base/bf16.h"
#include "port/port.h"
#include "step.h"

MD_CUDA_BEGIN

namespace port = ::md::cuda::port;

// The host's own conversions (base/bf16.h, shared with the device through MD_HOST_DEVICE).
MD_DEV float bf16f(uint16_t h) {
  return ::md::bf16_to_f32(h);
}
MD_DEV float round_bf16_d(float f) {
  return ::md::round_bf16(f);
}
MD_DEV float maybe_round(float x, bool r) {
  return r ? round_bf16_d(x) : x;
}
MD_DEV float sigmoid_d(float x) {
  return 1.0f / (1.0f + port::exp_f(-x));
}

// The gated activation of one element (Numerics::activation; numerics.h glu): silu(g) * u with
// the reference's rounding points, or K3's SiTU.
MD_DEV float glu_d(const Numerics& n, float g, float u) {
  if (n.activation == Activation::kSitu) {
    const float ib = 1.0f / n.situ_beta;
    if (n.situ_linear_beta > 0) u = n.situ_linear_beta * port::tanh_f(u * (1.0f / n.situ_linear_beta));
    return maybe_round(n.situ_beta * port::tanh_f(g * ib) * sigmoid_d(g) * u, n.round_bf16);
  }
  if (n.round_bf16) return round_bf16_d(round_bf16_d(g * sigmoid_d(g)) * u);
  return g * sigmoid_d(g) * u;
}

// An instruction's operands.
struct Args {
  const DevStep& s;
  const plan::BufferDesc* a;
  int layer;
  MD_DEV float* f(int i, int t = 0) const {
    return reinterpret_cast<float*>(s.arena + a[i].offset + a[i].stride * uint64_t(t));
  }
  MD_DEV int32_t* ints(int i, int t = 0) const {
    return reinterpret_cast<int32_t*>(s.arena + a[i].offset + a[i].stride * uint64_t(t));
  }
  MD_DEV int64_t ld(int i) const { return int64_t(a[i].stride / 4); }
  MD_DEV const DevWeight& w(int i, int e = 0) const { return s.weights[a[i].offset + uint64_t(e)]; }
  MD_DEV const float* vec(int i) const { return static_cast<const float*>(w(i).data); }
  MD_DEV bool present(int i) const { return a[i].kind != plan::BufKind::kNull; }
  MD_DEV const DevSeq& seq(int b) const {
    return s.seqs[size_t(b) * size_t(s.cfg.num_layers) + size_t(layer)];
  }
};

// The work area of a tile block (after the weight stages): kWorkFloats floats.
MD_DEV float* work() {
  return reinterpret_cast<float*>(port::smem() + kStages * kStageBytes + 128);
}

// y[0..n) = rmsnorm(x) * w with the reference's rounding points (cpu::rmsnorm): the sum of
// squares over the block in fp32 (the CPU sums in double; both are within fp32 rounding of the
// exact statistic), the normalised value rounded before the weight multiply and after.
// Every thread of the block calls it; red: 32 floats of work memory.
MD_DEV void rmsnorm_block(const float* x, const float* w, int64_t n, float eps, float* y,
                          bool round, float* red) {
  float ss = 0;
  for (int64_t i = port::thread_id(); i < n; i += port::block_threads()) ss += x[i] * x[i];
  ss = port::block_sum(ss, red);
  const float r = 1.0f / port::sqrt_f(ss / float(n) + eps);
  for (int64_t i = port::thread_id(); i < n; i += port::block_threads())
    y[i] = round ? round_bf16_d(w[i] * round_bf16_d(x[i] * r)) : w[i] * (x[i] * r);
}

MD_CUDA_END
