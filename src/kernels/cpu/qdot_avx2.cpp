// AVX2 kernel of the integer dot products (qdot.h: int4, int8 or MXFP4 weights times int8
// activations). Compiled with -mavx2 -mfma; entered at the avx2 and avx512 levels (CPUs without
// AVX-512 VNNI), where the alternative is the portable loop. The AVX-512 VNNI kernel's scheme
// (qdot_avx512bf16.cpp) at half the width, with vpmaddubsw + vpmaddwd in place of vpdpbusd:
//
// vpmaddubsw multiplies 32 unsigned bytes by 32 signed bytes and adds adjacent products into 16
// int16 lanes, saturating; vpmaddwd against ones adds adjacent int16 lanes into 8 int32 lanes. So
// an int32 lane is the dot product of 4 byte pairs, exact while no int16 sum saturates:
//  * int4 and MXFP4: the weight operand is the code as stored, unsigned (int4 nibble c = q + 8,
//    at most 15; MXFP4 the table's u = 2v + 12, at most 24), against t (|t| <= 127): a pair sum is
//    at most 2 x 24 x 127 = 6096, and the even and the odd columns' int16 sums are added before
//    widening (at most 12192). A lane then holds sum (q + o) t and starts from the correction
//    -o sum t, packed with the activations, as in the VNNI kernel.
//  * int8: c = q + 128 as the unsigned operand would reach 2 x 255 x 127 and saturate. So the
//    weight q = c ^ 0x80 is read as signed and the product formed as |q| x (t with q's sign)
//    (vpabsb, vpsignb): |q| <= 128, a pair sum at most 2 x 128 x 127 = 32512. No correction.
//
// A row is read in chunks of 32 bytes (one ymm load):
//  * int4 / MXFP4: 64 columns, two 32-column sub-groups. Byte b holds columns 2b (low nibble) and
//    2b + 1 (high nibble); the activations are packed once per call (or taken again: PackedFrom)
//    as the even columns' bytes and the odd columns' bytes. Lane l sums columns 8l..8l+7: sub-group
//    l / 4 of the chunk.
//  * int8: 32 columns, one sub-group; lane l sums columns 4l..4l+3.
// int16 activations (qdot.h: t = 255 h + l, both in [-127, 127], so the saturation bounds above
// hold for each) are packed as a second set of byte arrays, h's after l's; the lane sums L (with
// the correction -o sum t) and H combine exactly as L + (H << 8) - H.
// Then, per chunk, row and vector, qdot.h's sequence: the int32 lanes to fp32 (exact), times the
// lanes' activation scales d, an fma by the lanes' weight scales into one ymm per output, which
// ends in hsum's fixed tree. Tiles of rows x vectors only share loads and decodes between these
// sequences, so a result does not depend on the tile, row range, batch size or thread.
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2_common.h"
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
thread_local IsaScratch t_wsscratch;   // a tile's weight scales (MatQ::ws1)
constexpr int kMaxTileRows = 4;        // batch_tile's tallest tile

constexpr int kBlockSub = 8;  // sub-groups whose weight scales are decoded together (one ymm)
constexpr int kBatchBlock = 64;
constexpr int kTileVecs = 2;
constexpr int64_t kRowChunkBytes = 256 << 10;  // B > 4: row bytes kept in L2 per row chunk

template <QdotCodes C>
inline constexpr bool kNibbles = C != QdotCodes::kInt8;
// The unsigned operand's offset (int4 c = q + 8; MXFP4 u = 2v + 12 from the table in decode).
template <QdotCodes C>
inline constexpr int kOffset = C == QdotCodes::kInt4 ? 8 : 12;
template <QdotCodes C>
inline constexpr int kSubPerChunk = kNibbles<C> ? 2 : 1;  // 32-column sub-groups per 32 bytes

