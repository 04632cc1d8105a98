// The MLA kernels' vector helpers (mla.cpp): loads and stores of fp32 or bf16 as fp32 vectors,
// dot products, axpy, the online-softmax row updates and the latent cache's row and block access.
// Templates on the vector width W, always inlined, so that each instruction-set copy of mla.cpp's
// bodies gets its own code. Only mla.cpp includes this (hence
// the unnamed namespace).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "megadecode/kernels/cpu/mla.h"

// An unnamed namespace, as when these lived in mla.cpp: internal linkage gives the same code.
namespace md::cpu {
namespace {  // NOLINT(google-build-namespaces): included by mla.cpp only

// Cache rows per decode block: 16 rows of R + P = 576 floats are 36 KiB, which stays in a 48 KiB
// L1 together with one head's query (2.3 KiB) and output accumulator (2 KiB) while all heads of
// the range pass over the block. (Measured: 8 and 16 equal, 32 slower, 64 much slower.)
constexpr int kBlockT = kMlaBlockRows;

// Helpers are inlined into each instruction-set copy of the bodies below.
#define MD_INLINE [[gnu::always_inline]] inline

// Explicit SIMD through GCC/Clang vector extensions, W floats per vector: 4 (SSE2 / NEON) in the
// portable copy, 8 in the AVX2 copy, 16 in the AVX-512 copy. Auto-vectorised scalar loops were fast
// at -O2 but several times slower at -O3 (which re-vectorises the outer loops with shuffles), so
// the register structure is spelled out. Vectors are passed by reference only: a by-value 32-byte
// vector in a function compiled without AVX would change the ABI (-Wpsabi).
template <int W>
struct Simd;
template <>
struct Simd<4> {
  typedef float F __attribute__((vector_size(16)));
  typedef uint16_t H __attribute__((vector_size(8)));
  typedef uint32_t U __attribute__((vector_size(16)));
};
template <>
struct Simd<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef uint16_t H __attribute__((vector_size(16)));
  typedef uint32_t U __attribute__((vector_size(32)));
};
template <>
struct Simd<16> {
  typedef float F __attribute__((vector_size(64)));
  typedef uint16_t H __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(64)));
};
template <int W>
using Vec = typename Simd<W>::F;

// Loads W elements as fp32: fp32 as they are, bf16 widened (overloads, so the helpers below take
// either element type for any operand).
template <int W>
MD_INLINE void load(Vec<W>& v, const float* p) {
  std::memcpy(&v, p, sizeof v);
}

template <int W>
MD_INLINE void store(float* p, const Vec<W>& v) {
  std::memcpy(p, &v, sizeof v);
}

// W bf16 values widened to fp32 (a bf16 is the top half of the fp32 with the same value).
template <int W>
MD_INLINE void load(Vec<W>& v, const bf16* p) {
  typename Simd<W>::H h;
  std::memcpy(&h, p, sizeof h);
  const typename Simd<W>::U u = __builtin_convertvector(h, typename Simd<W>::U) << 16;
  std::memcpy(&v, &u, sizeof v);
}

// One element as fp32 (the scalar tails).
MD_INLINE float f32(float x) {
  return x;
}
MD_INLINE float f32(bf16 x) {
  return bf16_to_f32(x);
}

// x * y rounded to fp32 on its own, for the scalar tails of the dot products (the n % W elements
// after the vector loop), which add one product at a time. Left to itself the compiler fuses such
// a product into the add (FMA, in the AVX2 copy) or not depending on whether it vectorises the
// tail loop (a vectorised reduction multiplies in a vector, then adds in order), and that choice
// differs between fp32 and bf16 operands: the empty asm fixes the rounding, so both element types
// give the same bits. (It is also what the vectorised tails of the fp32-only kernels computed.)
MD_INLINE float mul_rounded(float x, float y) {
  float p = x * y;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __asm__("" : "+x"(p));
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
  __asm__("" : "+w"(p));
#endif
  return p;
}

// The lanes' sum: left to right for 4 and 8 lanes; for 16 (AVX-512) a tree of halves, as 16
// lanes one at a time (15 dependent adds after as many extracts) made the AVX-512 copy slower
// than the AVX2 one on short rows (the `small` preset's 80-wide cache rows).
template <int W>
MD_INLINE float hsum(const Vec<W>& v) {
  if constexpr (W == 16) {
    typedef float F8 __attribute__((vector_size(32)));
    typedef float F4 __attribute__((vector_size(16)));
    const F8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const F4 b =
        __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
  } else {
    float s = 0.0f;
    for (int j = 0; j < W; ++j) s += v[j];
    return s;
  }
}

