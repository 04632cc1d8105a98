// AVX-512 kernel of the 4-bit formats (q4_kernels.h: MXFP4 and int4). Compiled for the avx512
// level (AVX-512 F/BW/VL/DQ, CMakeLists.txt), which mxfp4.cpp / int4.cpp check (cpu_features.h)
// before entering; it serves the avx512bf16 level too. No BF16
// instruction: it is one fp32-FMA kernel for both X modes, because vdpbf16ps (32 multiply-adds)
// sustains one per ~2.1-2.3 cycles against two fp32 FMAs (16 each) per cycle, on Zen 4 and on
// Emerald Rapids alike (session 24: 0.72 ns against 0.17 ns an instruction at ~2.9 GHz, 12
// independent chains), so it would be no faster at B = 1 and up to ~1.5x slower for batches
// (and the kernel may not depend on B). A bf16 decode of the nibbles (vpermw) would not help.
//
// Weights are decoded a chunk at a time: 4 groups = 128 columns = 64 packed bytes of a row, one
// zmm load (one cache line). No byte widening: dword d of the chunk holds the 8 codes of columns
// 8d..8d+7 (nibble s = column 8d + s), vpermps reads the low 4 bits of each dword as an index into
// the 16 code values (the format's table), and shifting the whole register right by 4s brings
// nibble s to the bottom. So decode step s (one shift, one vpermps) gives column 8d + s in lane d,
// and the activations are repacked once per call into the same order (register s of a chunk: lane d
// = x[8d + s]). Lane d only ever sees columns 8d..8d+7 of a chunk, all in its group 4c + d/4. Each
// output Y[b, r] has one zmm accumulator that walks the chunks in order:
//   g   = fma(w[8d+7], x[8d+7], ... fma(w[8d+1], x[8d+1], w[8d] * x[8d]))   [unscaled code values]
//   acc = fma(g, scale, acc)    with lane d of scale = the scale of sub-group 4c + d/4
// (MXFP4: 2^(s - 127) of that group; int4: the bf16 scale of the group that holds those columns).
// and ends with a fixed pairwise reduction of its 16 lanes. When K is not a multiple of 128 the
// last chunk is partial: its missing bytes load as zero, its missing activations are packed as
// zero, and the accumulation is masked to the lanes of groups that exist. Per 16 weights that is
// one shift, one vpermps and one FMA per vector, plus per chunk one vpermps and one FMA for the
// scale (the old group-at-a-time decode spent ~7 uops per 32 weights). Register tiles of several
// rows x several vectors only share loads and decodes between these sequences, never mix them, so
// a result is the same whatever tile, row range, batch size or thread produced it.

#include "avx512_common.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "batch_walk.h"
#include "isa_scratch.h"
#include "q4_kernels.h"
#include "tile_prefetch.h"