// The packed activations of one vector, per chunk: 32 bytes of t (int4 / MXFP4: the even
// columns'), 32 more (int4 / MXFP4: the odd columns'; unused for int8), 8 int32 corrections and 8
// fp32 scales (lane l: d of the lane's sub-group). int16 activations: l's bytes in x0 / x1 and h's
// in h0 / h1 (qdot.h's split).
struct XPack {
  const int8_t* x0;
  const int8_t* x1;
  const int8_t* h0;
  const int8_t* h1;
  const int32_t* corr;
  const float* scale;
};

struct XLayout {
  int64_t chunks, stride, planes;
  XLayout(int64_t K, int sub_per_chunk, int act_bits) {
    chunks = (K / 32 + sub_per_chunk - 1) / sub_per_chunk;
    planes = act_bits / 8;
    stride = chunks * (64 * planes + 32 + 32);
  }
  XPack at(const uint8_t* base) const {
    const auto* c = reinterpret_cast<const int8_t*>(base);
    const int8_t* h = c + 64 * chunks * (planes - 1);
    const uint8_t* tail = base + 64 * chunks * planes;
    return {c,
            c + 32 * chunks,
            h,
            h + 32 * chunks,
            reinterpret_cast<const int32_t*>(tail),
            reinterpret_cast<const float*>(tail + 32 * chunks)};
  }
};

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 0x55));
  return _mm_cvtss_f32(m);
}

// Quantizes x (qdot.h's definition: the same IEEE division and round-half-even as the portable
// quantize_activations_int8 / _int16) and writes it in the layout above. Bytes past K stay zero.
template <QdotCodes C, int A>
void pack_x(const float* x, int64_t K, const XLayout& L, uint8_t* out) {
  constexpr int kTop = A == 16 ? kQdotInt16Max : 127;
  std::memset(out, 0, static_cast<size_t>(L.stride));
  const XPack p = L.at(out);
  int8_t* const planes[2][2] = {{const_cast<int8_t*>(p.x0), const_cast<int8_t*>(p.x1)},
                                {const_cast<int8_t*>(p.h0), const_cast<int8_t*>(p.h1)}};
  auto* scale = const_cast<float*>(p.scale);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i lo = _mm256_set1_epi32(-kTop), hi = _mm256_set1_epi32(kTop);
  // Bytes of a sub-group's 32 int32 codes (4 x 8, clamped: no saturation) in column order:
  // packs interleave the 128-bit lanes, the permute puts the 4-byte runs back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // Nibble formats: per 128-bit lane, the even columns' bytes, then the odd columns'.
  const __m256i evens = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2,
                                         4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t j = 0; j < K / 32; ++j) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 32 * j + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
    }
    const float amax = hmax(m);
    const float d = amax / float(kTop);
    const __m256 dv = _mm256_set1_ps(d);
    __m256i t[4];
    for (int i = 0; i < 4; ++i) {
      const __m256i q =
          amax > 0.0f ? _mm256_cvtps_epi32(_mm256_div_ps(v[i], dv)) : _mm256_setzero_si256();
      t[i] = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
    }
    // The sub-group's 32 byte values u[0..3] (each in [-127, 127]) into plane `pl`.
    auto store = [&](const __m256i(&u)[4], int pl) {
      const __m256i b = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(u[0], u[1]), _mm256_packs_epi32(u[2], u[3])),
          order);
      int8_t* a0 = planes[pl][0];
      int8_t* a1 = planes[pl][1];
      if constexpr (kNibbles<C>) {
        const int64_t c = j / 2, h = j % 2;  // chunk, and which half of its columns
        // [even 0-15, odd 0-15 | even 16-31, odd 16-31] -> [evens | odds] (8-byte units 0, 2, 1, 3)
        const __m256i eo = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, evens), 0xD8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a0 + 32 * c + 16 * h),
                         _mm256_castsi256_si128(eo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a1 + 32 * c + 16 * h),
                         _mm256_extracti128_si256(eo, 1));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a0 + 32 * j), b);
      }
    };
    if constexpr (A == 16) {
      // t = 255 h + l (qdot.h): h = round(t / 255) in fp32 (t / 255 is never within 1/510 of a
      // half), l = t - 255 h.
      __m256i hv[4], lv[4];
      for (int i = 0; i < 4; ++i) {
        hv[i] = _mm256_cvtps_epi32(
            _mm256_mul_ps(_mm256_cvtepi32_ps(t[i]), _mm256_set1_ps(1.0f / 255.0f)));
        lv[i] = _mm256_sub_epi32(t[i], _mm256_mullo_epi32(hv[i], _mm256_set1_epi32(255)));
      }
      store(lv, 0);
      store(hv, 1);
    } else {
      store(t, 0);
    }
    if constexpr (kNibbles<C>) {
      _mm_storeu_ps(scale + 8 * (j / 2) + 4 * (j % 2), _mm_set1_ps(d));
    } else {
      _mm256_storeu_ps(scale + 8 * j, dv);
    }
  }
  if constexpr (kNibbles<C>) {
    // Corrections: -o times each lane's sum of t (|sum| <= 8 x 127; int16 activations: the sum of
    // l plus 255 times the sum of h).
    auto* corr = const_cast<int32_t*>(p.corr);
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    auto lane_sums = [&](int pl, int64_t c) {
      const __m256i a =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(planes[pl][0] + 32 * c));
      const __m256i b =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(planes[pl][1] + 32 * c));
      const __m256i s16 =
          _mm256_add_epi16(_mm256_maddubs_epi16(ones8, a), _mm256_maddubs_epi16(ones8, b));
      return _mm256_madd_epi16(s16, ones16);
    };
    for (int64_t c = 0; c < L.chunks; ++c) {
      __m256i s = lane_sums(0, c);
      if constexpr (A == 16)
        s = _mm256_add_epi32(s, _mm256_mullo_epi32(lane_sums(1, c), _mm256_set1_epi32(255)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(corr + 8 * c),
                          _mm256_mullo_epi32(s, _mm256_set1_epi32(-kOffset<C>)));
    }
  }
}

