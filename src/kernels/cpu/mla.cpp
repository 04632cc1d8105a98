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
#include "mla_simd.h"

namespace md::cpu {
namespace {

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
