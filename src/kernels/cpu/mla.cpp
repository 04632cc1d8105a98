// Multi-head latent attention kernels (see mla.h for the contract).
//
// Decode streams the latent cache once for the whole head range: the cache is walked in blocks of
// kBlockT rows small enough to stay in L1, and every head scores and accumulates a block before
// the next block is loaded. The softmax is therefore computed online (running max and running
// denominator per head, rescaling the partial sums when the max grows), which keeps the per-head
// state at O(R) instead of O(T) and needs no second pass over the cache.
//
// Prefill follows the reference's explicit formulation (k_nope and v expanded from the latent for
// every visible row, once per head and chunk) because its bf16 rounding points sit on k_nope, v
// and the probabilities, which the absorbed form does not materialise.
//
// The cache is paged and its element type is fp32 or bf16 (LatentCache). The loads and products
// take either element type (templates on it), and each body that reads the cache is compiled once
// per element type E (and per instruction set), so E is chosen once per call, never inside a loop.
// A bf16 element widens to fp32 exactly and then meets the same arithmetic in the same order as
// an fp32 one, so a bf16 cache holding bf16-valued data gives exactly the fp32 cache's bits. Rows
// that many products read are widened once into an fp32 buffer (a decode block, read by every
// head; a prefill latent, read by every kv_b row), the rest (prefill's k_pe) is read in place.
// Rows are addressed through the page table once per block (decode) or per page (prefill) and by
// the row stride in between.
#include "megadecode/kernels/cpu/mla.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/cpu_features.h"

