// AVX-512 matmul kernels. Compiled with AVX-512 BF16 enabled; matmul.cpp only enters them after a
// run-time CPU check, and matmul_bf16_avx512 / matmul_f32_avx512 use no BF16 instruction so that
// they also serve AVX-512 CPUs without BF16.
//
// Every output element Y[b, r] gets one zmm accumulator (16 fp32 lanes) that walks K in 64-byte
// weight chunks in order, then a fixed pairwise reduction of its lanes. Register tiles of several
// rows x several vectors only share loads between those sequences, never mix them, so a result
// is the same whatever tile, row range, batch size or thread produced it.

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
#include <utility>

#include "megadecode/kernels/cpu/matmul.h"

namespace md::cpu::detail {
namespace {

// Per-thread buffer for the converted activations; grows, never shrinks (a few MB at most since
// batches are converted in blocks of kBatchBlock vectors).
class Scratch {
 public:
  ~Scratch() { std::free(p_); }
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
thread_local Scratch t_scratch;

// Vectors converted per block: bounds the scratch size while still reusing each weight tile for
// up to this many vectors.
constexpr int kBatchBlock = 64;
// Weight bytes per row chunk when B > 1: the chunk stays in L2 (2 MB per core on the target)
// while every batch tile passes over it, so each weight byte comes from DRAM once per call.
constexpr int64_t kRowChunkBytes = 256 << 10;
// GEMV (B = 1): one core's DRAM read rate is limited by the lines it has in flight, so the tile
// streams 16 rows at once (16 independent accumulator chains, 16 concurrent streams) and
// prefetches each row kPrefetchBytes ahead. Measured on the target (1 thread, weights from DRAM,
// relative to a plain 64-byte-load stream): 8 rows without prefetch 0.78-0.96x, 8 rows with
// 512-1024 B prefetch ~1.0-1.08x, 16 rows with 256-512 B prefetch ~1.07-1.18x; 4 or 24 rows,
// longer distances and T1/NTA hints were no better.
constexpr int kPrefetchBytes = 512;
constexpr int kGemvRows = 16;
// B > 1: a 4 rows x 4 vectors register tile (16 accumulators, each weight load feeding 4
// vectors) over row chunks, batch tiles outer, so a chunk comes from DRAM on the first batch
// tile (prefetched like the GEMV: ~1.2x at B = 2..4) and from L2 for the others. For B <= 4 there
// is a single batch tile, and taller tiles (8 rows for 2-3 vectors) keep more rows in flight.
constexpr int kTileRows = 4;
constexpr int kTileVecs = 4;

// Sum of the 16 lanes in a fixed tree: lane i + lane i+8, then i + i+4, i + i+2, i + i+1.
inline float hsum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));  // swap 256-bit halves
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));  // swap adjacent 128-bit blocks
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));        // swap 64-bit pairs
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1));        // swap neighbours
  return _mm512_cvtss_f32(v);
}

// Masks selecting the first n lanes (n may be <= 0 or beyond the width).
inline __mmask32 mask32(int64_t n) {
  return n <= 0 ? 0 : n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
}
inline __mmask16 mask16(int64_t n) {
  return static_cast<__mmask16>(n <= 0 ? 0u : n >= 16 ? 0xffffu : (1u << n) - 1u);
}

// An Op describes one weight/activation format pair:
//   WT, kChunk      weight element type and elements per 64-byte step
//   XT, XV          converted activation element type and the registers one step needs
//   pack_x          converts one fp32 vector of length K into kpad(K) XT values (zero padded)
//   load_w(_tail)   one step of weights (the tail zero-filled past K)
//   step            acc += that step's products, in the Op's fixed order

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

template <class Op>
int64_t kpad(int64_t K) {
  return (K + Op::kChunk - 1) / Op::kChunk * Op::kChunk;
}