// The bf16 group scales of a block of n <= 8 consecutive sub-groups g.. (int4 / int8), one lane
// per sub-group: eight consecutive scales of the row from `base` on are read with one 16-byte
// load and spread to the lanes with one vpermps. base is the block's first group, or, near the end
// of a row, the row's last eight groups' first (so the load stays inside the row: the lanes'
// indices are relative to base). Only a row of fewer than 8 groups reads them one at a time, into
// registers: never through small stores and a wide reload, which stalls on store forwarding
// (measured: ~40% of the kernel's time when every block went through a buffer). `prepare` runs
// once per block for all the rows of a tile; its indices come from the call's sub-group -> group
// table (padded by 8 entries, so one load reads any block's).
struct GroupScales {
  struct Block {
    int64_t base;
    int cnt;     // groups < 8: the row's groups from base on
    bool whole;  // 8 scales from base on are the row's: one 16-byte load
    __m256i idx;
  };
  // groups: the bf16 scales per row.
  static Block prepare(const int32_t* map, int64_t g, int, int64_t groups) {
    const int64_t first = map[g];
    const bool whole = groups >= 8;
    const int64_t base = whole ? std::min<int64_t>(first, groups - 8) : first;
    const __m256i m = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(map + g));
    return {base, static_cast<int>(groups - base), whole,
            _mm256_sub_epi32(m, _mm256_set1_epi32(static_cast<int32_t>(base)))};
  }
  // srow: the row's bf16 scales as bytes.
  static __m256 row(const uint8_t* srow, const Block& b) {
    const uint8_t* p = srow + 2 * b.base;
    __m256i w;
    if (b.whole) {
      w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      int32_t v[8];
      for (int k = 0; k < 8; ++k) {
        uint16_t h = 0;
        if (k < b.cnt) std::memcpy(&h, p + 2 * k, 2);
        v[k] = h;
      }
      w = _mm256_setr_epi32(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
    }
    return _mm256_permutevar8x32_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), b.idx);
  }
};