namespace md::cpu {
namespace {

// Cache rows per decode block: 16 rows of R + P = 576 floats are 36 KiB, which stays in a 48 KiB
// L1 together with one head's query (2.3 KiB) and output accumulator (2 KiB) while all heads of
// the range pass over the block. (Measured: 8 and 16 equal, 32 slower, 64 much slower.)
constexpr int kBlockT = kMlaBlockRows;

// Helpers are inlined into each instruction-set copy of the bodies below.
#define MD_INLINE [[gnu::always_inline]] inline

// Explicit SIMD through GCC/Clang vector extensions, W floats per vector: 4 (SSE2 / NEON) in the
// portable copy, 8 in the AVX2 copy, 16 in the AVX-512 copy. Auto-vectorised scalar loops were fast at -O2 but several
// times slower at -O3 (which re-vectorises the outer loops with shuffles), so the register
// structure is spelled out. Vectors are passed by reference only: a by-value 32-byte vector in a
// function compiled without AVX would change the ABI (-Wpsabi).
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
    const F4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
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

// Per-thread fallback workspace for when the caller's scratch (sized T + 2R by the contract, i.e.
// for one head at a time) cannot hold the state of the whole head range. Only short contexts take
// this path; it grows once per thread and is then reused.
float* thread_workspace(size_t n) {
  thread_local std::vector<float> ws;
  if (ws.size() < n) ws.resize(n);
  return ws.data();
}

// One decode block widened to fp32 (block_rows, bf16 caches only): kBlockT rows of R + P floats,
// grown once per thread, then reused.
float* block_workspace(size_t n) {
  thread_local std::vector<float> ws;
  if (ws.size() < n) ws.resize(n);
  return ws.data();
}

// The prefill's per-head buffers (kv_b rows in fp32, expanded k/v, probabilities): grown once per
// thread, then reused, so a prefill chunk does not allocate. Separate from thread_workspace so
// that neither invalidates the other.
float* prefill_workspace(size_t n) {
  thread_local std::vector<float> ws;
  if (ws.size() < n) ws.resize(n);
  return ws.data();
}

// The partial attention of heads [h0, h1) over cache rows [t0, t1), written to part[hh] =
// {ol[R] (unnormalised sum of p_t c_t), running max, running denominator} (see mla.h).
// ws holds nh * (R + P) + kBlockT floats.
template <int W, class E>
MD_INLINE void partial_body(const float* q, const LatentCache& cache, int t0, int t1,
                            const bf16* kv_b, const MlaDims& d, int h0, int h1, float* part,
                            float* ws) {
  const int nh = h1 - h0;
  const int N = d.N, P = d.P, V = d.V, R = d.R;
  const int RP = R + P;  // a cache row and an absorbed query: [latent ; k_pe]
  const int PS = R + 2;  // one head's partial: ol[R], max, sum
  const float scale = 1.0f / std::sqrt(static_cast<float>(N + P));
  float* qa = ws;                                 // [nh][RP]: W_UK^T q_nope ; q_pe
  float* s = qa + static_cast<size_t>(nh) * RP;  // [kBlockT]: one head's block scores

  for (int hh = 0; hh < nh; ++hh) {
    const int h = h0 + hh;
    const float* qh = q + static_cast<size_t>(h) * (N + P);
    const bf16* wuk = kv_b + static_cast<size_t>(h) * (N + V) * R;
    float* qah = qa + static_cast<size_t>(hh) * RP;
    // ql = W_UK^T q_nope walks W_UK row by row (rows are contiguous R values) and adds each row
    // with its q weight: a transposed product without a transposed copy. (Four rows a pass, as
    // accumulate_rows, measured no faster on the Emerald Rapids host.)
    std::fill(qah, qah + R, 0.0f);
    for (int n = 0; n < N; ++n) {
      prefetch_kvb_ahead(wuk, n, N, int64_t(N + V) * R, R, nh - 1 - hh);
      axpy<W>(qah, wuk + static_cast<size_t>(n) * R, qh[n], R);
    }
    std::copy(qh + N, qh + N + P, qah + R);
    float* ph = part + static_cast<size_t>(hh) * PS;
    std::fill(ph, ph + R, 0.0f);
    ph[R] = -std::numeric_limits<float>::infinity();
    ph[R + 1] = 0.0f;
  }

  const float* rows[kBlockT];
  float* wide =
      std::is_same_v<E, float> ? nullptr : block_workspace(static_cast<size_t>(kBlockT) * RP);
  for (int b0 = t0; b0 < t1; b0 += kBlockT) {
    const int nt = std::min(kBlockT, t1 - b0);
    block_rows<W, E>(cache, b0, nt, RP, wide, rows);
    for (int hh = 0; hh < nh; ++hh) {
      float* olh = part + static_cast<size_t>(hh) * PS;
      float& run_max = olh[R];
      float& run_sum = olh[R + 1];
      score_rows<W>(qa + static_cast<size_t>(hh) * RP, rows, nt, RP, scale, s);
      float bmax = s[0];
      for (int k = 1; k < nt; ++k) bmax = std::max(bmax, s[k]);
      if (bmax > run_max) {
        // A larger max rescales what was accumulated under the old one; on the first block the
        // old sums are zero and exp(-inf) = 0 leaves them so.
        const float alpha = std::exp(run_max - bmax);
        run_sum *= alpha;
        scale_vec<W>(olh, alpha, R);
        run_max = bmax;
      }
      float sum = 0.0f;
      for (int k = 0; k < nt; ++k) {
        s[k] = std::exp(s[k] - run_max);
        sum += s[k];
      }
      run_sum += sum;
      accumulate_rows<W>(olh, rows, nt, s, R);
    }
  }
}

// Merges the S partials of heads [h0, h1) in ascending split order and applies W_UV (see mla.h).
// acc holds R floats.
template <int W>
MD_INLINE void merge_body(const float* part, int64_t split_stride, int S, const bf16* kv_b,
                          const MlaDims& d, int h0, int h1, float* out, float* acc) {
  const int N = d.N, V = d.V, R = d.R;
  const int PS = R + 2;
  for (int h = h0; h < h1; ++h) {
    const int64_t off = static_cast<int64_t>(h - h0) * PS;
    float m = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < S; ++i) {
      const float* pi = part + i * split_stride + off;
      if (pi[R + 1] > 0.0f) m = std::max(m, pi[R]);
    }
    float* oh = out + static_cast<size_t>(h) * V;
    if (!(m > -std::numeric_limits<float>::infinity())) {  // no row attended: zero, as T = 0
      std::fill(oh, oh + V, 0.0f);
      continue;
    }
    std::fill(acc, acc + R, 0.0f);
    float sum = 0.0f;
    for (int i = 0; i < S; ++i) {
      const float* pi = part + i * split_stride + off;
      if (!(pi[R + 1] > 0.0f)) continue;  // an empty split
      // With one split f = exp(0) = 1 and acc = 0 + 1 * ol: the merge is exact.
      const float f = std::exp(pi[R] - m);
      axpy<W>(acc, pi, f, R);
      sum += f * pi[R + 1];
    }
    const bf16* wuv = kv_b + (static_cast<size_t>(h) * (N + V) + N) * R;
    const float inv = 1.0f / sum;
    // Normalising after the W_UV product costs V multiplies instead of R.
    for (int v = 0; v < V; ++v) {
      prefetch_kvb_ahead(wuv, v, V, int64_t(N + V) * R, R, h1 - 1 - h);
      oh[v] = dot<W>(wuv + static_cast<size_t>(v) * R, acc, R) * inv;
    }
  }
}

// kv[t][j] = c_t . w_j for cache rows t in [0, Tk) and the head's N + V weight rows (fp32 copy w).
// Two cache rows by four weight rows per pass: six loads feed eight products. Page by page (pages
// hold an even number of rows, so the pairs are those of a flat cache; each kv[t][j] is one dot
// whichever way the rows are paired). cw: 2 R floats for the latents of a bf16 pair (row_f32).
template <int W, class E>
MD_INLINE void expand_kv_body(const LatentCache& cache, int Tk, const float* w, int NV, int R,
                              float* kv, float* cw) {
  const int64_t ldc = cache.ld;
  for (int t = 0; t < Tk;) {
    const E* c = cache_row<E>(cache, t);
    const int e = static_cast<int>(std::min<int64_t>(Tk, t + page_left(cache, t)));
    for (; t + 2 <= e; t += 2, c += 2 * ldc) {
      const float* c0 = row_f32<W>(c, R, cw);
      const float* c1 = row_f32<W>(c + ldc, R, cw + R);
      float* kv0 = kv + static_cast<size_t>(t) * NV;
      int j = 0;
      for (; j + 4 <= NV; j += 4) {
        dot2x4<W>(c0, c1, w + static_cast<size_t>(j) * R, R, kv0 + j, kv0 + NV + j);
      }
      for (; j < NV; ++j) {
        kv0[j] = dot<W>(c0, w + static_cast<size_t>(j) * R, R);
        kv0[NV + j] = dot<W>(c1, w + static_cast<size_t>(j) * R, R);
      }
    }
    for (; t < e; ++t, c += ldc) {
      const float* c0 = row_f32<W>(c, R, cw);
      float* kvt = kv + static_cast<size_t>(t) * NV;
      int j = 0;
      for (; j + 4 <= NV; j += 4) {
        const float* w0 = w + static_cast<size_t>(j) * R;
        dot4<W>(c0, w0, w0 + R, w0 + 2 * R, w0 + 3 * R, R, kvt + j);
      }
      for (; j < NV; ++j) kvt[j] = dot<W>(c0, w + static_cast<size_t>(j) * R, R);
    }
  }
}

// Causal attention of the chunk's queries for head h over the expanded rows kv.
template <int W, class E>
MD_INLINE void prefill_attend_body(const float* q, int64_t ldq, int Tq, int T0,
                                   const LatentCache& cache, const float* kv, const MlaDims& d,
                                   int h, float* out, int64_t ldo, bool round, float* p) {
  const int N = d.N, P = d.P, V = d.V, R = d.R, NV = N + V;
  const float scale = 1.0f / std::sqrt(static_cast<float>(N + P));
  for (int i = 0; i < Tq; ++i) {
    const float* qn = q + i * ldq + static_cast<int64_t>(h) * (N + P);
    const float* qpe = qn + N;
    const int nk = T0 + i + 1;  // causal: rows [0, T0 + i]
    // Scores as the reference: q . [k_nope ; k_pe], then the scale.
    float smax = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < nk;) {  // page by page
      const E* kpe = cache_row<E>(cache, t) + R;
      for (const int64_t e = std::min<int64_t>(nk, t + page_left(cache, t)); t < e;
           ++t, kpe += cache.ld) {
        float s = dot<W>(qn, kv + static_cast<size_t>(t) * NV, N) + dot<W>(qpe, kpe, P);
        // The bf16 reference rounds the q.k matmul, then the scaled score (two bf16 tensors).
        p[t] = round ? md::round_bf16(md::round_bf16(s) * scale) : s * scale;
        smax = std::max(smax, p[t]);
      }
    }
    float sum = 0.0f;
    for (int t = 0; t < nk; ++t) {
      p[t] = std::exp(p[t] - smax);
      sum += p[t];
    }
    // Multiplying by the reciprocal, as PyTorch's CPU softmax does.
    const float inv = 1.0f / sum;
    for (int t = 0; t < nk; ++t) {
      p[t] *= inv;
      if (round) p[t] = md::round_bf16(p[t]);
    }
    float* o = out + i * ldo + static_cast<int64_t>(h) * V;
    std::fill(o, o + V, 0.0f);
    accumulate_rows<W>(o, Strided<float>{kv + N, NV}, nk, p, V);
  }
}

