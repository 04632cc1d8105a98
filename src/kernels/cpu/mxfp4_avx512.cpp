// AVX-512 MXFP4 kernels. Compiled with AVX-512 BF16 enabled; mxfp4.cpp only enters them after a
// run-time CPU check (the matmul ISA selection), and matmul_mxfp4_avx512 uses no BF16 instruction
// so that it also serves AVX-512 CPUs without BF16.
//
// Weights are decoded group by group (32 codes = 16 packed bytes) in registers: the 16 bytes widen
// to 16 dword lanes, and a permute of a 16-entry table turns nibbles into values. Each output
// Y[b, r] has one zmm accumulator that walks the groups in order:
//   g = (products of the group's 32 codes with x, per lane)       [unscaled e2m1 values]
//   acc = fma(g, 2^(s - 127), acc)
// and ends with a fixed pairwise reduction of its 16 lanes. Register tiles of several rows x
// several vectors only share loads and decodes between these sequences, never mix them, so a
// result is the same whatever tile, row range, batch size or thread produced it.

// GCC 12 reports its own AVX-512 intrinsics (which start from _mm512_undefined_*) as reading
// uninitialised values once they are inlined (GCC PR 105593, fixed in GCC 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <new>

#include "megadecode/kernels/cpu/mxfp4.h"

namespace md::cpu::detail {
namespace {

// Per-thread buffer for the repacked activations; grows, never shrinks.
class XScratch {
 public:
  ~XScratch() { std::free(p_); }
  void* get(size_t bytes) {
    if (bytes > cap_) {
      std::free(p_);
      cap_ = (bytes + 4095) / 4096 * 4096;
      p_ = std::aligned_alloc(64, cap_);
      if (!p_) {
        cap_ = 0;
        throw std::bad_alloc();
      }
    }
    return p_;
  }

 private:
  void* p_ = nullptr;
  size_t cap_ = 0;
};
thread_local XScratch t_xscratch;

// Vectors repacked per block (bounds the scratch size).
constexpr int kBatchBlock = 64;
// B > 4: packed bytes per row chunk, kept in L2 while every batch tile passes over it.
constexpr int64_t kRowChunkBytes = 256 << 10;
// Prefetch distance along each row stream. The GEMV tile streams 16 rows at once (16 independent
// chains, 16 streams in flight), as matmul_bf16 does; a tile of 4 groups is one cache line of
// packed bytes per row, which gets one prefetch.
constexpr int kPrefetchBytes = 512;
constexpr int kGemvRows = 16;
constexpr int kTileRows = 4;
constexpr int kTileVecs = 4;

// Sum of the 16 lanes in a fixed tree: lane i + lane i+8, then i + i+4, i + i+2, i + i+1.
inline float hsum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1));
  return _mm512_cvtss_f32(v);
}