// MXFP4's E8M0 scales halved (the integer operand is 2v), one per sub-group; the same values as
// 0.5 * kMxfp4ScaleTable: s << 23 is 2^(s - 127) for s = 1..254, and s = 0 and 255 (the values with
// ((s + 1) & 0xFE) == 0) get bit 22 set: the subnormal 2^-127 and a quiet NaN.
struct HalfE8m0Scales {
  struct Block {
    int64_t g;
    int n;
    bool whole;  // 8 scale bytes from g on are the row's: one 8-byte load
  };
  static Block prepare(const int32_t*, int64_t g, int n, int64_t groups) {
    return {g, n, g + 8 <= groups};
  }
  static __m256 row(const uint8_t* srow, const Block& b) {
    uint64_t bytes = 0;
    if (b.whole) {
      std::memcpy(&bytes, srow + b.g, 8);
    } else {
      for (int k = 0; k < b.n; ++k) bytes |= uint64_t{srow[b.g + k]} << (8 * k);
    }
    const __m256i s = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes)));
    const __m256i edge = _mm256_cmpeq_epi32(
        _mm256_and_si256(_mm256_add_epi32(s, _mm256_set1_epi32(1)), _mm256_set1_epi32(0xFE)),
        _mm256_setzero_si256());
    const __m256i t = _mm256_or_si256(_mm256_slli_epi32(s, 23),
                                      _mm256_and_si256(edge, _mm256_set1_epi32(0x00400000)));
    return _mm256_mul_ps(_mm256_castsi256_ps(t), _mm256_set1_ps(0.5f));
  }
};

// Lane l -> its sub-group's lane in a block's weight-scale vector, for chunk c of the block.
template <QdotCodes C>
inline __m256i chunk_scale_index(int c) {
  if constexpr (kNibbles<C>)
    return _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                             2 * c + 1);
  else
    return _mm256_set1_epi32(c);
}

// A chunk's weight bytes as operands: int4 / MXFP4 the even and odd columns' unsigned values;
// int8 the magnitudes |q| (a) and the signed codes q (b) whose signs go onto the activations.
struct Decoded {
  __m256i a, b;
};
template <QdotCodes C>
inline Decoded decode(__m256i p) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  if constexpr (C == QdotCodes::kInt4) {
    return {_mm256_and_si256(p, m), _mm256_and_si256(_mm256_srli_epi16(p, 4), m)};
  } else if constexpr (C == QdotCodes::kMxfp4) {
    // e2m1 code -> 2v + 12 (codes 0..7: +0, +0.5, .., +6; 8..15 their negatives), per 128-bit lane.
    const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    return {_mm256_shuffle_epi8(lut, _mm256_and_si256(p, m)),
            _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(p, 4), m))};
  } else {
    const __m256i q = _mm256_xor_si256(p, _mm256_set1_epi8(static_cast<char>(0x80)));
    return {_mm256_abs_epi8(q), q};
  }
}

// One chunk of a packed vector in registers (h0 / h1: int16 activations only).
struct XChunk {
  __m256i x0, x1, h0, h1, corr;
  __m256 scale;
  template <QdotCodes C, int A>
  static XChunk load(const XPack& x, int64_t ci) {
    XChunk r;
    auto ld = [ci](const int8_t* p) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * ci));
    };
    r.x0 = ld(x.x0);
    r.h0 = A == 16 ? ld(x.h0) : _mm256_setzero_si256();
    if constexpr (kNibbles<C>) {
      r.x1 = ld(x.x1);
      r.h1 = A == 16 ? ld(x.h1) : _mm256_setzero_si256();
      r.corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.corr + 8 * ci));
    } else {
      r.x1 = r.h1 = r.corr = _mm256_setzero_si256();
    }
    r.scale = _mm256_loadu_ps(x.scale + 8 * ci);
    return r;
  }
};