// One copy of each body per instruction set: the bodies are always_inline templates, so each
// wrapper below compiles the same source for its own target: 16-float vectors with AVX-512,
// 8-float vectors with AVX2 and FMA, or 4-float vectors for the build's baseline (SSE2 on x86-64).
// The copies differ in lane count and fused multiply-adds, so their results differ by rounding
// only. The ISA level (cpu_features.h) picks the copy: AVX-512 from the avx512 level up, AVX2 from
// the avx2 level. (The AVX-512 copy was measured no faster on an earlier host; on the Emerald
// Rapids one, bench/RESULTS.md session 23, it takes 21% off a 4096-row decode of 32 heads and 14%
// off a 32-row one.) The copies are compiled through target attributes rather than *_avx2.cpp /
// *_avx512.cpp files because the bodies are templates shared with the baseline copy; the
// attributes are exactly those levels' flags.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MD_MLA_X86 1
#endif

bool use_avx2() {
#ifdef MD_MLA_X86
  return active_isa() >= Isa::kAvx2;
#else
  return false;
#endif
}

bool use_avx512() {
#ifdef MD_MLA_X86
  return active_isa() >= Isa::kAvx512;
#else
  return false;
#endif
}

// MD_MLA_VERSIONS_E: the same for the bodies that read cache rows, each also a template on the
// cache element type E (float or bf16); callers pick E once per call (with_cache_type).
// clang-format off
#ifdef MD_MLA_X86
#define MD_MLA_AVX512 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"
#define MD_MLA_VERSIONS(name, params, args)                                                \
  void name##_portable params { name##_body<4> args; }                                     \
  __attribute__((target("avx2,fma,f16c"))) void name##_avx2 params { name##_body<8> args; }     \
  __attribute__((target(MD_MLA_AVX512))) void name##_avx512 params {                       \
    name##_body<16> args;                                                                  \
  }                                                                                        \
  void name params {                                                                       \
    if (use_avx512()) return name##_avx512 args;                                           \
    if (use_avx2()) return name##_avx2 args;                                               \
    name##_portable args;                                                                  \
  }