// The 16 packed bytes of a group, one per dword lane.
inline __m512i load_group(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// An Op is one activation format:
//   XT, pack_x        repacked activation element type; pack_x converts K fp32 values (K % 32 == 0)
//   XV, load_x        one group of repacked activations in registers
//   WV, decode        one group of decoded (unscaled) weights in registers
//   dot               per-lane products of one group, in the Op's fixed order

// bf16 bit patterns of the 16 e2m1 codes, twice (vpermw indexes 32 words; indices are <= 15).
alignas(64) constexpr uint16_t kBf16Codes[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,  // 0, 0.5, 1, 1.5, 2, 3, 4, 6
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,  // their negatives
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,  //
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

// bf16 activations, vdpbf16ps. A dword lane j of the decoded group holds bf16(code of column 2j)
// in its low half and bf16(column 2j+1) in its high half, which is the pairing vdpbf16ps uses with
// X in natural order: lane j = x[2j] w[2j] + x[2j+1] w[2j+1] (products of bf16 values are exact).
struct OpDpBf16 {
  using XT = uint16_t;
  using XV = __m512bh;
  using WV = __m512i;
  static void pack_x(const float* x, int64_t K, XT* out) {
    for (int64_t k = 0; k < K; k += 32) {
      const __m512 lo = _mm512_loadu_ps(x + k), hi = _mm512_loadu_ps(x + k + 16);
      // Round-to-nearest-even, exact for the bf16-representable values promised.
      _mm512_store_si512(out + k, std::bit_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
  static XV load_x(const XT* p) { return std::bit_cast<__m512bh>(_mm512_load_si512(p)); }
  static WV decode(const uint8_t* p) {
    const __m512i lut = _mm512_load_si512(kBf16Codes);
    const __m512i b = load_group(p);
    // Word indices: low word = byte & 15, high word = byte >> 4, i.e. (b | b << 12) & 0x000F000F.
    const __m512i idx =
        _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    return _mm512_permutexvar_epi16(idx, lut);
  }
  static __m512 dot(const WV& w, const XV& x) {
    return _mm512_dpbf16_ps(_mm512_setzero_ps(), std::bit_cast<__m512bh>(w), x);
  }
};

// fp32 activations, FMA. The decoded group is two fp32 vectors: lane j of `even` is column 2j,
// of `odd` column 2j+1 (vpermps reads only the low 4 index bits, so the low nibble needs no mask).
// pack_x stores X de-interleaved to match: per group 16 even then 16 odd elements.
// Lane j = fma(w[2j+1], x[2j+1], w[2j] * x[2j]).
struct OpFma {
  using XT = float;
  struct XV {
    __m512 even, odd;
  };
  struct WV {
    __m512 even, odd;
  };
  static void pack_x(const float* x, int64_t K, XT* out) {
    const __m512i even =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t k = 0; k < K; k += 32) {
      const __m512 lo = _mm512_loadu_ps(x + k), hi = _mm512_loadu_ps(x + k + 16);
      _mm512_store_ps(out + k, _mm512_permutex2var_ps(lo, even, hi));
      _mm512_store_ps(out + k + 16, _mm512_permutex2var_ps(lo, odd, hi));
    }
  }
  static XV load_x(const XT* p) { return {_mm512_load_ps(p), _mm512_load_ps(p + 16)}; }
  static WV decode(const uint8_t* p) {
    const __m512 lut = _mm512_set_ps(-6.0f, -4.0f, -3.0f, -2.0f, -1.5f, -1.0f, -0.5f, -0.0f, 6.0f,
                                     4.0f, 3.0f, 2.0f, 1.5f, 1.0f, 0.5f, 0.0f);
    const __m512i b = load_group(p);
    return {_mm512_permutexvar_ps(b, lut), _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut)};
  }
  static __m512 dot(const WV& w, const XV& x) {
    return _mm512_fmadd_ps(w.odd, x.odd, _mm512_mul_ps(w.even, x.even));
  }
};

// One group for an NR x NB register tile. w points at the group's packed bytes of the first row
// (row stride rb), s at its scale byte (row stride G), x at the group's activations (stride xs).
template <class Op, int NR, int NB>
inline void group_step(__m512 (&acc)[NR][NB], const uint8_t* w, int64_t rb, const uint8_t* s,
                       int64_t G, const typename Op::XT* x, int64_t xs) {
  typename Op::XV xv[NB];
  for (int j = 0; j < NB; ++j) xv[j] = Op::load_x(x + j * xs);
  for (int i = 0; i < NR; ++i) {
    const typename Op::WV wv = Op::decode(w + i * rb);
    const __m512 sc = _mm512_set1_ps(kMxfp4ScaleTable[s[i * G]]);
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(Op::dot(wv, xv[j]), sc, acc[i][j]);
  }
}

// NR consecutive rows (packed at w, scales at s) times NB repacked vectors at x (stride xs);
// writes y[j * ldy + i] for row i, vector j.
template <class Op, int NR, int NB, bool kPrefetch>
void tile(const uint8_t* w, const uint8_t* s, int64_t K, const typename Op::XT* x, int64_t xs,
          float* y, int64_t ldy) {
  const int64_t G = K / 32, rb = K / 2;
  __m512 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {  // one 64-byte line of packed bytes per row
    if constexpr (kPrefetch) {
      for (int i = 0; i < NR; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + i * rb + g * 16) + kPrefetchBytes,
                     _MM_HINT_T0);
    }
    for (int q = 0; q < 4; ++q)
      group_step<Op, NR, NB>(acc, w + (g + q) * 16, rb, s + g + q, G, x + (g + q) * 32, xs);
  }
  for (; g < G; ++g) group_step<Op, NR, NB>(acc, w + g * 16, rb, s + g, G, x + g * 32, xs);
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) y[j * ldy + i] = hsum(acc[i][j]);
}

// Rows [r, r1) for NB vectors: tiles of NR rows, then the rest in tiles of NR/2, NR/4, .., 1.
template <class Op, int NB, bool kPrefetch, int NR>
void row_tiles(const uint8_t* P, const uint8_t* S, int64_t K, int64_t r, int64_t r1,
               const typename Op::XT* x, int64_t xs, float* y, int64_t ldy) {
  const int64_t rb = K / 2, G = K / 32;
  for (; r + NR <= r1; r += NR)
    tile<Op, NR, NB, kPrefetch>(P + r * rb, S + r * G, K, x, xs, y + r, ldy);
  if constexpr (NR > 1) row_tiles<Op, NB, kPrefetch, NR / 2>(P, S, K, r, r1, x, xs, y, ldy);
}

// One batch tile of nv <= kTileVecs vectors over rows [r0, r1). kTall: this pass reads the
// weights from DRAM, so use the taller, prefetching tiles.
template <class Op, bool kTall>
void batch_tile(int nv, const uint8_t* P, const uint8_t* S, int64_t K, int64_t r0, int64_t r1,
                const typename Op::XT* x, int64_t xs, float* y, int64_t ldy) {
  switch (nv) {
    case 1:
      row_tiles<Op, 1, kTall, kTall ? kGemvRows : kTileRows>(P, S, K, r0, r1, x, xs, y, ldy);
      break;
    case 2:
      row_tiles<Op, 2, kTall, kTall ? 8 : kTileRows>(P, S, K, r0, r1, x, xs, y, ldy);
      break;
    case 3:
      row_tiles<Op, 3, kTall, kTall ? 8 : kTileRows>(P, S, K, r0, r1, x, xs, y, ldy);
      break;
    default:
      row_tiles<Op, 4, kTall, kTileRows>(P, S, K, r0, r1, x, xs, y, ldy);
      break;
  }
}

template <class Op>
void matmul(const uint8_t* P, const uint8_t* S, int64_t K, int64_t r0, int64_t r1, const float* X,
            int B, int64_t ldx, float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || K < 32) return;
  using XT = typename Op::XT;
  const int64_t xs = K;  // K % 32 == 0: rows of the repacked block stay 64-byte aligned
  const int64_t row_bytes = K / 2 + K / 32;
  const int64_t chunk_rows =
      std::max<int64_t>(kTileRows, kRowChunkBytes / row_bytes / kTileRows * kTileRows);
  for (int bs = 0; bs < B; bs += kBatchBlock) {
    const int nb = std::min(kBatchBlock, B - bs);
    XT* xb = static_cast<XT*>(t_xscratch.get(static_cast<size_t>(nb * xs) * sizeof(XT)));
    for (int j = 0; j < nb; ++j) Op::pack_x(X + (bs + j) * ldx, K, xb + j * xs);
    float* yb = Y + bs * ldy;
    if (nb <= kTileVecs) {
      batch_tile<Op, true>(nb, P, S, K, r0, r1, xb, xs, yb, ldy);
      continue;
    }
    for (int64_t rc = r0; rc < r1; rc += chunk_rows) {
      const int64_t rce = std::min(r1, rc + chunk_rows);
      for (int j = 0; j < nb; j += kTileVecs) {
        const int nv = std::min(kTileVecs, nb - j);
        if (j == 0) {
          batch_tile<Op, true>(nv, P, S, K, rc, rce, xb, xs, yb, ldy);
        } else {
          batch_tile<Op, false>(nv, P, S, K, rc, rce, xb + j * xs, xs, yb + j * ldy, ldy);
        }
      }
    }
  }
}

}  // namespace

void matmul_mxfp4_avx512bf16(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t r0,
                             int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy,
                             bool x_is_bf16) {
  if (x_is_bf16) {
    matmul<OpDpBf16>(packed, scales, K, r0, r1, X, B, ldx, Y, ldy);
  } else {
    matmul<OpFma>(packed, scales, K, r0, r1, X, B, ldx, Y, ldy);
  }
}

void matmul_mxfp4_avx512(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t r0,
                         int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy) {
  matmul<OpFma>(packed, scales, K, r0, r1, X, B, ldx, Y, ldy);
}

}  // namespace md::cpu::detail
