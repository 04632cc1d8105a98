// Integer dot-product matmul (qdot.h): the activation quantizer, the portable kernel and the
// run-time dispatch.
#include "megadecode/kernels/cpu/qdot.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "megadecode/kernels/cpu/cpu_features.h"
#include "q4_kernels.h"
#include "qdot_kernels.h"

namespace md::cpu {

namespace {

// qdot.h's activation quantization with the largest code T.
template <class T>
void quantize_activations(const float* x, int64_t K, float top, T* t, float* d) {
  for (int64_t j = 0; j < K / 32; ++j) {
    const float* xj = x + 32 * j;
    float amax = 0.0f;
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(xj[k]));
    const float dj = amax / top;
    d[j] = dj;
    for (int k = 0; k < 32; ++k) {
      const float q = amax > 0.0f ? std::clamp(std::nearbyint(xj[k] / dj), -top, top) : 0.0f;
      t[32 * j + k] = static_cast<T>(q);
    }
  }
}

}  // namespace

void quantize_activations_int8(const float* x, int64_t K, int8_t* t, float* d) {
  quantize_activations(x, K, 127.0f, t, d);
}

void quantize_activations_int16(const float* x, int64_t K, int16_t* t, float* d) {
  quantize_activations(x, K, static_cast<float>(kQdotInt16Max), t, d);
}

namespace detail {

// The portable kernel (x86-64 baseline: no FMA, no VNNI). Per row and vector, one fp32 lane per
// 32-column sub-group in turn: acc = acc + (float(D_j) * d_j) * s_g, with D_j the sub-group's exact
// int32 dot product. The vector's quantization is done once per call and shared by every row.
void matmul_qdot_portable(const QdotWeights& w, int64_t r0, int64_t r1, const float* X, int B,
                          int64_t ldx, float* Y, int64_t ldy) {
  const int64_t K = w.K, G = K / 32;
  const int per = w.group / 32;
  thread_local std::vector<int16_t> t;
  thread_local std::vector<int8_t> t8;
  thread_local std::vector<float> d;
  t.resize(static_cast<size_t>(B * K));
  d.resize(static_cast<size_t>(B * G));
  for (int b = 0; b < B; ++b) {
    if (w.acts == QdotActs::kInt16) {
      quantize_activations_int16(X + b * ldx, K, t.data() + b * K, d.data() + b * G);
    } else {
      t8.resize(static_cast<size_t>(K));
      quantize_activations_int8(X + b * ldx, K, t8.data(), d.data() + b * G);
      std::copy(t8.begin(), t8.end(), t.begin() + b * K);
    }
  }
  int16_t q[32];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* srow = w.scales + r * w.scale_row_bytes();
    for (int b = 0; b < B; ++b) {
      const int16_t* tb = t.data() + b * K;
      float acc = 0.0f;
      for (int64_t j = 0; j < G; ++j) {
        float s;  // the weights' scale of the sub-group (MXFP4: halved, q = 2v)
        if (w.kind == QdotCodes::kInt4 || w.kind == QdotCodes::kMxfp4) {
          const uint8_t* p = w.codes + r * (K / 2) + 16 * j;
          for (int k = 0; k < 32; ++k) {
            const int c = k % 2 ? p[k / 2] >> 4 : p[k / 2] & 15;
            q[k] = static_cast<int16_t>(w.kind == QdotCodes::kInt4 ? c - 8
                                                                   : 2.0f * detail::kE2m1Values[c]);
          }
        } else {
          const uint8_t* p = w.codes + r * K + 32 * j;
          for (int k = 0; k < 32; ++k) q[k] = static_cast<int16_t>(p[k] - 128);
        }
        if (w.kind == QdotCodes::kMxfp4) {
          s = 0.5f * detail::kMxfp4ScaleTable[srow[j]];
        } else {
          bf16 b;
          std::memcpy(&b, srow + 2 * (j / per),
                      sizeof(b));  // (scale rows are bytes: no typed read)
          s = bf16_to_f32(b);
        }
        int32_t dot = 0;
        for (int k = 0; k < 32; ++k) dot += int32_t{q[k]} * tb[32 * j + k];
        acc = acc + (static_cast<float>(dot) * d[b * G + j]) * s;
      }
      Y[b * ldy + r] = acc;
    }
  }
}

}  // namespace detail

void matmul_qdot(const QdotWeights& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
                 float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || w.K <= 0) return;
  switch (active_isa()) {
    case Isa::kAvx512Bf16:
      detail::matmul_qdot_avx512vnni(w, r0, r1, X, B, ldx, Y, ldy);
      return;
    case Isa::kAvx512:
    case Isa::kAvx2:
      detail::matmul_qdot_avx2(w, r0, r1, X, B, ldx, Y, ldy);
      return;
    case Isa::kPortable:
      break;
  }
  detail::matmul_qdot_portable(w, r0, r1, X, B, ldx, Y, ldy);
}

const char* matmul_qdot_isa() {
  switch (active_isa()) {
    case Isa::kAvx512Bf16:
      return "avx512vnni";
    case Isa::kAvx512:
    case Isa::kAvx2:
      return "avx2";
    case Isa::kPortable:
      break;
  }
  return "portable";
}

}  // namespace md::cpu
