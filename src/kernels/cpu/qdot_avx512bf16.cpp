// AVX-512 VNNI kernel of the integer dot products (qdot.h: int4 or int8 weights times int8
// activations). Compiled for the avx512bf16 level, which includes VNNI (cpu_features.h).
//
// vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products to an int32 lane:
// 64 multiply-adds per instruction, exact. The weights are the unsigned operand as stored: int8
// codes c = q + 128, int4 nibbles c = q + 8. The activations t are the signed one. So a lane's sum
// is sum (q + o) t = sum q t + o sum t (o = 128 or 8), and the lane starts from -o sum t instead of
// zero (the correction, one int32 vector per chunk of the packed activations, shared by all rows).
//
// A row is read in chunks of 64 bytes (one cache line; one zmm load):
//  * int4: 128 columns. Byte b holds columns 2b (low nibble) and 2b + 1 (high nibble), so
//    and 0x0F gives the even columns' codes and (>> 4) & 0x0F the odd ones', each in byte order:
//    two vpdpbusd against the activations of the even and of the odd columns (packed once per
//    call in that order). Lane l sums columns 8l..8l+7: sub-group l / 4 of the chunk.
//  * int8: 64 columns, one vpdpbusd against the activations in column order. Lane l sums columns
//    4l..4l+3: sub-group l / 8 of the chunk.
// int16 activations (qdot.h: t = 255 h + l) are packed as two such sets of byte arrays, l's and
// h's: the lane sums L (from the correction, over l) and H (from zero, over h) combine exactly as
// (H << 8) - H + L, the correction being -o sum t. Four vpdpbusd a chunk instead of two for int4.
// Per chunk, row and vector: the int32 lanes are converted to fp32 (exact), multiplied by the
// lanes' activation scales d (packed per chunk like the correction) and accumulated with an fma by
// the lanes' weight scales into one zmm per output, which ends in hsum's fixed tree.
// A call whose vectors are the ones the scratch was packed from reuses the packing
// (qdot_packed_from.h). Tiles of
// several rows x vectors share loads and decodes between these sequences, never mix them, so a
// result is the same whatever tile, row range, batch size or thread produced it.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "avx512_common.h"
#include "batch_walk.h"
#include "isa_scratch.h"
#include "qdot_kernels.h"
#include "qdot_packed_from.h"
#include "tile_prefetch.h"