namespace md::cpu::detail {
namespace {

// Per-thread buffer for the repacked activations.
thread_local IsaScratch t_xscratch;
thread_local SubgroupMap t_map;  // the int4 sub-group -> group table (isa_scratch.h)

constexpr int64_t kChunkCols = 128;  // 4 groups, 64 packed bytes per row
constexpr int kBlockGroups = 16;     // groups whose scales are decoded together (one zmm)
// Vectors repacked per block (bounds the scratch size).
constexpr int kBatchBlock = 64;
// B > 4: packed bytes per row chunk, kept in L2 while every batch tile passes over it.
constexpr int64_t kRowChunkBytes = 256 << 10;
constexpr int kTileRows = 4;
constexpr int kTileVecs = 4;

// The scales of a block of n <= 16 consecutive 32-column sub-groups g.., one lane per sub-group:
// the formats' scale decode, kept apart from the tiling. `prepare` runs once per block for all the
// rows of a tile (it depends only on the columns), `row` once per row.
struct E2m1Scales : E8m0Scales {  // (the scale decode: avx512_common.h)
  static constexpr Q4Codes kCodes = Q4Codes::kE2m1;
  static __m512 lut() {
    return _mm512_set_ps(-6.0f, -4.0f, -3.0f, -2.0f, -1.5f, -1.0f, -0.5f, -0.0f, 6.0f, 4.0f, 3.0f,
                         2.0f, 1.5f, 1.0f, 0.5f, 0.0f);
  }
};

// int4: the bf16 group scales (avx512_common.h).
struct Int4Scales : GroupScales {
  static constexpr Q4Codes kCodes = Q4Codes::kInt4;
  static __m512 lut() {
    return _mm512_set_ps(7.0f, 6.0f, 5.0f, 4.0f, 3.0f, 2.0f, 1.0f, 0.0f, -1.0f, -2.0f, -3.0f, -4.0f,
                         -5.0f, -6.0f, -7.0f, -8.0f);
  }
};

// Lane i -> lane 4c + i/4 of a block's scale vector: the scales of chunk c's lanes.
inline __m512i chunk_scale_index(int c) {
  return _mm512_add_epi32(_mm512_set1_epi32(4 * c),
                          _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
}

// The kernel's activation format and decode, kept apart from the tiling:
//   pack_x   writes ceil(K / 128) chunks of 128 fp32 in the decoded order (zero past K)
//   load_x   decode step s's 16 activations of a chunk
//   decode   decode step s's 16 weights (unscaled code values, table lut) from the chunk's 64 bytes
//   madd     step s of the per-lane product chain (a plain multiply for s = 0)
struct OpFma {
  using XT = float;
  static constexpr int kGemvRows = 8;
  static constexpr int kSteps = 8;
  using XV = __m512;
  using WV = __m512;
  static void pack_x(const float* x, int64_t K, XT* out) {
    for (int64_t c = 0; c < K; c += kChunkCols) {
      const int64_t n = std::min(kChunkCols, K - c);
      XT* o = out + c;
      for (int s = 0; s < 8; ++s)
        for (int d = 0; d < 16; ++d) o[s * 16 + d] = 8 * d + s < n ? x[c + 8 * d + s] : 0.0f;
    }
  }
  static XV load_x(const XT* p, int s) { return _mm512_load_ps(p + 16 * s); }
  static WV decode(__m512i p, int s, __m512 lut) {
    return _mm512_permutexvar_ps(s == 0 ? p : _mm512_srli_epi32(p, 4 * s), lut);
  }
  static __m512 madd(int s, __m512 g, WV w, XV x) {
    return s == 0 ? _mm512_mul_ps(w, x) : _mm512_fmadd_ps(w, x, g);
  }
};

// One chunk for an NR x NB register tile. w points at the chunk's packed bytes of the first row
// (row stride rb), x at its repacked activations (vector stride xs); sv holds each row's scales
// for the block, sidx selects the chunk's lanes. kMasked: a partial chunk (bytes / lanes masks).
// The loop runs over the Op's decode steps outermost, so only one step's activations and decoded
// weights are live at a time (no spills for the batch tiles).
template <class Op, int NR, int NB, bool kMasked>
inline void chunk_step(__m512 (&acc)[NR][NB], const __m512 (&sv)[NR], __m512i sidx, __m512 lut,
                       const uint8_t* w, int64_t rb, const typename Op::XT* x, int64_t xs,
                       __mmask64 bytes, __mmask16 lanes) {
  if constexpr (NB == 1) {
    // One vector: rows outermost, each row's chain is independent of the next (out-of-order
    // execution overlaps them); the chunk's activations stay in registers.
    typename Op::XV xv[Op::kSteps];
    for (int s = 0; s < Op::kSteps; ++s) xv[s] = Op::load_x(x, s);
    for (int i = 0; i < NR; ++i) {
      const __m512i p =
          kMasked ? _mm512_maskz_loadu_epi8(bytes, w + i * rb) : _mm512_loadu_si512(w + i * rb);
      __m512 g = _mm512_setzero_ps();
      for (int s = 0; s < Op::kSteps; ++s) g = Op::madd(s, g, Op::decode(p, s, lut), xv[s]);
      const __m512 sc = _mm512_permutexvar_ps(sidx, sv[i]);
      if constexpr (kMasked) {
        acc[i][0] = _mm512_mask3_fmadd_ps(g, sc, acc[i][0], lanes);
      } else {
        acc[i][0] = _mm512_fmadd_ps(g, sc, acc[i][0]);
      }
    }
    return;
  }
  __m512i p[NR];
  for (int i = 0; i < NR; ++i)
    p[i] = kMasked ? _mm512_maskz_loadu_epi8(bytes, w + i * rb) : _mm512_loadu_si512(w + i * rb);
  __m512 g[NR][NB];
  for (int s = 0; s < Op::kSteps; ++s) {
    typename Op::XV xv[NB];
    for (int j = 0; j < NB; ++j) xv[j] = Op::load_x(x + j * xs, s);
    for (int i = 0; i < NR; ++i) {
      const typename Op::WV wv = Op::decode(p[i], s, lut);
      for (int j = 0; j < NB; ++j) g[i][j] = Op::madd(s, g[i][j], wv, xv[j]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    const __m512 sc = _mm512_permutexvar_ps(sidx, sv[i]);
    for (int j = 0; j < NB; ++j) {
      if constexpr (kMasked) {
        acc[i][j] = _mm512_mask3_fmadd_ps(g[i][j], sc, acc[i][j], lanes);
      } else {
        acc[i][j] = _mm512_fmadd_ps(g[i][j], sc, acc[i][j]);
      }
    }
  }
}

// NR consecutive rows (packed at w, scales at s, sb bytes per row) times NB repacked vectors at x
// (stride xs); writes y[j * ldy + i] for row i, vector j. map: the sub-group -> group table (int4).
template <class Op, class Sc, int NR, int NB, bool kPrefetch>
void tile(const uint8_t* w, const uint8_t* s, int64_t sb, const int32_t* map, int64_t K,
          const typename Op::XT* x, int64_t xs, float* y, int64_t ldy) {
  const int64_t G = K / 32, rb = K / 2;
  const __m512 lut = Sc::lut();
  __m512 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  __m512 sv[NR];
  const TilePrefetch<NR, 64> pf(w, rb);
  int64_t g = 0;
  for (; g + kBlockGroups <= G; g += kBlockGroups) {  // 4 whole chunks
    const typename Sc::Block blk = Sc::prepare(map, g, kBlockGroups);
    for (int i = 0; i < NR; ++i) sv[i] = Sc::row(s + i * sb, blk);
    for (int c = 0; c < 4; ++c) {
      const uint8_t* wc = w + (g + 4 * c) * 16;
      if constexpr (kPrefetch) pf.step(g / 4 + c);
      chunk_step<Op, NR, NB, false>(acc, sv, chunk_scale_index(c), lut, wc, rb,
                                    x + (g + 4 * c) * 32, xs, 0, 0);
    }
  }
  if (g < G) {  // 1..15 sub-groups left: masked loads, partial last chunk
    const int ng = static_cast<int>(G - g);
    const typename Sc::Block blk = Sc::prepare(map, g, ng);
    for (int i = 0; i < NR; ++i) sv[i] = Sc::row(s + i * sb, blk);
    for (int c = 0; 4 * c < ng; ++c) {
      const int t = std::min(4, ng - 4 * c);  // sub-groups in this chunk
      const __mmask64 bytes = t == 4 ? ~__mmask64{0} : (__mmask64{1} << (16 * t)) - 1;
      const __mmask16 lanes = static_cast<__mmask16>((1u << (4 * t)) - 1);
      chunk_step<Op, NR, NB, true>(acc, sv, chunk_scale_index(c), lut, w + (g + 4 * c) * 16, rb,
                                   x + (g + 4 * c) * 32, xs, bytes, lanes);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) y[j * ldy + i] = hsum(acc[i][j]);
}

// One call's matrix as the tiles see it.
struct Mat4 {
  const uint8_t* P;
  const uint8_t* S;
  int64_t sb;          // scale bytes per row
  const int32_t* map;  // sub-group -> group (int4)
  int64_t K;
};

// Rows [r, r1) for NB vectors: tiles of NR rows, then the rest in tiles of NR/2, NR/4, .., 1.
template <class Op, class Sc, int NB, bool kPrefetch, int NR>
void row_tiles(const Mat4& m, int64_t r, int64_t r1, const typename Op::XT* x, int64_t xs, float* y,
               int64_t ldy) {
  const int64_t rb = m.K / 2;
  for (; r + NR <= r1; r += NR)
    tile<Op, Sc, NR, NB, kPrefetch>(m.P + r * rb, m.S + r * m.sb, m.sb, m.map, m.K, x, xs, y + r,
                                    ldy);
  if constexpr (NR > 1) row_tiles<Op, Sc, NB, kPrefetch, NR / 2>(m, r, r1, x, xs, y, ldy);
}

// Rows per tile for NB vectors, sized to fit the 32 zmm registers without spills in the chunk
// loop; kTall (the pass that streams from DRAM) gives a GEMV more concurrent row streams.
template <class Op, int NB, bool kTall>
constexpr int tile_rows() {
  if constexpr (NB == 1) return kTall ? Op::kGemvRows : 4;
  return NB == 2 ? 4 : 2;
}

// One batch tile of nv <= kTileVecs vectors over rows [r0, r1). kTall: this pass reads the
// weights from DRAM, so use the taller, prefetching tiles.
template <class Op, class Sc, bool kTall>
void batch_tile(int nv, const Mat4& m, int64_t r0, int64_t r1, const typename Op::XT* x, int64_t xs,
                float* y, int64_t ldy) {
  switch (nv) {
    case 1:
      row_tiles<Op, Sc, 1, kTall, tile_rows<Op, 1, kTall>()>(m, r0, r1, x, xs, y, ldy);
      break;
    case 2:
      row_tiles<Op, Sc, 2, kTall, tile_rows<Op, 2, kTall>()>(m, r0, r1, x, xs, y, ldy);
      break;
    case 3:
      row_tiles<Op, Sc, 3, kTall, tile_rows<Op, 3, kTall>()>(m, r0, r1, x, xs, y, ldy);
      break;
    default:
      row_tiles<Op, Sc, 4, kTall, tile_rows<Op, 4, kTall>()>(m, r0, r1, x, xs, y, ldy);
      break;
  }
}

template <class Op, class Sc>
void matmul(const Mat4& m, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx, float* Y,
            int64_t ldy) {
  using XT = typename Op::XT;
  const int64_t K = m.K;
  // Whole chunks (zero padded): rows of the repacked block stay 64-byte aligned.
  const int64_t xs = (K + kChunkCols - 1) / kChunkCols * kChunkCols;
  const int64_t row_bytes = K / 2 + m.sb;
  const int64_t chunk_rows =
      std::max<int64_t>(kTileRows, kRowChunkBytes / row_bytes / kTileRows * kTileRows);
  for (int bs = 0; bs < B; bs += kBatchBlock) {
    const int nb = std::min(kBatchBlock, B - bs);
    XT* xb = static_cast<XT*>(t_xscratch.get(static_cast<size_t>(nb * xs) * sizeof(XT)));
    for (int j = 0; j < nb; ++j) Op::pack_x(X + (bs + j) * ldx, K, xb + j * xs);
    float* yb = Y + bs * ldy;
    walk_batch<kTileVecs>(nb, r0, r1, chunk_rows,
                          [&](auto tall, int j, int nv, int64_t rc, int64_t rce) {
                            batch_tile<Op, Sc, decltype(tall)::value>(nv, m, rc, rce, xb + j * xs,
                                                                      xs, yb + j * ldy, ldy);
                          });
  }
}

}  // namespace

void matmul_q4_avx512(const Q4Matrix& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
                      float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || w.K < 32) return;
  Mat4 m{w.packed, w.scales, w.scale_row_bytes(), nullptr, w.K};
  if (w.codes == Q4Codes::kE2m1) {
    matmul<OpFma, E2m1Scales>(m, r0, r1, X, B, ldx, Y, ldy);
    return;
  }
  const int64_t G = w.K / 32;
  m.map = t_map.get(G, w.group);
  matmul<OpFma, Int4Scales>(m, r0, r1, X, B, ldx, Y, ldy);
}

}  // namespace md::cpu::detail
