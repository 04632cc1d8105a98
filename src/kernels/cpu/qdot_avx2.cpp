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
//    2b + 1 (high nibble); the activations are packed once per call as the even columns' bytes
//    and the odd columns' bytes. Lane l sums columns 8l..8l+7: sub-group l / 4 of the chunk.
//  * int8: 32 columns, one sub-group; lane l sums columns 4l..4l+3.
// Then, per chunk, row and vector, qdot.h's sequence: the int32 lanes to fp32 (exact), times the
// lanes' activation scales d, an fma by the lanes' weight scales into one ymm per output, which
// ends in hsum's fixed tree. Tiles of rows x vectors only share loads and decodes between these
// sequences, so a result does not depend on the tile, row range, batch size or thread.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "avx2_common.h"
#include "batch_walk.h"
#include "isa_scratch.h"
#include "qdot_kernels.h"
#include "tile_prefetch.h"

namespace md::cpu::detail {
namespace {

thread_local IsaScratch t_xscratch;    // the packed activations
thread_local IsaScratch t_mapscratch;  // the sub-group -> group table of the call

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
// fp32 scales (lane l: d of the lane's sub-group).
struct XPack {
  const int8_t* x0;
  const int8_t* x1;
  const int32_t* corr;
  const float* scale;
};

struct XLayout {
  int64_t chunks, stride;
  XLayout(int64_t K, int sub_per_chunk) {
    chunks = (K / 32 + sub_per_chunk - 1) / sub_per_chunk;
    stride = chunks * (32 + 32 + 32 + 32);
  }
  XPack at(const uint8_t* base) const {
    const auto* c = reinterpret_cast<const int8_t*>(base);
    return {c, c + 32 * chunks, reinterpret_cast<const int32_t*>(base + 64 * chunks),
            reinterpret_cast<const float*>(base + 96 * chunks)};
  }
};

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 0x55));
  return _mm_cvtss_f32(m);
}

// Quantizes x (qdot.h's definition: the same IEEE division and round-half-even as the portable
// quantize_activations_int8) and writes it in the layout above. Bytes past K stay zero.
template <QdotCodes C>
void pack_x(const float* x, int64_t K, const XLayout& L, uint8_t* out) {
  std::memset(out, 0, static_cast<size_t>(L.stride));
  const XPack p = L.at(out);
  auto* x0 = const_cast<int8_t*>(p.x0);
  auto* x1 = const_cast<int8_t*>(p.x1);
  auto* scale = const_cast<float*>(p.scale);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  alignas(32) int32_t q[32];
  for (int64_t j = 0; j < K / 32; ++j) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 32 * j + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
    }
    const float amax = hmax(m);
    const float d = amax / 127.0f;
    const __m256 dv = _mm256_set1_ps(d);
    for (int i = 0; i < 4; ++i) {
      const __m256i t =
          amax > 0.0f ? _mm256_cvtps_epi32(_mm256_div_ps(v[i], dv)) : _mm256_setzero_si256();
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * i),
                         _mm256_min_epi32(_mm256_max_epi32(t, lo), hi));
    }
    if constexpr (kNibbles<C>) {
      const int64_t c = j / 2, h = j % 2;  // chunk, and which half of its columns
      for (int b = 0; b < 16; ++b) {
        x0[32 * c + 16 * h + b] = static_cast<int8_t>(q[2 * b]);
        x1[32 * c + 16 * h + b] = static_cast<int8_t>(q[2 * b + 1]);
      }
      for (int l = 0; l < 4; ++l) scale[8 * c + 4 * h + l] = d;
    } else {
      for (int k = 0; k < 32; ++k) x0[32 * j + k] = static_cast<int8_t>(q[k]);
      for (int l = 0; l < 8; ++l) scale[8 * j + l] = d;
    }
  }
  if constexpr (kNibbles<C>) {
    // Corrections: -o times each lane's sum of t (|sum| <= 8 x 127).
    auto* corr = const_cast<int32_t*>(p.corr);
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t c = 0; c < L.chunks; ++c) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + 32 * c));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x1 + 32 * c));
      const __m256i s16 =
          _mm256_add_epi16(_mm256_maddubs_epi16(ones8, a), _mm256_maddubs_epi16(ones8, b));
      const __m256i s = _mm256_madd_epi16(s16, ones16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(corr + 8 * c),
                          _mm256_mullo_epi32(s, _mm256_set1_epi32(-kOffset<C>)));
    }
  }
}

