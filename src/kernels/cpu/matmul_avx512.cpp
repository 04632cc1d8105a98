// AVX-512 matmul kernels without BF16 instructions (compiled with AVX-512 F/BW/VL/DQ only; see
// CMakeLists.txt): bf16 weights x fp32 activations and fp32 x fp32, both with fp32 FMAs. They serve
// the avx512 level and, for x_is_bf16 = false and matmul_f32, the avx512bf16 level too. The tiling
// is in matmul_avx512_tiles.h.
#include "matmul_avx512_tiles.h"
#include "megadecode/kernels/cpu/matmul.h"

namespace md::cpu::detail {
namespace {

// bf16 weights x fp32 activations. A bf16 is the top half of an fp32, so the 32 weights of a
// 64-byte step widen with one shift (even elements) and one mask (odd elements) instead of
// shuffles; pack_x stores X de-interleaved to match (16 even, then 16 odd elements per chunk).
// Lane i accumulates w[2i]*x[2i] and then w[2i+1]*x[2i+1], each as a fused multiply-add.
struct OpF32FromBf16 {
  using WT = bf16;
  using XT = float;
  struct XV {
    __m512 even, odd;
  };
  static constexpr int kChunk = 32;
  static void pack_x(const float* x, int64_t K, XT* out) {
    const __m512i even =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t k = 0; k < K; k += 32) {
      __m512 lo = _mm512_maskz_loadu_ps(mask16(K - k), x + k);
      __m512 hi = _mm512_maskz_loadu_ps(mask16(K - k - 16), x + k + 16);
      _mm512_store_ps(out + k, _mm512_permutex2var_ps(lo, even, hi));
      _mm512_store_ps(out + k + 16, _mm512_permutex2var_ps(lo, odd, hi));
    }
  }
  static XV load_x(const XT* p) { return {_mm512_load_ps(p), _mm512_load_ps(p + 16)}; }
  static __m512i load_w(const WT* p) { return _mm512_loadu_si512(p); }
  static __m512i load_w_tail(const WT* p, int64_t n) {
    return _mm512_maskz_loadu_epi16(mask32(n), p);
  }
  static void step(__m512& acc, __m512i w, const XV& x) {
    const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536)));
    acc = _mm512_fmadd_ps(we, x.even, acc);
    acc = _mm512_fmadd_ps(wo, x.odd, acc);
  }
};

// fp32 weights x fp32 activations: lane i accumulates element i of each 16-element chunk.
struct OpF32 {
  using WT = float;
  using XT = float;
  using XV = __m512;
  static constexpr int kChunk = 16;
  static void pack_x(const float* x, int64_t K, XT* out) {
    for (int64_t k = 0; k < K; k += 16)
      _mm512_store_ps(out + k, _mm512_maskz_loadu_ps(mask16(K - k), x + k));
  }
  static XV load_x(const XT* p) { return _mm512_load_ps(p); }
  static __m512 load_w(const WT* p) { return _mm512_loadu_ps(p); }
  static __m512 load_w_tail(const WT* p, int64_t n) { return _mm512_maskz_loadu_ps(mask16(n), p); }
  static void step(__m512& acc, __m512 w, const XV& x) { acc = _mm512_fmadd_ps(w, x, acc); }
};

}  // namespace

void matmul_bf16_avx512(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                        int64_t ldx, float* Y, int64_t ldy) {
  matmul<OpF32FromBf16>(W, K, r0, r1, X, B, ldx, Y, ldy);
}

void matmul_f32_avx512(const float* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                       int64_t ldx, float* Y, int64_t ldy) {
  matmul<OpF32>(W, K, r0, r1, X, B, ldx, Y, ldy);
}

}  // namespace md::cpu::detail
