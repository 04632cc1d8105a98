// AVX2 + FMA kernel of the 4-bit formats (q4_kernels.h: MXFP4 and int4; compiled with -mavx2
// -mfma only; entered at the avx2 level). The AVX-512 kernel's scheme (q4_avx512.cpp) at half the
// width:
//
// A chunk is 2 groups = 64 columns = 32 packed bytes of a row (one ymm load). Dword d of the chunk
// holds the 8 codes of columns 8d..8d+7 (nibble s = column 8d + s). Decode step s shifts the
// register right by 4s and decodes the low 4 bits of each dword (MXFP4: the low 3 bits, the
// magnitude, through an 8-entry table with vpermps, and bit 3, the sign, moved to bit 31 with a
// shift; int4: arithmetically, see Int4Fmt): lane d = the code value of column 8d + s. The
// activations are repacked once per call into the same order. Lane d only sees columns of group
// 2c + d/4 of chunk c. Each output Y[b, r] has one ymm accumulator that walks the chunks in order:
//   g   = fma(w[8d+7], x[8d+7], ... fma(w[8d+1], x[8d+1], w[8d] * x[8d]))   [unscaled code values]
//   acc = fma(g, scale, acc)    with lane d of scale = the scale of sub-group 2c + d/4
// then a fixed pairwise reduction of its 8 lanes. When K / 32 is odd the last chunk has one
// group: its missing bytes load as zero, its missing activations are packed as zero and its
// missing scale is zero, so it adds exact zeros. Tiles only share loads and decodes between these
// sequences, so results do not depend on the tile, row range, batch size or thread.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "avx2_common.h"
#include "batch_walk.h"
#include "isa_scratch.h"
#include "megadecode/base/bf16.h"
#include "q4_kernels.h"
#include "tile_prefetch.h"

namespace md::cpu::detail {
namespace {

thread_local IsaScratch t_xscratch;
thread_local SubgroupMap t_map;  // the int4 sub-group -> group table (isa_scratch.h)

constexpr int64_t kChunkCols = 64;             // 2 groups, 32 packed bytes per row
constexpr int kSteps = 8;                      // decode steps per chunk (nibbles per dword)
constexpr int kBatchBlock = 64;                // vectors repacked per block (bounds the scratch)
constexpr int64_t kRowChunkBytes = 256 << 10;  // B > 4: packed bytes kept in L2 per row chunk
constexpr int kTileVecs = 4;

// 64 columns from x (fewer at the end of the row: zero filled) into chunk order.
void pack_x(const float* x, int64_t K, float* out) {
  for (int64_t c = 0; c < K; c += kChunkCols) {
    const int64_t n = std::min(kChunkCols, K - c);
    float* o = out + c;
    for (int s = 0; s < kSteps; ++s)
      for (int d = 0; d < 8; ++d) o[s * 8 + d] = 8 * d + s < n ? x[c + 8 * d + s] : 0.0f;
  }
}

// The formats' decode and scales, kept apart from the tiling:
//   decode  step s's 8 unscaled weights (lane d = column 8d + s) from a chunk's packed bytes
//   chunk   chunk c's scales: lanes 0-3 sub-group 2c = g, lanes 4-7 sub-group g + 1 (zero when
//           that sub-group is absent); map is the int4 sub-group -> group table
struct E2m1Fmt {
  static __m256 decode(__m256i p, int s) {
    const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i t = s == 0 ? p : _mm256_srli_epi32(p, 4 * s);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(t, 28), _mm256_set1_epi32(INT32_MIN));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, t), _mm256_castsi256_ps(sign));
  }
  static __m256 chunk(const uint8_t* s, const int32_t*, int64_t g, bool two) {
    const __m128 lo = _mm_set1_ps(kMxfp4ScaleTable[s[g]]);
    const __m128 hi = two ? _mm_set1_ps(kMxfp4ScaleTable[s[g + 1]]) : _mm_setzero_ps();
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
  }
};

struct Int4Fmt {
  // Arithmetic, not a table: code c ^ 8 read as a signed 4-bit integer is c - 8 (0 -> -8, 7 -> -1,
  // 8 -> 0, 15 -> 7), so nibble s moved to the top of its dword and shifted back arithmetically
  // is the value, which converts exactly. Three operations per 8 weights (the xor is shared by a
  // chunk's 8 steps) against two vpermps, a blend and two shifts for the tables: the same values,
  // so the same results bit for bit (bench/RESULTS.md, "int4 on this AVX2 host").
  static __m256 decode(__m256i p, int s) {
    const __m256i t = _mm256_xor_si256(p, _mm256_set1_epi32(int32_t(0x88888888u)));
    const __m256i top = s == 7 ? t : _mm256_slli_epi32(t, 28 - 4 * s);
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(top, 28));
  }
  static __m256 chunk(const uint8_t* s, const int32_t* map, int64_t g, bool two) {
    const bf16* sc = reinterpret_cast<const bf16*>(s);
    const __m128 lo = _mm_set1_ps(bf16_to_f32(sc[map[g]]));
    const __m128 hi = two ? _mm_set1_ps(bf16_to_f32(sc[map[g + 1]])) : _mm_setzero_ps();
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
  }
};

// One call's matrix as the tiles see it.
struct Mat4 {
  const uint8_t* P;
  const uint8_t* S;
  int64_t sb;          // scale bytes per row
  const int32_t* map;  // sub-group -> group (int4)
  int64_t K;
};

