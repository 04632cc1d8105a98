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
#include "megadecode/kernels/cpu/mla.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "megadecode/kernels/cpu/cpu_features.h"

namespace md::cpu {
namespace {

// Cache rows per decode block: 16 rows of R + P = 576 floats are 36 KiB, which stays in a 48 KiB
// L1 together with one head's query (2.3 KiB) and output accumulator (2 KiB) while all heads of
// the range pass over the block. (Measured: 8 and 16 equal, 32 slower, 64 much slower.)
constexpr int kBlockT = 16;

// Helpers are inlined into each instruction-set copy of the bodies below.
#define MD_INLINE [[gnu::always_inline]] inline

// Explicit SIMD through GCC/Clang vector extensions, W floats per vector: 4 (SSE2 / NEON) in the
// portable copy, 8 in the AVX2 copy. Auto-vectorised scalar loops were fast at -O2 but several
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
template <int W>
using Vec = typename Simd<W>::F;

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
MD_INLINE void load_bf16(Vec<W>& v, const bf16* p) {
  typename Simd<W>::H h;
  std::memcpy(&h, p, sizeof h);
  const typename Simd<W>::U u = __builtin_convertvector(h, typename Simd<W>::U) << 16;
  std::memcpy(&v, &u, sizeof v);
}

template <int W>
MD_INLINE float hsum(const Vec<W>& v) {
  float s = 0.0f;
  for (int j = 0; j < W; ++j) s += v[j];
  return s;
}

// a . b with two vector accumulators (independent partial sums hide the add latency).
template <int W>
MD_INLINE float dot(const float* a, const float* b, int n) {
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
  acc0 += acc1;
  float s = hsum<W>(acc0);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// w . x for a bf16 row w.
template <int W>
MD_INLINE float dot_bf16(const bf16* w, const float* x, int n) {
  Vec<W> acc0 = {}, acc1 = {};
  int i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    Vec<W> w0, w1, x0, x1;
    load_bf16<W>(w0, w + i);
    load_bf16<W>(w1, w + i + W);
    load<W>(x0, x + i);
    load<W>(x1, x + i + W);
    acc0 += w0 * x0;
    acc1 += w1 * x1;
  }
  acc0 += acc1;
  float s = hsum<W>(acc0);
  for (; i < n; ++i) s += bf16_to_f32(w[i]) * x[i];
  return s;
}

// out[k] = a . b_k for four vectors b_k: each load of a serves four products.
template <int W>
MD_INLINE void dot4(const float* a, const float* b0, const float* b1, const float* b2,
                    const float* b3, int n, float* out) {
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
    s0 += a[i] * b0[i];
    s1 += a[i] * b1[i];
    s2 += a[i] * b2[i];
    s3 += a[i] * b3[i];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// Rows a0, a1 against four consecutive rows of b (row stride n): out0[k] = a0 . b_k and
// out1[k] = a1 . b_k. Six loads feed eight products.
template <int W>
MD_INLINE void dot2x4(const float* a0, const float* a1, const float* b, int n, float* out0,
                      float* out1) {
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
    for (int k = 0; k < 4; ++k) {
      s0[k] += a0[i] * bk[k][i];
      s1[k] += a1[i] * bk[k][i];
    }
  }
  for (int k = 0; k < 4; ++k) {
    out0[k] = s0[k];
    out1[k] = s1[k];
  }
}

// y += a * x.
template <int W>
MD_INLINE void axpy(float* y, const float* x, float a, int n) {
  int i = 0;
  for (; i + W <= n; i += W) {
    Vec<W> vx, vy;
    load<W>(vx, x + i);
    load<W>(vy, y + i);
    vy += a * vx;
    store<W>(y + i, vy);
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

// y += a * w for a bf16 row w.
template <int W>
MD_INLINE void axpy_bf16(float* y, const bf16* w, float a, int n) {
  int i = 0;
  for (; i + W <= n; i += W) {
    Vec<W> vw, vy;
    load_bf16<W>(vw, w + i);
    load<W>(vy, y + i);
    vy += a * vw;
    store<W>(y + i, vy);
  }
  for (; i < n; ++i) y[i] += a * bf16_to_f32(w[i]);
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

// y += sum_k p[k] * x_k over rows x_k = x + k * ldx, k in [0, nt). Four rows per pass, so y is
// loaded and stored once per four rows.
template <int W>
MD_INLINE void accumulate_rows(float* y, const float* x, int64_t ldx, int nt, const float* p,
                               int n) {
  int k = 0;
  for (; k + 4 <= nt; k += 4) {
    const float* x0 = x + k * ldx;
    const float* x1 = x0 + ldx;
    const float* x2 = x1 + ldx;
    const float* x3 = x2 + ldx;
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
    for (; i < n; ++i) y[i] += p0 * x0[i] + p1 * x1[i] + p2 * x2[i] + p3 * x3[i];
  }
  for (; k < nt; ++k) axpy<W>(y, x + k * ldx, p[k], n);
}

// s[k] = scale * (a . x_k) for rows x_k = x + k * ldx, k in [0, nt).
template <int W>
MD_INLINE void score_rows(const float* a, const float* x, int64_t ldx, int nt, int n, float scale,
                          float* s) {
  int k = 0;
  for (; k + 4 <= nt; k += 4) {
    const float* x0 = x + k * ldx;
    dot4<W>(a, x0, x0 + ldx, x0 + 2 * ldx, x0 + 3 * ldx, n, s + k);
  }
  for (; k < nt; ++k) s[k] = dot<W>(a, x + k * ldx, n);
  for (k = 0; k < nt; ++k) s[k] *= scale;
}

// Per-thread fallback workspace for when the caller's scratch (sized T + 2R by the contract, i.e.
// for one head at a time) cannot hold the state of the whole head range. Only short contexts take
// this path; it grows once per thread and is then reused.
float* thread_workspace(size_t n) {
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
template <int W>
MD_INLINE void partial_body(const float* q, const float* cache, int64_t ldc, int t0, int t1,
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
    // with its q weight: a transposed product without a transposed copy.
    std::fill(qah, qah + R, 0.0f);
    for (int n = 0; n < N; ++n) axpy_bf16<W>(qah, wuk + static_cast<size_t>(n) * R, qh[n], R);
    std::copy(qh + N, qh + N + P, qah + R);
    float* ph = part + static_cast<size_t>(hh) * PS;
    std::fill(ph, ph + R, 0.0f);
    ph[R] = -std::numeric_limits<float>::infinity();
    ph[R + 1] = 0.0f;
  }

  for (int b0 = t0; b0 < t1; b0 += kBlockT) {
    const int nt = std::min(kBlockT, t1 - b0);
    const float* rows = cache + static_cast<int64_t>(b0) * ldc;
    for (int hh = 0; hh < nh; ++hh) {
      float* olh = part + static_cast<size_t>(hh) * PS;
      float& run_max = olh[R];
      float& run_sum = olh[R + 1];
      score_rows<W>(qa + static_cast<size_t>(hh) * RP, rows, ldc, nt, RP, scale, s);
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
      accumulate_rows<W>(olh, rows, ldc, nt, s, R);
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
    for (int v = 0; v < V; ++v) oh[v] = dot_bf16<W>(wuv + static_cast<size_t>(v) * R, acc, R) * inv;
  }
}

// kv[t][j] = c_t . w_j for cache rows t in [0, Tk) and the head's N + V weight rows (fp32 copy w).
// Two cache rows by four weight rows per pass: six loads feed eight products.
template <int W>
MD_INLINE void expand_kv_body(const float* cache, int64_t ldc, int Tk, const float* w, int NV,
                              int R, float* kv) {
  int t = 0;
  for (; t + 2 <= Tk; t += 2) {
    const float* c0 = cache + static_cast<int64_t>(t) * ldc;
    float* kv0 = kv + static_cast<size_t>(t) * NV;
    int j = 0;
    for (; j + 4 <= NV; j += 4) {
      dot2x4<W>(c0, c0 + ldc, w + static_cast<size_t>(j) * R, R, kv0 + j, kv0 + NV + j);
    }
    for (; j < NV; ++j) {
      kv0[j] = dot<W>(c0, w + static_cast<size_t>(j) * R, R);
      kv0[NV + j] = dot<W>(c0 + ldc, w + static_cast<size_t>(j) * R, R);
    }
  }
  for (; t < Tk; ++t) {
    const float* c = cache + static_cast<int64_t>(t) * ldc;
    float* kvt = kv + static_cast<size_t>(t) * NV;
    int j = 0;
    for (; j + 4 <= NV; j += 4) {
      const float* w0 = w + static_cast<size_t>(j) * R;
      dot4<W>(c, w0, w0 + R, w0 + 2 * R, w0 + 3 * R, R, kvt + j);
    }
    for (; j < NV; ++j) kvt[j] = dot<W>(c, w + static_cast<size_t>(j) * R, R);
  }
}

// Causal attention of the chunk's queries for head h over the expanded rows kv.
template <int W>
MD_INLINE void prefill_attend_body(const float* q, int64_t ldq, int Tq, int T0, const float* cache,
                                   int64_t ldc, const float* kv, const MlaDims& d, int h,
                                   float* out, int64_t ldo, bool round, float* p) {
  const int N = d.N, P = d.P, V = d.V, R = d.R, NV = N + V;
  const float scale = 1.0f / std::sqrt(static_cast<float>(N + P));
  for (int i = 0; i < Tq; ++i) {
    const float* qn = q + i * ldq + static_cast<int64_t>(h) * (N + P);
    const float* qpe = qn + N;
    const int nk = T0 + i + 1;  // causal: rows [0, T0 + i]
    // Scores as the reference: q . [k_nope ; k_pe], then the scale.
    float smax = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < nk; ++t) {
      const float* kpe = cache + static_cast<int64_t>(t) * ldc + R;
      float s = dot<W>(qn, kv + static_cast<size_t>(t) * NV, N) + dot<W>(qpe, kpe, P);
      // The bf16 reference rounds the q.k matmul, then the scaled score (two bf16 tensors).
      p[t] = round ? md::round_bf16(md::round_bf16(s) * scale) : s * scale;
      smax = std::max(smax, p[t]);
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
    accumulate_rows<W>(o, kv + N, NV, nk, p, V);
  }
}

// One copy of each body per instruction set: the bodies are always_inline templates, so each
// wrapper below compiles the same source for its own target: 8-float vectors with AVX2 and FMA, or
// 4-float vectors for the build's baseline (SSE2 on x86-64). Run time picks AVX2 where the CPU has
// it. (An AVX-512 copy measured no faster: these loops are bound by loads from L1/L2, not by
// vector width.) The copies differ in lane count and fused multiply-adds, so their results differ
// by rounding only. The ISA level (cpu_features.h) picks the copy: AVX2 from the avx2 level up.
// The AVX2 copy is compiled through target attributes rather than an *_avx2.cpp file because the
// bodies are templates shared with the baseline copy; its attribute ("avx2,fma") is exactly the
// avx2 level's flags.
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

// clang-format off
#ifdef MD_MLA_X86
#define MD_MLA_VERSIONS(name, params, args)                                                \
  void name##_portable params { name##_body<4> args; }                                     \
  __attribute__((target("avx2,fma"))) void name##_avx2 params { name##_body<8> args; }     \
  void name params {                                                                       \
    if (use_avx2()) return name##_avx2 args;                                               \
    name##_portable args;                                                                  \
  }
#else
#define MD_MLA_VERSIONS(name, params, args) \
  void name params { name##_body<4> args; }
#endif
// clang-format on

MD_MLA_VERSIONS(partial,
                (const float* q, const float* cache, int64_t ldc, int t0, int t1, const bf16* kv_b,
                 const MlaDims& d, int h0, int h1, float* part, float* ws),
                (q, cache, ldc, t0, t1, kv_b, d, h0, h1, part, ws))
MD_MLA_VERSIONS(merge,
                (const float* part, int64_t split_stride, int S, const bf16* kv_b,
                 const MlaDims& d, int h0, int h1, float* out, float* acc),
                (part, split_stride, S, kv_b, d, h0, h1, out, acc))
MD_MLA_VERSIONS(expand_kv,
                (const float* cache, int64_t ldc, int Tk, const float* w, int NV, int R, float* kv),
                (cache, ldc, Tk, w, NV, R, kv))
MD_MLA_VERSIONS(prefill_attend,
                (const float* q, int64_t ldq, int Tq, int T0, const float* cache, int64_t ldc,
                 const float* kv, const MlaDims& d, int h, float* out, int64_t ldo, bool round,
                 float* p),
                (q, ldq, Tq, T0, cache, ldc, kv, d, h, out, ldo, round, p))

}  // namespace

const char* mla_isa() {
  return use_avx2() ? "avx2" : "portable";
}

void mla_decode_absorbed(const float* q, const float* cache, int64_t ldc, int T, const bf16* kv_b,
                         const MlaDims& d, int h0, int h1, float* out, float* scratch) {
  const int nh = h1 - h0;
  if (nh <= 0) return;
  if (T <= 0) {  // nothing to attend to: define the empty weighted sum as zero
    std::fill(out + static_cast<size_t>(h0) * d.V, out + static_cast<size_t>(h1) * d.V, 0.0f);
    return;
  }
  // Workspace: the partials [nh][R + 2], the absorbed queries [nh][R + P], block scores, and the
  // merge accumulator [R].
  const size_t npart = static_cast<size_t>(nh) * (d.R + 2);
  const size_t need = npart + mla_partial_scratch_floats(d, nh) + static_cast<size_t>(d.R);
  const size_t have = static_cast<size_t>(T) + 2 * static_cast<size_t>(d.R);
  float* ws = need <= have ? scratch : thread_workspace(need);
  partial(q, cache, ldc, 0, T, kv_b, d, h0, h1, ws, ws + npart);
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

void mla_decode_partial(const float* q, const float* cache, int64_t ldc, int t0, int t1,
                        const bf16* kv_b, const MlaDims& d, int h0, int h1, float* part,
                        float* scratch) {
  if (h1 <= h0) return;
  partial(q, cache, ldc, t0, std::max(t0, t1), kv_b, d, h0, h1, part, scratch);
}

void mla_decode_merge(const float* part, int64_t split_stride, int S, const bf16* kv_b,
                      const MlaDims& d, int h0, int h1, float* out, float* scratch) {
  if (h1 <= h0) return;
  merge(part, split_stride, S, kv_b, d, h0, h1, out, scratch);
}

void mla_prefill(const float* q, int64_t ldq, int Tq, int T0, const float* cache, int64_t ldc,
                 const bf16* kv_b, const MlaDims& d, int h0, int h1, float* out, int64_t ldo,
                 bool round_bf16) {
  if (Tq <= 0 || h1 <= h0) return;
  const int NV = d.N + d.V;
  const int Tk = T0 + Tq;  // cache rows any new token can see
  const size_t nw = static_cast<size_t>(NV) * d.R, nkv = static_cast<size_t>(Tk) * NV;
  float* w = prefill_workspace(nw + nkv + static_cast<size_t>(Tk));  // this head's kv_b rows
  float* kv = w + nw;                                                 // [t][k_nope (N) ; v (V)]
  float* p = kv + nkv;                                                // [Tk] probabilities
  for (int h = h0; h < h1; ++h) {
    const bf16* wh = kv_b + static_cast<size_t>(h) * NV * d.R;
    for (size_t i = 0; i < nw; ++i) w[i] = bf16_to_f32(wh[i]);
    // k_nope and v of every visible cache row, once per head: every query of the chunk reuses
    // them, as the reference's kv_b_proj over the whole cache does.
    expand_kv(cache, ldc, Tk, w, NV, d.R, kv);
    if (round_bf16) {
      for (size_t i = 0; i < nkv; ++i) kv[i] = md::round_bf16(kv[i]);
    }
    prefill_attend(q, ldq, Tq, T0, cache, ldc, kv, d, h, out, ldo, round_bf16, p);
  }
}

}  // namespace md::cpu