namespace md::cpu::detail {
namespace {

thread_local IsaScratch t_xscratch;     // the packed activations
thread_local PackedFrom t_packed_from;  // what they were packed from (qdot_packed_from.h)
thread_local SubgroupMap t_map;         // the sub-group -> group table (isa_scratch.h)

constexpr int kBlockSub = 16;  // sub-groups whose weight scales are decoded together (one zmm)
constexpr int kBatchBlock = 64;
constexpr int kTileVecs = 4;
constexpr int64_t kRowChunkBytes = 256 << 10;  // B > 4: row bytes kept in L2 per row chunk

// One format's chunk geometry.
template <int Bits>
struct Fmt {
  static constexpr int kSubPerChunk = Bits == 4 ? 4 : 2;  // 32-column sub-groups per 64 bytes
  static constexpr int kChunkCols = 32 * kSubPerChunk;
  static constexpr int kSubBytes = 32 * Bits / 8;  // code bytes of a sub-group
  static constexpr int kNx = Bits == 4 ? 2 : 1;    // activation byte arrays
};

// Per code kind: the bits (the chunk geometry) and the offset o of the unsigned operand
// (int4 nibble c = q + 8, int8 code c = q + 128; MXFP4: the table in decode maps an e2m1 code of
// value v to u = 2v + 12 in [0, 24], so the lane sum is 2 sum v t + 12 sum t and the weight scale
// carries the 1/2).
template <QdotCodes C>
inline constexpr int kBits = C == QdotCodes::kInt8 ? 8 : 4;
template <QdotCodes C>
inline constexpr int kOffset = C == QdotCodes::kInt8   ? 128
                               : C == QdotCodes::kInt4 ? 8
                                                       : 12;

// The packed activations of one vector: kNx arrays of 64 bytes per chunk (int4: even columns, odd
// columns; int8: columns in order) of t (int8 activations) or of l then of h (int16), then per
// chunk 16 int32 corrections and 16 fp32 scales.
struct XPack {
  const int8_t* x0;
  const int8_t* x1;
  const int8_t* h0;  // int16 activations: h's arrays
  const int8_t* h1;
  const int32_t* corr;
  const float* scale;
};

// A: the activations' bits, 8 or 16 (two byte planes).
template <int Bits, int A>
struct XLayout {
  static constexpr int kArrays = Fmt<Bits>::kNx * (A / 8);
  int64_t chunks, code_bytes, stride;
  explicit XLayout(int64_t K) {
    chunks = (K + Fmt<Bits>::kChunkCols - 1) / Fmt<Bits>::kChunkCols;
    code_bytes = chunks * 64;
    stride = code_bytes * kArrays + chunks * 128;
  }
  XPack at(const uint8_t* base) const {
    const auto* c = reinterpret_cast<const int8_t*>(base);
    const int8_t* h = A == 16 ? c + Fmt<Bits>::kNx * code_bytes : c;
    return {c,
            c + code_bytes,
            h,
            h + code_bytes,
            reinterpret_cast<const int32_t*>(base + kArrays * code_bytes),
            reinterpret_cast<const float*>(base + kArrays * code_bytes + chunks * 64)};
  }
};

// Stores a sub-group's 32 int32 byte values (q0: columns 0-15, q1: 16-31; each in [-128, 127])
// into byte arrays a0 / a1 in the format's order (int4: even columns to a0, odd to a1).
template <int Bits>
inline void store_bytes(__m512i q0, __m512i q1, int64_t j, int8_t* a0, int8_t* a1) {
  if constexpr (Bits == 4) {
    const __m512i even =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a0 + 16 * j),
                     _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, even, q1)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a1 + 16 * j),
                     _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, odd, q1)));
  } else {
    (void)a1;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a0 + 32 * j), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a0 + 32 * j + 16), _mm512_cvtepi32_epi8(q1));
  }
}

// int16 activations: t = 255 h + l (qdot.h), h = round(t / 255) in fp32 (exact enough: t / 255 is
// never within 1/510 of a half, and |t| < 2^15), l = t - 255 h.
inline __m512i split_high(__m512i t) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(1.0f / 255.0f)));
}
inline __m512i split_low(__m512i t, __m512i h) {
  return _mm512_sub_epi32(t, _mm512_mullo_epi32(h, _mm512_set1_epi32(255)));
}