// The exact int32 lane sums of one byte plane (a0 / a1: its arrays in registers).
template <QdotCodes C>
inline __m256i plane_dot(const Decoded& w, __m256i a0, __m256i a1) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  if constexpr (kNibbles<C>) {
    const __m256i s16 =
        _mm256_add_epi16(_mm256_maddubs_epi16(w.a, a0), _mm256_maddubs_epi16(w.b, a1));
    return _mm256_madd_epi16(s16, ones16);
  } else {
    (void)a1;
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w.a, _mm256_sign_epi8(a0, w.b)), ones16);
  }
}

template <QdotCodes C, int A>
inline __m256i dot(const Decoded& w, const XChunk& x) {
  __m256i a = plane_dot<C>(w, x.x0, x.x1);
  if constexpr (kNibbles<C>) a = _mm256_add_epi32(a, x.corr);
  if constexpr (A == 16) {
    const __m256i h = plane_dot<C>(w, x.h0, x.h1);
    a = _mm256_add_epi32(a, _mm256_sub_epi32(_mm256_slli_epi32(h, 8), h));  // + 255 H
  }
  return a;
}

struct MatQ {
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t rb, sb;  // code and scale bytes per row
  const int32_t* map;
  int64_t K;
  int64_t groups;  // scales per row
  bool uniform;  // bf16 scales, and every chunk's columns in one group (int8; int4 group % 64 == 0)
  float* ws1;    // uniform: a tile's group scales as floats, kMaxTileRows x (groups + 8)
};

// One tile: NR consecutive rows times NB packed vectors; y[j * ldy + i] for row i, vector j.
// The weight scales reach the fma from memory (ws1 or ws, written per tile or block), not from a
// register per row: with 16 ymm registers, a scale vector per row made the compiler keep an
// accumulator of a 4-row tile on the stack.
template <QdotCodes C, int A, int NR, int NB, bool kPrefetch>
void tile(const MatQ& m, int64_t r, const XPack* xv, float* y, int64_t ldy) {
  using Sc = std::conditional_t<C == QdotCodes::kMxfp4, HalfE8m0Scales, GroupScales>;
  constexpr int kSub = kSubPerChunk<C>;
  constexpr int kChunks = kBlockSub / kSub;  // chunks per block
  const uint8_t* w = m.codes + r * m.rb;
  const uint8_t* s = m.scales + r * m.sb;
  const int64_t G = m.K / 32;
  __m256 acc[NR][NB];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  alignas(32) float ws[NR][kChunks][8];
  const TilePrefetch<NR, 32> pf(w, m.rb);
  // Chunk ci of every row into the accumulators, with weight scales wsc(i). Only a 4-bit row's
  // last chunk can hold one sub-group (16 bytes, kWhole false): the rest loads as zero, against
  // activations packed as zero.
  auto chunk = [&]<bool kWhole>(int64_t ci, auto wsc) {
    if constexpr (kPrefetch) pf.step(ci);
    XChunk xc[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) xc[j] = XChunk::load<C, A>(xv[j], ci);
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      const uint8_t* wr = w + ci * 32 + i * m.rb;
      const __m256i p =
          kWhole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr))
                 : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr)));
      const Decoded dw = decode<C>(p);
      const __m256 sc = wsc(i);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(dot<C, A>(dw, xc[j])), xc[j].scale);
        acc[i][j] = _mm256_fmadd_ps(f, sc, acc[i][j]);
      }
    }
  };
  const int64_t chunks = (G + kSub - 1) / kSub, whole = G / kSub;
  if (m.uniform) {
    // Each chunk lies in one group: the tile's rows' group scales as floats (eight at a time),
    // each chunk's broadcast by its load, and one loop over the whole row. The general path's
    // per-block work (a vpermps per chunk and row, which holds a vector pipe for two cycles on
    // Zen 2, and loops of 4-8 chunks) made int8 ~1.6x and int4 ~1.3x slower from L2 (Zen 2).
    float* ws1 = m.ws1;
    const int64_t gs = (m.groups + 7) / 8 * 8;  // ws1's row stride
    for (int i = 0; i < NR; ++i) {
      const uint8_t* srow = s + i * m.sb;
      int64_t k = 0;
      for (; k + 8 <= m.groups; k += 8) {
        const __m256i h =
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + 2 * k)));
        _mm256_storeu_ps(ws1 + i * gs + k, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
      }
      for (; k < m.groups; ++k) {
        uint16_t h;
        std::memcpy(&h, srow + 2 * k, 2);
        ws1[i * gs + k] = std::bit_cast<float>(uint32_t{h} << 16);
      }
    }
    auto at = [&](int64_t ci) {
      const float* p = ws1 + m.map[ci * kSub];
      return [p, gs](int i) { return _mm256_broadcast_ss(p + i * gs); };
    };
    for (int64_t ci = 0; ci < whole; ++ci) chunk.template operator()<true>(ci, at(ci));
    if (whole < chunks) chunk.template operator()<false>(whole, at(whole));
  } else {
    for (int64_t g = 0; g < G; g += kBlockSub) {
      const int n = static_cast<int>(std::min<int64_t>(kBlockSub, G - g));
      const typename Sc::Block blk = Sc::prepare(m.map, g, n, m.groups);
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i) {
        const __m256 sv = Sc::row(s + i * m.sb, blk);
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c)
          _mm256_store_ps(ws[i][c], _mm256_permutevar8x32_ps(sv, chunk_scale_index<C>(c)));
      }
      const int nw = n / kSub;
      for (int c = 0; c < nw; ++c)
        chunk.template operator()<true>(g / kSub + c,
                                        [&](int i) { return _mm256_load_ps(ws[i][c]); });
      if (nw * kSub < n)
        chunk.template operator()<false>(g / kSub + nw,
                                         [&](int i) { return _mm256_load_ps(ws[i][nw]); });
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) y[j * ldy + r + i] = hsum(acc[i][j]);
}