// NR rows (packed at w, row stride rb; scales at sc, sb bytes per row) x NB repacked vectors at
// x (stride xs): y[j * ldy + i].
template <class F, int NR, int NB, bool kPrefetch>
void tile(const uint8_t* w, const uint8_t* sc, int64_t sb, const int32_t* map, int64_t K,
          const float* x, int64_t xs, float* y, int64_t ldy) {
  const int64_t G = K / 32, rb = K / 2;
  __m256 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  const TilePrefetch<NR, 32> pf(w, rb);
  for (int64_t g = 0; g < G; g += 2) {
    const bool two = g + 1 < G;
    const uint8_t* wc = w + g * 16;
    if constexpr (kPrefetch) pf.step(g / 2);
    __m256i p[NR];
    for (int i = 0; i < NR; ++i) {
      const uint8_t* wi = wc + i * rb;
      p[i] =
          two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi))
              : _mm256_inserti128_si256(_mm256_setzero_si256(),
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(wi)), 0);
    }
    // Step 0 starts each chain with a product, the others add to it.
    __m256 gs[NR][NB];
    for (int i = 0; i < NR; ++i) {
      const __m256 wv = F::decode(p[i], 0);
      for (int j = 0; j < NB; ++j) gs[i][j] = _mm256_mul_ps(wv, _mm256_load_ps(x + j * xs + g * 32));
    }
    for (int s = 1; s < kSteps; ++s) {
      __m256 xv[NB];
      for (int j = 0; j < NB; ++j) xv[j] = _mm256_load_ps(x + j * xs + g * 32 + s * 8);
      for (int i = 0; i < NR; ++i) {
        const __m256 wv = F::decode(p[i], s);
        for (int j = 0; j < NB; ++j) gs[i][j] = _mm256_fmadd_ps(wv, xv[j], gs[i][j]);
      }
    }
    for (int i = 0; i < NR; ++i) {
      const __m256 scv = F::chunk(sc + i * sb, map, g, two);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(gs[i][j], scv, acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) y[j * ldy + i] = hsum(acc[i][j]);
}

// Rows [r, r1): tiles of NR rows, then the rest in tiles of NR/2, .., 1.
template <class F, int NB, bool kPrefetch, int NR>
void row_tiles(const Mat4& m, int64_t r, int64_t r1, const float* x, int64_t xs, float* y,
               int64_t ldy) {
  const int64_t rb = m.K / 2;
  for (; r + NR <= r1; r += NR)
    tile<F, NR, NB, kPrefetch>(m.P + r * rb, m.S + r * m.sb, m.sb, m.map, m.K, x, xs, y + r, ldy);
  if constexpr (NR > 1) row_tiles<F, NB, kPrefetch, NR / 2>(m, r, r1, x, xs, y, ldy);
}

// Tile heights for the 16 ymm registers (packed rows, NR x NB chain sums, the vectors' X).
template <class F, bool kTall>
void batch_tile(int nv, const Mat4& m, int64_t r0, int64_t r1, const float* x, int64_t xs, float* y,
                int64_t ldy) {
  switch (nv) {
    case 1:
      row_tiles<F, 1, kTall, 4>(m, r0, r1, x, xs, y, ldy);
      break;
    case 2:
      row_tiles<F, 2, kTall, 2>(m, r0, r1, x, xs, y, ldy);
      break;
    case 3:
      row_tiles<F, 3, kTall, 2>(m, r0, r1, x, xs, y, ldy);
      break;
    default:
      row_tiles<F, 4, kTall, 2>(m, r0, r1, x, xs, y, ldy);
      break;
  }
}

template <class F>
void matmul(const Mat4& m, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx, float* Y,
            int64_t ldy) {
  const int64_t K = m.K;
  const int64_t xs = (K + kChunkCols - 1) / kChunkCols * kChunkCols;
  const int64_t row_bytes = K / 2 + m.sb;
  const int64_t chunk_rows = std::max<int64_t>(4, kRowChunkBytes / row_bytes / 4 * 4);
  for (int bs = 0; bs < B; bs += kBatchBlock) {
    const int nb = std::min(kBatchBlock, B - bs);
    float* xb = static_cast<float*>(t_xscratch.get(static_cast<size_t>(nb * xs) * sizeof(float)));
    for (int j = 0; j < nb; ++j) pack_x(X + (bs + j) * ldx, K, xb + j * xs);
    float* yb = Y + bs * ldy;
    walk_batch<kTileVecs>(
        nb, r0, r1, chunk_rows, [&](auto tall, int j, int nv, int64_t rc, int64_t rce) {
          batch_tile<F, decltype(tall)::value>(nv, m, rc, rce, xb + j * xs, xs, yb + j * ldy, ldy);
        });
  }
}

}  // namespace

void matmul_q4_avx2(const Q4Matrix& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
                    float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || w.K < 32) return;
  Mat4 m{w.packed, w.scales, w.scale_row_bytes(), nullptr, w.K};
  if (w.codes == Q4Codes::kE2m1) {
    matmul<E2m1Fmt>(m, r0, r1, X, B, ldx, Y, ldy);
    return;
  }
  const int64_t G = w.K / 32;
  m.map = t_map.get(G, w.group);
  matmul<Int4Fmt>(m, r0, r1, X, B, ldx, Y, ldy);
}

}  // namespace md::cpu::detail
