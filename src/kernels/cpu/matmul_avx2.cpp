// AVX2 + FMA matmul kernels (compiled with -mavx2 -mfma only; entered at the avx2 level): the fast
// path for x86-64 CPUs without AVX-512 (e.g. AMD Zen 2/3, Intel client cores).
//
// The structure follows matmul_avx512.cpp at half the width. Every output Y[b, r] has one ymm
// accumulator (8 fp32 lanes) that walks K in 32-byte weight chunks in order, then a fixed pairwise
// reduction of its lanes; register tiles of several rows x vectors only share loads between those
// sequences, so a result does not depend on the tile, row range, batch size or thread.
//  * bf16 weights: a chunk is 16 weights; lane i accumulates w[2i] x[2i], then w[2i+1] x[2i+1],
//    each as an FMA. A bf16 is the top half of an fp32, so the even weights widen with one shift
//    and the odd ones with one mask; X is repacked once per call to match (8 even, then 8 odd
//    elements per chunk). X is always used in full fp32 (AVX2 has no bf16 dot product), so
//    x_is_bf16 does not matter here.
//  * fp32 weights: a chunk is 8 weights; lane i accumulates element i of each chunk.
// The last, partial chunk reads only the K - k remaining weights (zero-filled beyond), and the
// repacked X is zero there, so it adds exact zeros.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "avx2_common.h"
#include "batch_walk.h"
#include "isa_scratch.h"
#include "megadecode/kernels/cpu/matmul.h"
#include "tile_prefetch.h"

namespace md::cpu::detail {
namespace {

thread_local IsaScratch t_scratch;

constexpr int kBatchBlock = 64;                // vectors repacked per block (bounds the scratch)
constexpr int64_t kRowChunkBytes = 256 << 10;  // B > 4: weight bytes kept in L2 per row chunk
// GEMV prefetch (the kTall tiles): tile_prefetch.h.
constexpr int kTileVecs = 4;

struct OpBf16 {
  using WT = bf16;
  struct XV {
    __m256 even, odd;
  };
  using WV = __m256i;
  static constexpr int kChunk = 16;
  static void pack_x(const float* x, int64_t K, float* out) {
    for (int64_t k = 0; k < K; k += kChunk) {
      for (int i = 0; i < 8; ++i) {
        out[k + i] = k + 2 * i < K ? x[k + 2 * i] : 0.0f;
        out[k + 8 + i] = k + 2 * i + 1 < K ? x[k + 2 * i + 1] : 0.0f;
      }
    }
  }
  static XV load_x(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
  static WV load_w(const WT* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static WV load_w_tail(const WT* p, int64_t n) {
    alignas(32) bf16 buf[kChunk] = {};
    std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(bf16));
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
  }
  static void step(__m256& acc, WV w, const XV& x) {
    const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536)));
    acc = _mm256_fmadd_ps(we, x.even, acc);
    acc = _mm256_fmadd_ps(wo, x.odd, acc);
  }
};

struct OpF32 {
  using WT = float;
  using XV = __m256;
  using WV = __m256;
  static constexpr int kChunk = 8;
  static void pack_x(const float* x, int64_t K, float* out) {
    const int64_t kp = (K + kChunk - 1) / kChunk * kChunk;
    std::memcpy(out, x, static_cast<size_t>(K) * sizeof(float));
    std::fill(out + K, out + kp, 0.0f);
  }
  static XV load_x(const float* p) { return _mm256_load_ps(p); }
  static WV load_w(const WT* p) { return _mm256_loadu_ps(p); }
  static WV load_w_tail(const WT* p, int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
    return _mm256_maskload_ps(p, mask);
  }
  static void step(__m256& acc, WV w, const XV& x) { acc = _mm256_fmadd_ps(w, x, acc); }
};

template <class Op>
int64_t kpad(int64_t K) {
  return (K + Op::kChunk - 1) / Op::kChunk * Op::kChunk;
}

