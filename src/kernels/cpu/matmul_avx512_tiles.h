// The AVX-512 matmul tiling shared by matmul_avx512.cpp (fp32-FMA kernels, AVX-512 F/BW/VL/DQ)
// and matmul_avx512bf16.cpp (vdpbf16ps), which differ only in their Op (format + one step).
// Everything here has internal linkage (an unnamed namespace): each of the two files compiles its
// own copy with its own ISA flags, so the linker can never hand the BF16-compiled copy of a helper
// to the file that runs on CPUs without BF16. Include from those two files only.
//
// Every output element Y[b, r] gets one zmm accumulator (16 fp32 lanes) that walks K in 64-byte
// weight chunks in order, then a fixed pairwise reduction of its lanes. Register tiles of several
// rows x several vectors only share loads between those sequences, never mix them, so a result
// is the same whatever tile, row range, batch size or thread produced it.
#pragma once

#include "avx512_common.h"

#include <algorithm>
#include <bit>
#include <cstdint>

#include "batch_walk.h"
#include "isa_scratch.h"
#include "megadecode/base/bf16.h"
#include "tile_prefetch.h"

namespace md::cpu::detail {
namespace {

// Per-thread buffer for the converted activations (a few MB at most since batches are converted
// in blocks of kBatchBlock vectors).
thread_local IsaScratch t_scratch;

// Vectors converted per block: bounds the scratch size while still reusing each weight tile for
// up to this many vectors.
constexpr int kBatchBlock = 64;
// Weight bytes per row chunk when B > 1: the chunk stays in L2 (2 MB per core on the target)
// while every batch tile passes over it, so each weight byte comes from DRAM once per call.
constexpr int64_t kRowChunkBytes = 256 << 10;
// GEMV (B = 1): 16 rows at once (16 independent accumulator chains), the weights streamed into L2
// a tile ahead (tile_prefetch.h).
constexpr int kGemvRows = 16;
// B > 1: a 4 rows x 4 vectors register tile (16 accumulators, each weight load feeding 4
// vectors) over row chunks, batch tiles outer, so a chunk comes from DRAM on the first batch
// tile (prefetched like the GEMV: ~1.2x at B = 2..4) and from L2 for the others. For B <= 4 there
// is a single batch tile, and taller tiles (8 rows for 2-3 vectors) keep more rows in flight.
constexpr int kTileRows = 4;
constexpr int kTileVecs = 4;

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
  const TilePrefetch<NR, 64> pf(w, K * int64_t(sizeof(*w)));
  for (; k < kfull; k += Op::kChunk) {
    if constexpr (kPrefetch) pf.step(k / Op::kChunk);
    typename Op::XV xv[NB];
    for (int j = 0; j < NB; ++j) xv[j] = Op::load_x(x + j * xs + k);
    for (int i = 0; i < NR; ++i) {
      const typename Op::WT* wi = w + i * K + k;
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
    walk_batch<kTileVecs>(nb, r0, r1, chunk_rows,
                          [&](auto tall, int j, int nv, int64_t rc, int64_t rce) {
                            batch_tile<Op, decltype(tall)::value>(nv, W, K, rc, rce, xb + j * xs,
                                                                  xs, yb + j * ldy, ldy);
                          });
  }
}

}  // namespace
}  // namespace md::cpu::detail
