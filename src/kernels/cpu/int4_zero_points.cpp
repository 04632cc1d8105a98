// Asymmetric int4's zero-point terms (int4.h, int4_zero_point_terms): the portable path and the
// run-time dispatch. The AVX-512 and AVX2 paths (int4_zero_points_avx512.cpp, _avx2.cpp) keep the
// same lanes and tree.
#include <cstring>
#include <vector>

#include "megadecode/kernels/cpu/cpu_features.h"
#include "megadecode/kernels/cpu/int4.h"
#include "q4_kernels.h"

namespace md::cpu {

namespace {

// The fixed reduction of 16 lanes: l[i] += l[i + 8], then + 4, + 2, + 1 (the AVX-512 path's
// halving tree).
float tree16(float* l) {
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) l[i] += l[i + w];
  return l[0];
}

void group_sums_portable(const float* X, int B, int64_t ldx, int64_t K, int group, float* xs) {
  const int64_t G = K / group;
  for (int b = 0; b < B; ++b)
    for (int64_t g = 0; g < G; ++g) {
      float l[16] = {};
      const float* x = X + b * ldx + g * group;
      for (int k = 0; k < group; ++k) l[k % 16] += x[k];
      xs[b * G + g] = tree16(l);
    }
}

void terms_portable(const uint8_t* scales, const int8_t* z, int64_t G, int64_t r0, int64_t r1,
                    const float* xs, int B, float* Y, int64_t ldy) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* sr = scales + r * G * 2;
    const int8_t* zr = z + r * G;
    for (int b = 0; b < B; ++b) {
      float l[16] = {};
      for (int64_t g = 0; g < G; ++g) {
        bf16 s;
        std::memcpy(&s, sr + 2 * g, 2);  // (scale rows are bytes: no typed read)
        l[g % 16] += (bf16_to_f32(s) * float(zr[g])) * xs[b * G + g];
      }
      Y[b * ldy + r] -= tree16(l);
    }
  }
}

}  // namespace

void int4_zero_point_terms(const bf16* scales, const int8_t* z, int64_t K, int group, int64_t r0,
                           int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || K <= 0) return;
  const int64_t G = K / group;
  thread_local std::vector<float> xs;
  xs.resize(size_t(B) * size_t(G));
  const auto* s = reinterpret_cast<const uint8_t*>(scales);
  if (active_isa() >= Isa::kAvx512) {
    detail::int4_group_sums_avx512(X, B, ldx, K, group, xs.data());
    detail::int4_zero_point_terms_avx512(s, z, G, r0, r1, xs.data(), B, Y, ldy);
    return;
  }
  if (active_isa() == Isa::kAvx2) {
    detail::int4_group_sums_avx2(X, B, ldx, K, group, xs.data());
    detail::int4_zero_point_terms_avx2(s, z, G, r0, r1, xs.data(), B, Y, ldy);
    return;
  }
  group_sums_portable(X, B, ldx, K, group, xs.data());
  terms_portable(s, z, G, r0, r1, xs.data(), B, Y, ldy);
}

}  // namespace md::cpu