// Rows [r, r1): tiles of NR rows, then the rest in tiles of NR/2, .., 1.
template <QdotCodes C, int A, int NB, bool kPrefetch, int NR>
void row_tiles(const MatQ& m, int64_t r, int64_t r1, const XPack* xv, float* y, int64_t ldy) {
  for (; r + NR <= r1; r += NR) tile<C, A, NR, NB, kPrefetch>(m, r, xv, y, ldy);
  if constexpr (NR > 1) row_tiles<C, A, NB, kPrefetch, NR / 2>(m, r, r1, xv, y, ldy);
}

// nv <= kTileVecs vectors over rows [r0, r1); kTall: the pass that streams the rows from DRAM.
template <QdotCodes C, int A, bool kTall>
void batch_tile(int nv, const MatQ& m, int64_t r0, int64_t r1, const XPack* xv, float* y,
                int64_t ldy) {
  switch (nv) {
    case 1:
      row_tiles<C, A, 1, kTall, 4>(m, r0, r1, xv, y, ldy);
      break;
    case 2:
      row_tiles<C, A, 2, kTall, 2>(m, r0, r1, xv, y, ldy);
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
  const XLayout L(m.K, kSubPerChunk<C>, A);
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

void matmul_qdot_avx2(const QdotWeights& w, int64_t r0, int64_t r1, const float* X, int B,
                      int64_t ldx, float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || w.K < 32) return;
  const int64_t G = w.K / 32;
  // The sub-group -> group table, and 8 padding entries: a block's lanes past the row's end.
  const int32_t* map = t_map.get(G, w.group, 8);
  const int64_t groups = w.kind == QdotCodes::kMxfp4 ? G : w.K / w.group;
  const bool uniform =
      w.kind == QdotCodes::kInt8 || (w.kind == QdotCodes::kInt4 && w.group % 64 == 0);
  auto* ws1 = static_cast<float*>(
      t_wsscratch.get(static_cast<size_t>(kMaxTileRows * (groups + 8)) * sizeof(float)));
  const MatQ m{w.codes, w.scales, w.code_row_bytes(), w.scale_row_bytes(), map, w.K, groups,
               uniform, ws1};
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