// a . b with two vector accumulators (independent partial sums hide the add latency). A and B are
// float or bf16 (weight rows, cache rows).
template <int W, class A, class B>
MD_INLINE float dot(const A* a, const B* b, int n) {
  Vec<W> acc0 = {}, acc1 = {};
  int i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    Vec<W> x0, x1, y0, y1;
    load<W>(x0, a + i);
    load<W>(x1, a + i + W);
    load<W>(y0, b + i);
    load<W>(y1, b + i + W);
    acc0 += x0 * y0;
    acc1 += x1 * y1;
  }
  if (i + W <= n) {  // one more whole vector (n = 80 with 16 lanes), rather than W scalar steps
    Vec<W> x0, y0;
    load<W>(x0, a + i);
    load<W>(y0, b + i);
    acc0 += x0 * y0;
    i += W;
  }
  acc0 += acc1;
  float s = hsum<W>(acc0);
  for (; i < n; ++i) s += mul_rounded(f32(a[i]), f32(b[i]));
  return s;
}

// out[k] = a . b_k for four vectors b_k: each load of a serves four products.
template <int W, class A, class B>
MD_INLINE void dot4(const A* a, const B* b0, const B* b1, const B* b2, const B* b3, int n,
                    float* out) {
  Vec<W> c0 = {}, c1 = {}, c2 = {}, c3 = {};
  int i = 0;
  for (; i + W <= n; i += W) {
    Vec<W> x, y0, y1, y2, y3;
    load<W>(x, a + i);
    load<W>(y0, b0 + i);
    load<W>(y1, b1 + i);
    load<W>(y2, b2 + i);
    load<W>(y3, b3 + i);
    c0 += x * y0;
    c1 += x * y1;
    c2 += x * y2;
    c3 += x * y3;
  }
  float s0 = hsum<W>(c0), s1 = hsum<W>(c1), s2 = hsum<W>(c2), s3 = hsum<W>(c3);
  for (; i < n; ++i) {
    const float x = f32(a[i]);
    s0 += mul_rounded(x, f32(b0[i]));
    s1 += mul_rounded(x, f32(b1[i]));
    s2 += mul_rounded(x, f32(b2[i]));
    s3 += mul_rounded(x, f32(b3[i]));
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// Rows a0, a1 against four consecutive rows of b (row stride n): out0[k] = a0 . b_k and
// out1[k] = a1 . b_k. Six loads feed eight products.
template <int W, class A>
MD_INLINE void dot2x4(const A* a0, const A* a1, const float* b, int n, float* out0, float* out1) {
  const float* b0 = b;
  const float* b1 = b0 + n;
  const float* b2 = b1 + n;
  const float* b3 = b2 + n;
  Vec<W> c00 = {}, c01 = {}, c02 = {}, c03 = {}, c10 = {}, c11 = {}, c12 = {}, c13 = {};
  int i = 0;
  for (; i + W <= n; i += W) {
    Vec<W> x0, x1, y0, y1, y2, y3;
    load<W>(x0, a0 + i);
    load<W>(x1, a1 + i);
    load<W>(y0, b0 + i);
    load<W>(y1, b1 + i);
    load<W>(y2, b2 + i);
    load<W>(y3, b3 + i);
    c00 += x0 * y0;
    c01 += x0 * y1;
    c02 += x0 * y2;
    c03 += x0 * y3;
    c10 += x1 * y0;
    c11 += x1 * y1;
    c12 += x1 * y2;
    c13 += x1 * y3;
  }
  float s0[4] = {hsum<W>(c00), hsum<W>(c01), hsum<W>(c02), hsum<W>(c03)};
  float s1[4] = {hsum<W>(c10), hsum<W>(c11), hsum<W>(c12), hsum<W>(c13)};
  const float* bk[4] = {b0, b1, b2, b3};
  for (; i < n; ++i) {
    const float x0 = f32(a0[i]), x1 = f32(a1[i]);
    for (int k = 0; k < 4; ++k) {
      s0[k] += mul_rounded(x0, bk[k][i]);
      s1[k] += mul_rounded(x1, bk[k][i]);
    }
  }
  for (int k = 0; k < 4; ++k) {
    out0[k] = s0[k];
    out1[k] = s1[k];
  }
}

// y += a * x (x: float or bf16).
template <int W, class X>
MD_INLINE void axpy(float* y, const X* x, float a, int n) {
  int i = 0;
  for (; i + W <= n; i += W) {
    Vec<W> vx, vy;
    load<W>(vx, x + i);
    load<W>(vy, y + i);
    vy += a * vx;
    store<W>(y + i, vy);
  }
  for (; i < n; ++i) y[i] += a * f32(x[i]);
}

template <int W>
MD_INLINE void scale_vec(float* y, float a, int n) {
  int i = 0;
  for (; i + W <= n; i += W) {
    Vec<W> vy;
    load<W>(vy, y + i);
    vy *= a;
    store<W>(y + i, vy);
  }
  for (; i < n; ++i) y[i] *= a;
}

// Rows x + k * ld, k = 0, 1, ... (fp32 buffers; a cache block is an array of row pointers).
template <class E>
struct Strided {
  const E* x;
  int64_t ld;
  MD_INLINE const E* operator[](int64_t k) const { return x + k * ld; }
};

// y += sum_k p[k] * x[k] over rows x[k], k in [0, nt) (x: a row pointer array or Strided). Four
// rows per pass, so y is loaded and stored once per four rows.
template <int W, class Rows>
MD_INLINE void accumulate_rows(float* y, const Rows& x, int nt, const float* p, int n) {
  int k = 0;
  for (; k + 4 <= nt; k += 4) {
    const auto* x0 = x[k];
    const auto* x1 = x[k + 1];
    const auto* x2 = x[k + 2];
    const auto* x3 = x[k + 3];
    const float p0 = p[k], p1 = p[k + 1], p2 = p[k + 2], p3 = p[k + 3];
    int i = 0;
    for (; i + W <= n; i += W) {
      Vec<W> v0, v1, v2, v3, vy;
      load<W>(v0, x0 + i);
      load<W>(v1, x1 + i);
      load<W>(v2, x2 + i);
      load<W>(v3, x3 + i);
      load<W>(vy, y + i);
      vy += p0 * v0 + p1 * v1 + p2 * v2 + p3 * v3;
      store<W>(y + i, vy);
    }
    for (; i < n; ++i) {
      y[i] += p0 * f32(x0[i]) + p1 * f32(x1[i]) + p2 * f32(x2[i]) + p3 * f32(x3[i]);
    }
  }
  for (; k < nt; ++k) axpy<W>(y, x[k], p[k], n);
}

// s[k] = scale * (a . x[k]) for rows x[k], k in [0, nt).
template <int W, class E>
MD_INLINE void score_rows(const float* a, const E* const* x, int nt, int n, float scale, float* s) {
  int k = 0;
  for (; k + 4 <= nt; k += 4) dot4<W>(a, x[k], x[k + 1], x[k + 2], x[k + 3], n, s + k);
  for (; k < nt; ++k) s[k] = dot<W>(a, x[k], n);
  for (k = 0; k < nt; ++k) s[k] *= scale;
}

// Cache row t as elements of type E.
template <class E>
MD_INLINE const E* cache_row(const LatentCache& c, int64_t t) {
  return static_cast<const E*>(c.row(t));
}

// kv_b rows (W_UK's or W_UV's, R bf16 each) requested ahead of the absorbed products: a head's
// rows are contiguous, but the hardware prefetchers restart at every 4 KiB, so the products read
// kv_b from DRAM at half the GEMVs' rate without these (bench/RESULTS.md, session 23).
constexpr int kKvbRowsAhead = 16;

// Requests row j of a walk over `rows` rows of R bf16 per head, heads `stride` elements apart
// starting at `first` (the walk's current head), kKvbRowsAhead rows ahead of row j; past the
// head's last row, into the next head's (while heads_left > 0).
MD_INLINE void prefetch_kvb_ahead(const bf16* first, int j, int rows, int64_t stride, int R,
                                  int heads_left) {
  int ahead = j + kKvbRowsAhead;
  const bf16* head = first;
  if (ahead >= rows) {
    if (heads_left <= 0) return;
    ahead -= rows;
    head += stride;
  }
  const char* p = reinterpret_cast<const char*>(head + static_cast<int64_t>(ahead) * R);
  for (int b = 0; b < R * int(sizeof(bf16)); b += 64) __builtin_prefetch(p + b, 0, 2);
}

// Rows from t to the end of t's page.
MD_INLINE int64_t page_left(const LatentCache& c, int64_t t) {
  return c.page_rows - t % c.page_rows;
}

// dst[0, n) = src[0, n) widened to fp32.
template <int W>
MD_INLINE void widen(float* dst, const bf16* src, int n) {
  int i = 0;
  for (; i + W <= n; i += W) {
    Vec<W> v;
    load<W>(v, src + i);
    store<W>(dst + i, v);
  }
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

// The first n elements of cache row r as fp32: an fp32 row where it is, a bf16 row widened into
// buf. Rows that many products read (a decode block: every head; a prefill row: every weight row
// of kv_b) are widened once, so the products run on fp32 for either element type: the same code
// and bits, at the fp32 speed. (Widening inside the products instead converts at every load; that
// measured twice as slow at 32 heads.)
template <int W, class E>
MD_INLINE const float* row_f32(const E* r, int n, float* buf) {
  if constexpr (std::is_same_v<E, float>) {
    return r;
  } else {
    widen<W>(buf, r, n);
    return buf;
  }
}

// rows[k] = the first m elements of cache row t + k as fp32 (row_f32; buf: n rows of m floats),
// for k in [0, n). The page table is read once per page touched: once per block when blocks start
// on multiples of kBlockT, as mla_split_rows' splits do (a block from any other start may cross a
// page).
template <int W, class E>
MD_INLINE void block_rows(const LatentCache& c, int64_t t, int n, int m, float* buf,
                          const float** rows) {
  for (int k = 0; k < n;) {
    const E* r = cache_row<E>(c, t + k);
    const int e = static_cast<int>(std::min<int64_t>(n, k + page_left(c, t + k)));
    for (; k < e; ++k, r += c.ld) rows[k] = row_f32<W>(r, m, buf + static_cast<size_t>(k) * m);
  }
}

}  // namespace
}  // namespace md::cpu
