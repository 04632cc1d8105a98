// The AVX-512 BF16 matmul kernel (compiled with -mavx512bf16 on top of the AVX-512 flags; entered
// only at the avx512bf16 level): bf16 weights x bf16-valued activations with vdpbf16ps. The
// x_is_bf16 = false case at that level runs matmul_bf16_avx512 (matmul_avx512.cpp). The tiling is
// in matmul_avx512_tiles.h.
#include "matmul_avx512_tiles.h"
#include "megadecode/kernels/cpu/matmul.h"

namespace md::cpu::detail {
namespace {

// bf16 weights x bf16 activations with vdpbf16ps: lane i accumulates elements 2i and 2i+1 of
// each 32-element chunk. Products of bf16 values are exact in fp32.
struct OpDpBf16 {
  using WT = bf16;
  using XT = bf16;
  using XV = __m512bh;
  static constexpr int kChunk = 32;
  static void pack_x(const float* x, int64_t K, XT* out) {
    for (int64_t k = 0; k < K; k += 32) {
      __m512 lo = _mm512_maskz_loadu_ps(mask16(K - k), x + k);
      __m512 hi = _mm512_maskz_loadu_ps(mask16(K - k - 16), x + k + 16);
      // Round-to-nearest-even, which is exact for the bf16-representable values promised.
      _mm512_store_si512(out + k, std::bit_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
  static XV load_x(const XT* p) { return std::bit_cast<__m512bh>(_mm512_load_si512(p)); }
  static __m512i load_w(const WT* p) { return _mm512_loadu_si512(p); }
  static __m512i load_w_tail(const WT* p, int64_t n) {
    return _mm512_maskz_loadu_epi16(mask32(n), p);
  }
  static void step(__m512& acc, __m512i w, const XV& x) {
    acc = _mm512_dpbf16_ps(acc, std::bit_cast<__m512bh>(w), x);
  }
};

}  // namespace

void matmul_bf16_avx512bf16(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                            int64_t ldx, float* Y, int64_t ldy) {
  matmul<OpDpBf16>(W, K, r0, r1, X, B, ldx, Y, ldy);
}

}  // namespace md::cpu::detail