// The bf16 group scales of a block of n <= 8 consecutive sub-groups g.. (int4 / int8), one lane
// per sub-group: the block's groups first..first+cnt-1 are read once per row and spread to the
// lanes with one vpermps. `prepare` runs once per block for all the rows of a tile. The scales
// go from memory into a register in one load where the row has 8 of them from `first` on, else
// one at a time into registers: never through small stores and a wide reload, which stalls on
// store forwarding (measured: ~40% of the kernel's time when the block went through a buffer).
struct GroupScales {
  struct Block {
    int64_t first;
    int cnt;
    bool whole;  // 8 scales from first on are the row's: one 16-byte load
    __m256i idx;
  };
  // groups: the bf16 scales per row.
  static Block prepare(const int32_t* map, int64_t g, int n, int64_t groups) {
    alignas(32) int32_t idx[8] = {};
    const int32_t first = map[g];
    for (int k = 0; k < n; ++k) idx[k] = map[g + k] - first;
    return {first, map[g + n - 1] - first + 1, first + 8 <= groups,
            _mm256_load_si256(reinterpret_cast<const __m256i*>(idx))};
  }
  // srow: the row's bf16 scales as bytes.
  static __m256 row(const uint8_t* srow, const Block& b) {
    const uint8_t* p = srow + 2 * b.first;
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

// One chunk of a packed vector in registers.
struct XChunk {
  __m256i x0, x1, corr;
  __m256 scale;
  template <QdotCodes C>
  static XChunk load(const XPack& x, int64_t ci) {
    XChunk r;
    r.x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.x0 + 32 * ci));
    if constexpr (kNibbles<C>) {
      r.x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.x1 + 32 * ci));
      r.corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.corr + 8 * ci));
    } else {
      r.x1 = r.corr = _mm256_setzero_si256();
    }
    r.scale = _mm256_loadu_ps(x.scale + 8 * ci);
    return r;
  }
};

template <QdotCodes C>
inline __m256i dot(const Decoded& w, const XChunk& x) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  if constexpr (kNibbles<C>) {
    const __m256i s16 =
        _mm256_add_epi16(_mm256_maddubs_epi16(w.a, x.x0), _mm256_maddubs_epi16(w.b, x.x1));
    return _mm256_add_epi32(_mm256_madd_epi16(s16, ones16), x.corr);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w.a, _mm256_sign_epi8(x.x0, w.b)), ones16);
  }
}

struct MatQ {
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t rb, sb;  // code and scale bytes per row
  const int32_t* map;
  int64_t K;
  int64_t groups;  // scales per row
};

// One tile: NR consecutive rows times NB packed vectors; y[j * ldy + i] for row i, vector j.
template <QdotCodes C, int NR, int NB, bool kPrefetch>
void tile(const MatQ& m, int64_t r, const XPack* xv, float* y, int64_t ldy) {
  using Sc = std::conditional_t<C == QdotCodes::kMxfp4, HalfE8m0Scales, GroupScales>;
  constexpr int kSub = kSubPerChunk<C>;
  const uint8_t* w = m.codes + r * m.rb;
  const uint8_t* s = m.scales + r * m.sb;
  const int64_t G = m.K / 32;
  __m256 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  __m256 sv[NR];
  const TilePrefetch<NR, 32> pf(w, m.rb);
  for (int64_t g = 0; g < G; g += kBlockSub) {
    const int n = static_cast<int>(std::min<int64_t>(kBlockSub, G - g));
    const typename Sc::Block blk = Sc::prepare(m.map, g, n, m.groups);
    for (int i = 0; i < NR; ++i) sv[i] = Sc::row(s + i * m.sb, blk);
    for (int c = 0; c * kSub < n; ++c) {
      const int64_t ci = g / kSub + c;
      const uint8_t* wc = w + ci * 32;
      // Only a 4-bit row's last chunk can hold one sub-group (16 bytes): the rest loads as zero,
      // against activations packed as zero.
      const bool whole = kSub == 1 || (c + 1) * kSub <= n;
      if constexpr (kPrefetch) pf.step(ci);
      const __m256i sidx = chunk_scale_index<C>(c);
      XChunk xc[NB];
      for (int j = 0; j < NB; ++j) xc[j] = XChunk::load<C>(xv[j], ci);
      for (int i = 0; i < NR; ++i) {
        const uint8_t* wr = wc + i * m.rb;
        const __m256i p =
            whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr))
                  : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr)));
        const Decoded dw = decode<C>(p);
        const __m256 ws = _mm256_permutevar8x32_ps(sv[i], sidx);
        for (int j = 0; j < NB; ++j) {
          const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(dot<C>(dw, xc[j])), xc[j].scale);
          acc[i][j] = _mm256_fmadd_ps(f, ws, acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) y[j * ldy + r + i] = hsum(acc[i][j]);
}