// Quantizes x (qdot.h's definition: the same IEEE division and round-half-even as the portable
// quantize_activations_int8 / _int16) and writes it in the layout above. Bytes past K stay zero.
template <QdotCodes C, int A>
void pack_x(const float* x, int64_t K, const XLayout<kBits<C>, A>& L, uint8_t* out) {
  constexpr int Bits = kBits<C>;
  using F = Fmt<Bits>;
  constexpr float kTop = A == 16 ? float(kQdotInt16Max) : 127.0f;
  std::memset(out, 0, static_cast<size_t>(L.stride));
  const XPack p = L.at(out);
  auto* x0 = const_cast<int8_t*>(p.x0);
  auto* x1 = const_cast<int8_t*>(p.x1);
  auto* h0 = const_cast<int8_t*>(p.h0);
  auto* h1 = const_cast<int8_t*>(p.h1);
  auto* corr = const_cast<int32_t*>(p.corr);
  auto* scale = const_cast<float*>(p.scale);
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512i lo = _mm512_set1_epi32(-int(kTop)), hi = _mm512_set1_epi32(int(kTop));
  for (int64_t j = 0; j < K / 32; ++j) {
    const __m512 v0 = _mm512_loadu_ps(x + 32 * j), v1 = _mm512_loadu_ps(x + 32 * j + 16);
    const float amax =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask)));
    const float d = amax / kTop;
    __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
    if (amax > 0.0f) {
      const __m512 dv = _mm512_set1_ps(d);
      q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_div_ps(v0, dv)), lo), hi);
      q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_div_ps(v1, dv)), lo), hi);
    }
    if constexpr (A == 16) {
      const __m512i g0 = split_high(q0), g1 = split_high(q1);
      store_bytes<Bits>(split_low(q0, g0), split_low(q1, g1), j, x0, x1);
      store_bytes<Bits>(g0, g1, j, h0, h1);
    } else {
      store_bytes<Bits>(q0, q1, j, x0, x1);
    }
    // The sub-group's lanes of its chunk: 16 / kSubPerChunk of them.
    constexpr int kLanes = 16 / F::kSubPerChunk;
    float* s = scale + (j / F::kSubPerChunk) * 16 + (j % F::kSubPerChunk) * kLanes;
    for (int l = 0; l < kLanes; ++l) s[l] = d;
  }
  // Corrections: -o times each lane's sum of t (vpdpbusd against ones; |sum| <= 8 x 127, int16
  // activations 255 times the sum of h plus the sum of l).
  const __m512i ones = _mm512_set1_epi8(1);
  auto lane_sums = [&](const int8_t* a0, const int8_t* a1, int64_t c) {
    __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_load_si512(a0 + 64 * c));
    if constexpr (Bits == 4) sum = _mm512_dpbusd_epi32(sum, ones, _mm512_load_si512(a1 + 64 * c));
    return sum;
  };
  for (int64_t c = 0; c < L.chunks; ++c) {
    __m512i sum = lane_sums(x0, x1, c);
    if constexpr (A == 16)
      sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(lane_sums(h0, h1, c), _mm512_set1_epi32(255)));
    _mm512_store_si512(corr + 16 * c, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-kOffset<C>)));
  }
}

// Lane l -> lane of its sub-group in a block's weight-scale vector, for chunk c of the block.
template <int Bits>
inline __m512i chunk_scale_index(int c) {
  using F = Fmt<Bits>;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_add_epi32(_mm512_set1_epi32(F::kSubPerChunk * c),
                          _mm512_srli_epi32(lane, Bits == 4 ? 2 : 3));
}

// A chunk's weight bytes as vpdpbusd operands: int4 the even and odd columns' nibbles.
template <int Bits>
struct Decoded {
  __m512i a, b;
};
template <QdotCodes C>
inline Decoded<kBits<C>> decode(__m512i p) {
  if constexpr (C == QdotCodes::kInt4) {
    const __m512i m = _mm512_set1_epi8(0x0F);
    return {_mm512_and_si512(p, m), _mm512_and_si512(_mm512_srli_epi16(p, 4), m)};
  } else if constexpr (C == QdotCodes::kMxfp4) {
    // e2m1 code -> 2v + 12 (codes 0..7: +0, +0.5, .., +6; 8..15 their negatives), per 128-bit lane.
    const __m512i lut = _mm512_broadcast_i32x4(
        _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i m = _mm512_set1_epi8(0x0F);
    return {_mm512_shuffle_epi8(lut, _mm512_and_si512(p, m)),
            _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(p, 4), m))};
  } else {
    return {p, p};
  }
}

// One chunk of a packed vector in registers (h0, h1: int16 activations only).
template <int A>
struct XChunk {
  __m512i x0, x1, h0, h1, corr;
  __m512 scale;
  static XChunk load(const XPack& x, int64_t ci) {
    XChunk r;
    r.x0 = _mm512_load_si512(x.x0 + 64 * ci);
    r.x1 = _mm512_load_si512(x.x1 + 64 * ci);
    if constexpr (A == 16) {
      r.h0 = _mm512_load_si512(x.h0 + 64 * ci);
      r.h1 = _mm512_load_si512(x.h1 + 64 * ci);
    }
    r.corr = _mm512_load_si512(x.corr + 16 * ci);
    r.scale = _mm512_load_ps(x.scale + 16 * ci);
    return r;
  }
};

