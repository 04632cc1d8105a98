// Run-time dispatch between the AVX-512 kernels (matmul_avx512.cpp) and the portable path below,
// which must stay within the x86-64 baseline (SSE2) because it is what runs when the CPU check
// fails.
#include "megadecode/kernels/cpu/matmul.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace md::cpu {
namespace {

enum class Isa { kPortable, kAvx512, kAvx512Bf16 };

// The best ISA the CPU and OS support, ignoring the environment.
Isa hardware_isa() {
  __builtin_cpu_init();  // needed when this runs from a static initialiser, harmless otherwise
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!avx512) return Isa::kPortable;
  return __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
}

// MEGADECODE_ISA may only lower the choice: asking for an ISA the CPU lacks falls back to the best.
Isa initial_isa() {
  const Isa hw = hardware_isa();
  const char* env = std::getenv("MEGADECODE_ISA");
  if (!env) return hw;
  if (std::strcmp(env, "portable") == 0) return Isa::kPortable;
  if (std::strcmp(env, "avx512") == 0 && hw != Isa::kPortable) return Isa::kAvx512;
  return hw;
}

std::atomic<Isa>& isa_state() {
  static std::atomic<Isa> isa{initial_isa()};
  return isa;
}

Isa current_isa() {
  return isa_state().load(std::memory_order_relaxed);
}

// ---- Portable path -------------------------------------------------------------------------
// Eight fp32 lanes per output: lane l accumulates elements k with k % 8 == l, in increasing k,
// as separate multiply and add (the baseline has no FMA), then a fixed pairwise reduction. GCC
// vectorises the lane loops into SSE2; the row tile shares each X load across kRows rows.

constexpr int kLanes = 8;
constexpr int kRows = 4;

inline float widen(bf16 v) {
  return bf16_to_f32(v);
}
inline float widen(float v) {
  return v;
}

template <class WT, int NR>
void portable_tile(const WT* w, int64_t K, const float* x, float* y) {
  float acc[NR][kLanes] = {};
  const int64_t kfull = K / kLanes * kLanes;
  for (int64_t k = 0; k < kfull; k += kLanes) {
    for (int i = 0; i < NR; ++i) {
      const WT* wi = w + i * K + k;
      for (int l = 0; l < kLanes; ++l) acc[i][l] += widen(wi[l]) * x[k + l];
    }
  }
  for (int64_t k = kfull; k < K; ++k) {
    for (int i = 0; i < NR; ++i) acc[i][k - kfull] += widen(w[i * K + k]) * x[k];
  }
  for (int i = 0; i < NR; ++i) {
    const float* a = acc[i];
    y[i] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
  }
}

template <class WT>
void portable_matmul(const WT* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                     int64_t ldx, float* Y, int64_t ldy) {
  if (K <= 0) return;
  // Rows outer, vectors inner: a tile's rows (kRows * K weights) stay in L1/L2 while every vector
  // passes over them, so weights are read from memory once per call.
  float y[kRows];
  for (int64_t r = r0; r < r1; r += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, r1 - r));
    for (int b = 0; b < B; ++b) {
      const WT* w = W + r * K;
      const float* x = X + b * ldx;
      switch (nr) {
        case 4:
          portable_tile<WT, 4>(w, K, x, y);
          break;
        case 3:
          portable_tile<WT, 3>(w, K, x, y);
          break;
        case 2:
          portable_tile<WT, 2>(w, K, x, y);
          break;
        default:
          portable_tile<WT, 1>(w, K, x, y);
          break;
      }
      for (int i = 0; i < nr; ++i) Y[b * ldy + r + i] = y[i];
    }
  }
}

}  // namespace

void matmul_bf16(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                 int64_t ldx, float* Y, int64_t ldy, bool x_is_bf16) {
  if (r0 >= r1 || B <= 0) return;
  switch (current_isa()) {
    case Isa::kAvx512Bf16:
      detail::matmul_bf16_avx512bf16(W, K, r0, r1, X, B, ldx, Y, ldy, x_is_bf16);
      break;
    case Isa::kAvx512:
      detail::matmul_bf16_avx512(W, K, r0, r1, X, B, ldx, Y, ldy);
      break;
    case Isa::kPortable:
      // X values are used exactly in fp32 either way, so x_is_bf16 changes nothing here.
      portable_matmul(W, K, r0, r1, X, B, ldx, Y, ldy);
      break;
  }
}

void matmul_f32(const float* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                int64_t ldx, float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0) return;
  if (current_isa() == Isa::kPortable) {
    portable_matmul(W, K, r0, r1, X, B, ldx, Y, ldy);
  } else {
    detail::matmul_f32_avx512(W, K, r0, r1, X, B, ldx, Y, ldy);
  }
}

const char* matmul_isa() {
  switch (current_isa()) {
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kPortable:
      break;
  }
  return "portable";
}

bool set_matmul_isa(const char* name) {
  const std::string_view n = name ? name : "";
  const Isa hw = hardware_isa();
  Isa want;
  if (n == "auto") {
    want = hw;
  } else if (n == "portable") {
    want = Isa::kPortable;
  } else if (n == "avx512" && hw != Isa::kPortable) {
    want = Isa::kAvx512;
  } else if (n == "avx512bf16" && hw == Isa::kAvx512Bf16) {
    want = Isa::kAvx512Bf16;
  } else {
    return false;
  }
  isa_state().store(want, std::memory_order_relaxed);
  return true;
}

void set_matmul_isa_portable(bool portable) {
  isa_state().store(portable ? Isa::kPortable : hardware_isa(), std::memory_order_relaxed);
}

}  // namespace md::cpu