// Rows [r, r1): tiles of NR rows, then the rest in tiles of NR/2, .., 1.
template <QdotCodes C, int NB, bool kPrefetch, int NR>
void row_tiles(const MatQ& m, int64_t r, int64_t r1, const XPack* xv, float* y, int64_t ldy) {
  for (; r + NR <= r1; r += NR) tile<C, NR, NB, kPrefetch>(m, r, xv, y, ldy);
  if constexpr (NR > 1) row_tiles<C, NB, kPrefetch, NR / 2>(m, r, r1, xv, y, ldy);
}

// nv <= kTileVecs vectors over rows [r0, r1); kTall: the pass that streams the rows from DRAM.
template <QdotCodes C, bool kTall>
void batch_tile(int nv, const MatQ& m, int64_t r0, int64_t r1, const XPack* xv, float* y,
                int64_t ldy) {
  switch (nv) {
    case 1:
      row_tiles<C, 1, kTall, 4>(m, r0, r1, xv, y, ldy);
      break;
    case 2:
      row_tiles<C, 2, kTall, 2>(m, r0, r1, xv, y, ldy);
      break;
    case 3:
      row_tiles<C, 3, kTall, 2>(m, r0, r1, xv, y, ldy);
      break;
    default:
      row_tiles<C, 4, kTall, 2>(m, r0, r1, xv, y, ldy);
      break;
  }
}

template <QdotCodes C>
void matmul(const MatQ& m, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx, float* Y,
            int64_t ldy) {
  const XLayout L(m.K, kSubPerChunk<C>);
  const int64_t chunk_rows = std::max<int64_t>(4, kRowChunkBytes / (m.rb + m.sb) / 4 * 4);
  XPack xv[kBatchBlock];
  for (int bs = 0; bs < B; bs += kBatchBlock) {
    const int nb = std::min(kBatchBlock, B - bs);
    auto* xb = static_cast<uint8_t*>(t_xscratch.get(static_cast<size_t>(nb * L.stride)));
    for (int j = 0; j < nb; ++j) {
      pack_x<C>(X + (bs + j) * ldx, m.K, L, xb + j * L.stride);
      xv[j] = L.at(xb + j * L.stride);
    }
    float* yb = Y + bs * ldy;
    walk_batch<kTileVecs>(
        nb, r0, r1, chunk_rows, [&](auto tall, int j, int nv, int64_t rc, int64_t rce) {
          batch_tile<C, decltype(tall)::value>(nv, m, rc, rce, xv + j, yb + j * ldy, ldy);
        });
  }
}

}  // namespace

void matmul_qdot_avx2(const QdotWeights& w, int64_t r0, int64_t r1, const float* X, int B,
                      int64_t ldx, float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || w.K < 32) return;
  const int64_t G = w.K / 32;
  auto* map = static_cast<int32_t*>(t_mapscratch.get(static_cast<size_t>(G) * sizeof(int32_t)));
  for (int64_t j = 0; j < G; ++j) map[j] = static_cast<int32_t>(32 * j / w.group);
  const int64_t groups = w.kind == QdotCodes::kMxfp4 ? G : w.K / w.group;
  const MatQ m{w.codes, w.scales, w.code_row_bytes(), w.scale_row_bytes(), map, w.K, groups};
  switch (w.kind) {
    case QdotCodes::kInt4:
      matmul<QdotCodes::kInt4>(m, r0, r1, X, B, ldx, Y, ldy);
      return;
    case QdotCodes::kInt8:
      matmul<QdotCodes::kInt8>(m, r0, r1, X, B, ldx, Y, ldy);
      return;
    case QdotCodes::kMxfp4:
      matmul<QdotCodes::kMxfp4>(m, r0, r1, X, B, ldx, Y, ldy);
      return;
  }
}

}  // namespace md::cpu::detail