template <int Bits, int A>
inline __m512i dot(const Decoded<Bits>& w, const XChunk<A>& x) {
  __m512i a = _mm512_dpbusd_epi32(x.corr, w.a, x.x0);
  if constexpr (Bits == 4) a = _mm512_dpbusd_epi32(a, w.b, x.x1);
  if constexpr (A == 16) {
    __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.a, x.h0);
    if constexpr (Bits == 4) h = _mm512_dpbusd_epi32(h, w.b, x.h1);
    a = _mm512_add_epi32(a, _mm512_sub_epi32(_mm512_slli_epi32(h, 8), h));  // + 255 H
  }
  return a;
}

// One tile: NR consecutive rows (codes at w, rb bytes a row; bf16 scales at s, spr a row) times NB
// packed vectors; y[j * ldy + i] for row i, vector j.
template <QdotCodes C, int A, int NR, int NB, bool kPrefetch>
void tile(const uint8_t* w, int64_t rb, const uint8_t* s, int64_t sb, const int32_t* map, int64_t K,
          const XPack* xv, float* y, int64_t ldy) {
  constexpr int Bits = kBits<C>;
  using F = Fmt<Bits>;
  using Sc = std::conditional_t<C == QdotCodes::kMxfp4, HalfE8m0Scales, GroupScales>;
  const int64_t G = K / 32;
  __m512 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  __m512 sv[NR];
  const TilePrefetch<NR, 64> pf(w, rb);
  for (int64_t g = 0; g < G; g += kBlockSub) {
    const int n = static_cast<int>(std::min<int64_t>(kBlockSub, G - g));
    const typename Sc::Block blk = Sc::prepare(map, g, n);
    for (int i = 0; i < NR; ++i) sv[i] = Sc::row(s + i * sb, blk);
    for (int c = 0; c * F::kSubPerChunk < n; ++c) {
      const int64_t ci = g / F::kSubPerChunk + c;
      const uint8_t* wc = w + ci * 64;
      const int present = std::min(F::kSubPerChunk, n - c * F::kSubPerChunk);
      const __mmask64 bytes = present == F::kSubPerChunk
                                  ? ~__mmask64{0}
                                  : (__mmask64{1} << (present * F::kSubBytes)) - 1;
      if constexpr (kPrefetch) pf.step(ci);
      const __m512i sidx = chunk_scale_index<Bits>(c);
      // The chunk's activations, loaded once for the tile's rows.
      XChunk<A> xc[NB];
      for (int j = 0; j < NB; ++j) xc[j] = XChunk<A>::load(xv[j], ci);
      for (int i = 0; i < NR; ++i) {
        // A partial chunk (the row's last) loads only its bytes; the activations past K are
        // packed as zero, so the other lanes add exact zeros.
        const __m512i p = present == F::kSubPerChunk ? _mm512_loadu_si512(wc + i * rb)
                                                     : _mm512_maskz_loadu_epi8(bytes, wc + i * rb);
        const Decoded<Bits> dw = decode<C>(p);
        const __m512 ws = _mm512_permutexvar_ps(sidx, sv[i]);
        for (int j = 0; j < NB; ++j) {
          const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(dot<Bits, A>(dw, xc[j])), xc[j].scale);
          acc[i][j] = _mm512_fmadd_ps(f, ws, acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) y[j * ldy + i] = hsum(acc[i][j]);
}

struct MatQ {
  const uint8_t* codes;
  const uint8_t* scales;  // bf16 as bytes
  int64_t rb, sb;         // code and scale bytes per row
  const int32_t* map;
  int64_t K;
};

// Rows [r, r1): tiles of NR rows, then the rest in tiles of NR/2, .., 1.
template <QdotCodes C, int A, int NB, bool kPrefetch, int NR>
void row_tiles(const MatQ& m, int64_t r, int64_t r1, const XPack* xv, float* y, int64_t ldy) {
  for (; r + NR <= r1; r += NR)
    tile<C, A, NR, NB, kPrefetch>(m.codes + r * m.rb, m.rb, m.scales + r * m.sb, m.sb, m.map, m.K,
                                  xv, y + r, ldy);
  if constexpr (NR > 1) row_tiles<C, A, NB, kPrefetch, NR / 2>(m, r, r1, xv, y, ldy);
}

// nv <= kTileVecs vectors over rows [r0, r1); kTall: the pass that streams the rows from DRAM
// (taller tiles: more concurrent row streams; prefetching).
template <QdotCodes C, int A, bool kTall>
void batch_tile(int nv, const MatQ& m, int64_t r0, int64_t r1, const XPack* xv, float* y,
                int64_t ldy) {
  switch (nv) {
    case 1:
      row_tiles<C, A, 1, kTall, kTall ? 8 : 4>(m, r0, r1, xv, y, ldy);
      break;
    case 2:
      row_tiles<C, A, 2, kTall, 4>(m, r0, r1, xv, y, ldy);
      break;
    case 3:
      row_tiles<C, A, 3, kTall, 2>(m, r0, r1, xv, y, ldy);
      break;
    default:
      row_tiles<C, A, 4, kTall, 2>(m, r0, r1, xv, y, ldy);
      break;
  }
}

template <QdotCodes C, int A>
void matmul(const MatQ& m, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx, float* Y,
            int64_t ldy) {
  const XLayout<kBits<C>, A> L(m.K);
  const int64_t chunk_rows = std::max<int64_t>(4, kRowChunkBytes / (m.rb + m.sb) / 4 * 4);
  XPack xv[kBatchBlock];
  for (int bs = 0; bs < B; bs += kBatchBlock) {
    const int nb = std::min(kBatchBlock, B - bs);
    const PackKey key{C, A == 16 ? QdotActs::kInt16 : QdotActs::kInt8};
    uint8_t* xb =
        packed_activations(t_packed_from, t_xscratch, X + bs * ldx, nb, B, ldx, m.K, key, L.stride,
                           [&](const float* x, uint8_t* out) { pack_x<C, A>(x, m.K, L, out); });
    for (int j = 0; j < nb; ++j) xv[j] = L.at(xb + j * L.stride);
    float* yb = Y + bs * ldy;
    walk_batch<kTileVecs>(
        nb, r0, r1, chunk_rows, [&](auto tall, int j, int nv, int64_t rc, int64_t rce) {
          batch_tile<C, A, decltype(tall)::value>(nv, m, rc, rce, xv + j, yb + j * ldy, ldy);
        });
  }
}

}  // namespace

void matmul_qdot_avx512vnni(const QdotWeights& w, int64_t r0, int64_t r1, const float* X, int B,
                            int64_t ldx, float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || w.K < 32) return;
  const int64_t G = w.K / 32;
  const MatQ m{w.codes, w.scales, w.code_row_bytes(), w.scale_row_bytes(), t_map.get(G, w.group),
               w.K};
  const bool a16 = w.acts == QdotActs::kInt16;
  switch (w.kind) {
    case QdotCodes::kInt4:
      (a16 ? matmul<QdotCodes::kInt4, 16> : matmul<QdotCodes::kInt4, 8>)(m, r0, r1, X, B, ldx, Y,
                                                                         ldy);
      return;
    case QdotCodes::kInt8:
      (a16 ? matmul<QdotCodes::kInt8, 16> : matmul<QdotCodes::kInt8, 8>)(m, r0, r1, X, B, ldx, Y,
                                                                         ldy);
      return;
    case QdotCodes::kMxfp4:
      (a16 ? matmul<QdotCodes::kMxfp4, 16> : matmul<QdotCodes::kMxfp4, 8>)(m, r0, r1, X, B, ldx, Y,
                                                                           ldy);
      return;
  }
}

}  // namespace md::cpu::detail