// NR rows at w (row stride K) x NB repacked vectors at x (stride xs): y[j * ldy + i].
template <class Op, int NR, int NB, bool kPrefetch>
void tile(const typename Op::WT* w, int64_t K, const float* x, int64_t xs, float* y, int64_t ldy) {
  using WT = typename Op::WT;
  __m256 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t kfull = K / Op::kChunk * Op::kChunk;
  const TilePrefetch<NR, Op::kChunk * int(sizeof(WT))> pf(w, K * int64_t(sizeof(WT)));
  int64_t k = 0;
  for (; k < kfull; k += Op::kChunk) {
    if constexpr (kPrefetch) pf.step(k / Op::kChunk);
    typename Op::XV xv[NB];
    for (int j = 0; j < NB; ++j) xv[j] = Op::load_x(x + j * xs + k);
    for (int i = 0; i < NR; ++i) {
      const auto wv = Op::load_w(w + i * K + k);
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

// Rows [r, r1): tiles of NR rows, then the rest in tiles of NR/2, NR/4, .., 1.
template <class Op, int NB, bool kPrefetch, int NR>
void row_tiles(const typename Op::WT* W, int64_t K, int64_t r, int64_t r1, const float* x,
               int64_t xs, float* y, int64_t ldy) {
  for (; r + NR <= r1; r += NR) tile<Op, NR, NB, kPrefetch>(W + r * K, K, x, xs, y + r, ldy);
  if constexpr (NR > 1) row_tiles<Op, NB, kPrefetch, NR / 2>(W, K, r, r1, x, xs, y, ldy);
}

// One batch tile of nv <= kTileVecs vectors. Tile heights fit the 16 ymm registers (NR x NB
// accumulators, the vectors' X, two weight temporaries); kTall: the pass that streams weights
// from DRAM, which prefetches and gives a GEMV more concurrent row streams.
template <class Op, bool kTall>
void batch_tile(int nv, const typename Op::WT* W, int64_t K, int64_t r0, int64_t r1, const float* x,
                int64_t xs, float* y, int64_t ldy) {
  switch (nv) {
    case 1:
      row_tiles<Op, 1, kTall, kTall ? 8 : 4>(W, K, r0, r1, x, xs, y, ldy);
      break;
    case 2:
      row_tiles<Op, 2, kTall, 4>(W, K, r0, r1, x, xs, y, ldy);
      break;
    case 3:
      row_tiles<Op, 3, kTall, 2>(W, K, r0, r1, x, xs, y, ldy);
      break;
    default:
      row_tiles<Op, 4, kTall, 2>(W, K, r0, r1, x, xs, y, ldy);
      break;
  }
}

template <class Op>
void matmul(const typename Op::WT* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
            int64_t ldx, float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || K <= 0) return;
  const int64_t xs = kpad<Op>(K);
  const int64_t chunk_rows = std::max<int64_t>(
      4, kRowChunkBytes / (K * static_cast<int64_t>(sizeof(typename Op::WT))) / 4 * 4);
  for (int bs = 0; bs < B; bs += kBatchBlock) {
    const int nb = std::min(kBatchBlock, B - bs);
    float* xb = static_cast<float*>(t_scratch.get(static_cast<size_t>(nb * xs) * sizeof(float)));
    for (int j = 0; j < nb; ++j) Op::pack_x(X + (bs + j) * ldx, K, xb + j * xs);
    float* yb = Y + bs * ldy;
    walk_batch<kTileVecs>(nb, r0, r1, chunk_rows,
                          [&](auto tall, int j, int nv, int64_t rc, int64_t rce) {
                            batch_tile<Op, decltype(tall)::value>(nv, W, K, rc, rce, xb + j * xs,
                                                                  xs, yb + j * ldy, ldy);
                          });
  }
}

}  // namespace

void matmul_bf16_avx2(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                      int64_t ldx, float* Y, int64_t ldy) {
  matmul<OpBf16>(W, K, r0, r1, X, B, ldx, Y, ldy);
}

void matmul_f32_avx2(const float* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                     int64_t ldx, float* Y, int64_t ldy) {
  matmul<OpF32>(W, K, r0, r1, X, B, ldx, Y, ldy);
}

}  // namespace md::cpu::detail