#define MD_MLA_VERSIONS_E(name, params, args)                                              \
  template <class E> void name##_portable params { name##_body<4, E> args; }               \
  template <class E>                                                                       \
  __attribute__((target("avx2,fma,f16c"))) void name##_avx2 params { name##_body<8, E> args; }  \
  template <class E>                                                                       \
  __attribute__((target(MD_MLA_AVX512))) void name##_avx512 params {                       \
    name##_body<16, E> args;                                                               \
  }                                                                                        \
  template <class E> void name params {                                                    \
    if (use_avx512()) return name##_avx512<E> args;                                        \
    if (use_avx2()) return name##_avx2<E> args;                                            \
    name##_portable<E> args;                                                               \
  }
#else
#define MD_MLA_VERSIONS(name, params, args) \
  void name params { name##_body<4> args; }
#define MD_MLA_VERSIONS_E(name, params, args) \
  template <class E> void name params { name##_body<4, E> args; }
#endif
// clang-format on

MD_MLA_VERSIONS_E(partial,
                  (const float* q, const LatentCache& cache, int t0, int t1, const bf16* kv_b,
                   const MlaDims& d, int h0, int h1, float* part, float* ws),
                  (q, cache, t0, t1, kv_b, d, h0, h1, part, ws))
MD_MLA_VERSIONS(merge,
                (const float* part, int64_t split_stride, int S, const bf16* kv_b,
                 const MlaDims& d, int h0, int h1, float* out, float* acc),
                (part, split_stride, S, kv_b, d, h0, h1, out, acc))
MD_MLA_VERSIONS_E(expand_kv,
                  (const LatentCache& cache, int Tk, const float* w, int NV, int R, float* kv,
                   float* cw),
                  (cache, Tk, w, NV, R, kv, cw))
MD_MLA_VERSIONS_E(prefill_attend,
                  (const float* q, int64_t ldq, int Tq, int T0, const LatentCache& cache,
                   const float* kv, const MlaDims& d, int h, float* out, int64_t ldo, bool round,
                   float* p),
                  (q, ldq, Tq, T0, cache, kv, d, h, out, ldo, round, p))

// The cache's shape (mla.h), checked once per call. The bodies need rows of at least R + P
// elements; they would cope with any page size, but pages of whole decode blocks keep the page
// table to one look-up per block.
void check_cache(const LatentCache& c, const MlaDims& d, const char* fn) {
  MD_CHECK(c.base != nullptr && c.pages != nullptr && c.page_rows > 0 &&
               c.page_rows % kMlaBlockRows == 0 && c.ld >= d.R + d.P,
           "{}: latent cache needs a base, a page table, page_rows a positive multiple of {} "
           "(got {}) and ld >= R + P = {} (got {})",
           fn, kMlaBlockRows, c.page_rows, d.R + d.P, c.ld);
}

// Calls f(E{}) with E the cache's element type: float or bf16.
template <class F>
void with_cache_type(const LatentCache& c, F&& f) {
  if (c.bf16) {
    f(bf16{});
  } else {
    f(float{});
  }
}

}  // namespace

LatentCache LatentCache::contiguous(float* rows, int64_t ld, int64_t n) {
  static const int32_t kPage0 = 0;  // the one page
  LatentCache c;
  c.base = rows;
  c.pages = &kPage0;
  c.page_rows = static_cast<int>(
      std::max<int64_t>(kMlaBlockRows, (n + kMlaBlockRows - 1) / kMlaBlockRows * kMlaBlockRows));
  c.page_stride = static_cast<int64_t>(c.page_rows) * ld * static_cast<int64_t>(sizeof(float));
  c.ld = ld;
  c.bf16 = false;
  return c;
}

void store_latent_row(const LatentCache& c, int64_t t, const float* x, int64_t n) {
  if (c.bf16) {
    bf16* r = static_cast<bf16*>(c.row(t));
    for (int64_t i = 0; i < n; ++i) r[i] = f32_to_bf16(x[i]);
  } else {
    std::memcpy(c.row(t), x, static_cast<size_t>(n) * sizeof(float));
  }
}

const char* mla_isa() {
  return use_avx512() ? "avx512" : use_avx2() ? "avx2" : "portable";
}

void mla_decode_absorbed(const float* q, const LatentCache& cache, int T, const bf16* kv_b,
                         const MlaDims& d, int h0, int h1, float* out, float* scratch) {
  const int nh = h1 - h0;
  if (nh <= 0) return;
  if (T <= 0) {  // nothing to attend to: define the empty weighted sum as zero
    std::fill(out + static_cast<size_t>(h0) * d.V, out + static_cast<size_t>(h1) * d.V, 0.0f);
    return;
  }
  check_cache(cache, d, "mla_decode_absorbed");
  // Workspace: the partials [nh][R + 2], the absorbed queries [nh][R + P], block scores, and the
  // merge accumulator [R].
  const size_t npart = static_cast<size_t>(nh) * (d.R + 2);
  const size_t need = npart + mla_partial_scratch_floats(d, nh) + static_cast<size_t>(d.R);
  const size_t have = static_cast<size_t>(T) + 2 * static_cast<size_t>(d.R);
  float* ws = need <= have ? scratch : thread_workspace(need);
  with_cache_type(cache, [&](auto e) {
    partial<decltype(e)>(q, cache, 0, T, kv_b, d, h0, h1, ws, ws + npart);
  });
  merge(ws, 0, 1, kv_b, d, h0, h1, out, ws + npart + mla_partial_scratch_floats(d, nh));
}

size_t mla_partial_scratch_floats(const MlaDims& d, int heads) {
  return static_cast<size_t>(heads) * (d.R + d.P) + kBlockT;
}

void mla_split_rows(int T, int S, int i, int* t0, int* t1) {
  // Whole kBlockT blocks per split, so a split walks the same blocks the unsplit decode would.
  const int64_t nb = (static_cast<int64_t>(T) + kBlockT - 1) / kBlockT;
  const int64_t b0 = nb * i / S, b1 = nb * (i + 1) / S;
  *t0 = static_cast<int>(std::min<int64_t>(T, b0 * kBlockT));
  *t1 = static_cast<int>(std::min<int64_t>(T, b1 * kBlockT));
}

void mla_decode_partial(const float* q, const LatentCache& cache, int t0, int t1, const bf16* kv_b,
                        const MlaDims& d, int h0, int h1, float* part, float* scratch) {
  if (h1 <= h0) return;
  if (t1 > t0) check_cache(cache, d, "mla_decode_partial");
  with_cache_type(cache, [&](auto e) {
    partial<decltype(e)>(q, cache, t0, std::max(t0, t1), kv_b, d, h0, h1, part, scratch);
  });
}

void mla_decode_merge(const float* part, int64_t split_stride, int S, const bf16* kv_b,
                      const MlaDims& d, int h0, int h1, float* out, float* scratch) {
  if (h1 <= h0) return;
  merge(part, split_stride, S, kv_b, d, h0, h1, out, scratch);
}

namespace {

template <class E>
void prefill_heads(const float* q, int64_t ldq, int Tq, int T0, const LatentCache& cache,
                   const bf16* kv_b, const MlaDims& d, int h0, int h1, float* out, int64_t ldo,
                   bool round_bf16) {
  const int NV = d.N + d.V;
  const int Tk = T0 + Tq;  // cache rows any new token can see
  const size_t nw = static_cast<size_t>(NV) * d.R, nkv = static_cast<size_t>(Tk) * NV;
  // This head's kv_b rows, then [t][k_nope (N) ; v (V)], [Tk] probabilities, and 2 R floats for a
  // widened pair of bf16 latents (expand_kv).
  float* w = prefill_workspace(nw + nkv + static_cast<size_t>(Tk) + 2 * static_cast<size_t>(d.R));
  float* kv = w + nw;
  float* p = kv + nkv;
  float* cw = p + Tk;
  for (int h = h0; h < h1; ++h) {
    const bf16* wh = kv_b + static_cast<size_t>(h) * NV * d.R;
    for (size_t i = 0; i < nw; ++i) w[i] = bf16_to_f32(wh[i]);
    // k_nope and v of every visible cache row, once per head: every query of the chunk reuses
    // them, as the reference's kv_b_proj over the whole cache does.
    expand_kv<E>(cache, Tk, w, NV, d.R, kv, cw);
    if (round_bf16) {
      for (size_t i = 0; i < nkv; ++i) kv[i] = md::round_bf16(kv[i]);
    }
    prefill_attend<E>(q, ldq, Tq, T0, cache, kv, d, h, out, ldo, round_bf16, p);
  }
}

}  // namespace

void mla_prefill(const float* q, int64_t ldq, int Tq, int T0, const LatentCache& cache,
                 const bf16* kv_b, const MlaDims& d, int h0, int h1, float* out, int64_t ldo,
                 bool round_bf16) {
  if (Tq <= 0 || h1 <= h0) return;
  check_cache(cache, d, "mla_prefill");
  with_cache_type(cache, [&](auto e) {
    prefill_heads<decltype(e)>(q, ldq, Tq, T0, cache, kv_b, d, h0, h1, out, ldo, round_bf16);
  });
}

}  // namespace md::cpu