// NR consecutive rows starting at w (row stride K) times NB packed vectors starting at x (stride
// xs); writes y[j * ldy + i] for row i, vector j.
template <class Op, int NR, int NB, bool kPrefetch>
void tile(const typename Op::WT* w, int64_t K, const typename Op::XT* x, int64_t xs, float* y,
          int64_t ldy) {
  __m512 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t kfull = K / Op::kChunk * Op::kChunk;
  int64_t k = 0;
  for (; k < kfull; k += Op::kChunk) {
    typename Op::XV xv[NB];
    for (int j = 0; j < NB; ++j) xv[j] = Op::load_x(x + j * xs + k);
    for (int i = 0; i < NR; ++i) {
      const typename Op::WT* wi = w + i * K + k;
      if constexpr (kPrefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(wi) + kPrefetchBytes, _MM_HINT_T0);
      }
      const auto wv = Op::load_w(wi);
      for (int j = 0; j < NB; ++j) Op::step(acc[i][j], wv, xv[j]);
    }
  }
  if (k < K) {
    typename Op::XV xv[NB];
    for (int j = 0; j < NB; ++j) xv[j] = Op::load_x(x + j * xs + k);
    for (int i = 0; i < NR; ++i) {
      const auto wv = Op::load_w_tail(w + i * K + k, K - k);
      for (int j = 0; j < NB; ++j) Op::step(acc[i][j], wv, xv[j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) y[j * ldy + i] = hsum(acc[i][j]);
}

// Rows [r, r1) for NB vectors: tiles of NR rows, then the remainder in tiles of NR/2, NR/4, ..,
// 1 rows. Since no output depends on its tile, any decomposition is valid; halving keeps the
// number of instantiated tiles small.
template <class Op, int NB, bool kPrefetch, int NR>
void row_tiles(const typename Op::WT* W, int64_t K, int64_t r, int64_t r1, const typename Op::XT* x,
               int64_t xs, float* y, int64_t ldy) {
  for (; r + NR <= r1; r += NR) tile<Op, NR, NB, kPrefetch>(W + r * K, K, x, xs, y + r, ldy);
  if constexpr (NR > 1) row_tiles<Op, NB, kPrefetch, NR / 2>(W, K, r, r1, x, xs, y, ldy);
}

// One batch tile of nv <= kTileVecs vectors over rows [r0, r1). kTall: this pass reads the
// weights from DRAM, so use the taller, prefetching tiles; otherwise they are in L2.
template <class Op, bool kTall>
void batch_tile(int nv, const typename Op::WT* W, int64_t K, int64_t r0, int64_t r1,
                const typename Op::XT* x, int64_t xs, float* y, int64_t ldy) {
  switch (nv) {
    case 1:
      row_tiles<Op, 1, kTall, kTall ? kGemvRows : kTileRows>(W, K, r0, r1, x, xs, y, ldy);
      break;
    case 2:
      row_tiles<Op, 2, kTall, kTall ? 8 : kTileRows>(W, K, r0, r1, x, xs, y, ldy);
      break;
    case 3:
      row_tiles<Op, 3, kTall, kTall ? 8 : kTileRows>(W, K, r0, r1, x, xs, y, ldy);
      break;
    default:
      row_tiles<Op, 4, kTall, kTileRows>(W, K, r0, r1, x, xs, y, ldy);
      break;
  }
}

template <class Op>
void matmul(const typename Op::WT* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
            int64_t ldx, float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || K <= 0) return;
  using XT = typename Op::XT;
  const int64_t xs = kpad<Op>(K);
  const int64_t chunk_rows = std::max<int64_t>(
      kTileRows,
      kRowChunkBytes / (K * static_cast<int64_t>(sizeof(typename Op::WT))) / kTileRows * kTileRows);
  for (int bs = 0; bs < B; bs += kBatchBlock) {
    const int nb = std::min(kBatchBlock, B - bs);
    XT* xb = static_cast<XT*>(t_scratch.get(static_cast<size_t>(nb * xs) * sizeof(XT)));
    for (int j = 0; j < nb; ++j) Op::pack_x(X + (bs + j) * ldx, K, xb + j * xs);
    float* yb = Y + bs * ldy;
    if (nb <= kTileVecs) {
      // Each weight is used by one tile only: stream all rows once.
      batch_tile<Op, true>(nb, W, K, r0, r1, xb, xs, yb, ldy);
      continue;
    }
    for (int64_t rc = r0; rc < r1; rc += chunk_rows) {
      const int64_t rce = std::min(r1, rc + chunk_rows);
      for (int j = 0; j < nb; j += kTileVecs) {
        const int nv = std::min(kTileVecs, nb - j);
        if (j == 0) {
          batch_tile<Op, true>(nv, W, K, rc, rce, xb, xs, yb, ldy);
        } else {
          batch_tile<Op, false>(nv, W, K, rc, rce, xb + j * xs, xs, yb + j * ldy, ldy);
        }
      }
    }
  }
}

}  // namespace

void matmul_bf16_avx512bf16(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                            int64_t ldx, float* Y, int64_t ldy, bool x_is_bf16) {
  if (x_is_bf16) {
    matmul<OpDpBf16>(W, K, r0, r1, X, B, ldx, Y, ldy);
  } else {
    matmul<OpF32FromBf16>(W, K, r0, r1, X, B, ldx, Y, ldy);
  }
}

void matmul_bf16_avx512(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                        int64_t ldx, float* Y, int64_t ldy) {
  matmul<OpF32FromBf16>(W, K, r0, r1, X, B, ldx, Y, ldy);
}

void matmul_f32_avx512(const float* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                       int64_t ldx, float* Y, int64_t ldy) {
  matmul<OpF32>(W, K, r0, r1, X, B, ldx, Y, ldy);
}

}  // namespace md::cpu::detail
