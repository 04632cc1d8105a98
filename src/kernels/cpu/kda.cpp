// Kimi Delta Attention kernels (kda.h). The O(K^2) work of the decode step and all the
// exponentials and products of the chunked prefill go through five primitives (decode_state,
// gemm_rows, pair_coeffs, decay_vectors, decayed_keys) that exist twice: portable loops here,
// written so that the compiler vectorises them for the baseline ISA, and AVX-512 versions in
// kda_avx512.cpp, chosen at run time from the ISA level (cpu_features.h: the avx512 level and
// above; the avx2 level runs the portable primitives compiled for AVX2, see MD_KDA_VERSIONS).
// Everything around them (q/k normalisation, cumulative decays, the per-chunk bookkeeping) is
// shared, so both paths compute the same algorithm and differ only in summation order and FMA
// contraction.
#include "megadecode/kernels/cpu/kda.h"

#include "fast_exp.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/cpu_features.h"

namespace md::cpu {

// The AVX-512 primitives (kda_avx512.cpp, compiled for the avx512 level: AVX-512 F/BW/VL/DQ). Same
// contracts as the portable versions below; decode_state and gemm_rows additionally need K (resp.
// N) % 16 == 0. A mismatch between these declarations and the definitions is a link error (the
// types are mangled).
namespace kda_avx512 {
void decode_state(float* S, const float* ck, const float* cq, const float* eg, const float* kn,
                  const float* v, float beta, float kq, int K, float* o);
void gemm_rows(int M, int N, int P, const float* A, int64_t lda, const float* B, int64_t ldb,
               float* C, int64_t ldc, const float* c_scale, bool accumulate, int diag);
void pair_coeffs(int L, int K, const float* gc, const float* qn, const float* kn, const float* beta,
                 const float* gcT, const float* kT, int64_t ldt, float* A, float* P, int64_t ldp);
void decay_vectors(int64_t n, const float* g, const float* kn, const float* qn, float* eg,
                   float* ck, float* cq);
void decayed_keys(int K, int n, const float* g0, const float* gcT, const float* kT, int64_t ldt,
                  float* out);
}  // namespace kda_avx512

namespace {

// Column tile of the portable primitives: bounds the stack accumulators for any K.
constexpr int kTile = 256;

// Token block of the intra-chunk coefficients (the AVX-512 vector width; kda_avx512.cpp assumes
// it): exponentials are formed directly within a block and factored across blocks.
constexpr int kBlock = 16;

// ---------------------------------------------------------------------------------------------
// Portable primitives: the bodies, compiled once per ISA below (MD_KDA_VERSIONS).

// Rows of the state prefetched ahead of a decode step's first pass (one 4 KiB page at K = 128).
constexpr int kStateRowsAhead = 8;

// One decode step on the state, given the prepared per-key vectors (see kda_decode_head):
//   kv = S^T ck, oa = S^T cq  (ck = exp(g)*k, cq = exp(g)*q: the decayed state, never formed)
//   d = beta * (v - kv);  o = oa + (k.q) d  (= (diag(exp(g)) S + k d^T)^T q)
//   S = diag(eg) S + k d^T
// Two passes over S because d depends on every row of the decayed state.
[[gnu::always_inline]] inline void decode_state_body(float* S, const float* ck, const float* cq,
                                                     const float* eg, const float* kn,
                                                     const float* v, float beta, float kq, int K,
                                                     float* o) {
  for (int c0 = 0; c0 < K; c0 += kTile) {
    const int n = std::min(kTile, K - c0);
    float kv[kTile], oa[kTile], d[kTile];
    std::fill_n(kv, n, 0.0f);
    std::fill_n(oa, n, 0.0f);
    for (int i = 0; i < K; ++i) {
      const float* s = S + int64_t{i} * K + c0;
      // The state comes from DRAM once a step; request it kStateRowsAhead rows ahead, past the
      // hardware prefetchers' 4 KiB page boundaries (kda_avx512.cpp; prefetch only).
      if (i + kStateRowsAhead < K)
        for (int j = 0; j < n; j += 16) __builtin_prefetch(s + int64_t{kStateRowsAhead} * K + j);
      const float a = ck[i], b = cq[i];
      for (int j = 0; j < n; ++j) {
        kv[j] += a * s[j];
        oa[j] += b * s[j];
      }
    }
    for (int j = 0; j < n; ++j) {
      d[j] = beta * (v[c0 + j] - kv[j]);
      o[c0 + j] = oa[j] + kq * d[j];
    }
    for (int i = 0; i < K; ++i) {
      float* s = S + int64_t{i} * K + c0;
      const float e = eg[i], kk = kn[i];
      for (int j = 0; j < n; ++j) s[j] = e * s[j] + kk * d[j];
    }
  }
}

// C[m][0:N] = init_m + sum_{p < min(P, m + diag)} A[m][p] * B[p][0:N] for m = 0..M-1, where
// init_m = 0 (!accumulate), C[m] (c_scale null) or c_scale[m] * C[m]. diag = P gives a full
// product, 1 a lower-triangular A, 0 a strictly lower one. Rows are finished in increasing m, so
// with diag = 0 B may be C itself: that is forward substitution for (I - A) X = C.
[[gnu::always_inline]] inline void gemm_rows_body(int M, int N, int P, const float* A, int64_t lda,
                                                  const float* B, int64_t ldb, float* C,
                                                  int64_t ldc, const float* c_scale,
                                                  bool accumulate, int diag) {
  for (int c0 = 0; c0 < N; c0 += kTile) {
    const int n = std::min(kTile, N - c0);
    float acc[kTile];
    for (int m = 0; m < M; ++m) {
      float* c = C + m * ldc + c0;
      if (!accumulate) {
        std::fill_n(acc, n, 0.0f);
      } else {
        const float sc = c_scale ? c_scale[m] : 1.0f;
        for (int j = 0; j < n; ++j) acc[j] = sc * c[j];
      }
      const float* a = A + m * lda;
      const int pe = std::min(P, m + diag);
      for (int p = 0; p < pe; ++p) {
        const float ap = a[p];
        const float* b = B + p * ldb + c0;
        for (int j = 0; j < n; ++j) acc[j] += ap * b[j];
      }
      std::copy_n(acc, n, c);
    }
  }
}

// Intra-chunk coefficients of the diagonal blocks: for t in [0, L) and s in [sb(t), t], sb(t) =
// t rounded down to a multiple of kBlock, with E_ts = exp(gc_t - gc_s) (<= 1):
//   A[t][s] = -beta_t sum_i k_t[i] k_s[i] E_ts[i]   (used for s < t; the diagonal is junk)
//   P[t][s] =         sum_i q_t[i] k_s[i] E_ts[i]
// gc, qn, kn are [L][K]; gcT, kT hold gc and kn transposed ([K][ldt]) so that the inner loop runs
// over s with unit stride and no reduction. Entries with s > t are left unspecified; blocks below
// the diagonal are products of factored exponentials (see intra_chunk_coeffs).
[[gnu::always_inline]] inline void pair_coeffs_body(int L, int K, const float* gc, const float* qn,
                                                    const float* kn, const float* beta,
                                                    const float* gcT, const float* kT, int64_t ldt,
                                                    float* A, float* P, int64_t ldp) {
  for (int t = 0; t < L; ++t) {
    const int sb = t / kBlock * kBlock;
    float* __restrict a = A + t * ldp;
    float* __restrict p = P + t * ldp;
    std::fill(a + sb, a + t + 1, 0.0f);
    std::fill(p + sb, p + t + 1, 0.0f);
    for (int i = 0; i < K; ++i) {
      const float gt = gc[int64_t{t} * K + i];
      const float ca = -beta[t] * kn[int64_t{t} * K + i];
      const float cq = qn[int64_t{t} * K + i];
      const float* __restrict gs = gcT + i * ldt;
      const float* __restrict ks = kT + i * ldt;
      for (int s = sb; s <= t; ++s) {
        const float ke = ks[s] * fast_exp(gt - gs[s]);
        a[s] += ca * ke;
        p[s] += cq * ke;
      }
    }
  }
}

// eg = exp(g), ck = eg * kn, cq = eg * qn for n elements. The restrict parameters spare the
// vectorised loop the run-time alias checks (GCC gives up when there are more than 10 pairs).
[[gnu::always_inline]] inline void decay_vectors_body(int64_t n, const float* __restrict g,
                                                      const float* __restrict kn,
                                                      const float* __restrict qn,
                                                      float* __restrict eg, float* __restrict ck,
                                                      float* __restrict cq) {
  for (int64_t i = 0; i < n; ++i) {
    const float e = fast_exp(g[i]);
    eg[i] = e;
    ck[i] = e * kn[i];
    cq[i] = e * qn[i];
  }
}

// out[i][s] = kT[i][s] exp(g0[i] - gcT[i][s]) for i < K, s < n (rows of stride ldt): keys of
// tokens s decayed up to a later token whose cumulative decay is g0 (so the argument is <= 0).
[[gnu::always_inline]] inline void decayed_keys_row(float g0, const float* __restrict gs,
                                                    const float* __restrict ks, int n,
                                                    float* __restrict out) {
  for (int s = 0; s < n; ++s) out[s] = ks[s] * fast_exp(g0 - gs[s]);
}

[[gnu::always_inline]] inline void decayed_keys_body(int K, int n, const float* g0,
                                                     const float* gcT, const float* kT, int64_t ldt,
                                                     float* out) {
  for (int i = 0; i < K; ++i) {
    decayed_keys_row(g0[i], gcT + i * ldt, kT + i * ldt, n, out + i * ldt);
  }
}

// One copy of each primitive per instruction set, compiled from the same always-inline body (as
// mla.cpp's): for the build's baseline (SSE2 on x86-64: the compiler vectorises the loops 4 floats
// wide) and for AVX2 + FMA (8 wide, multiply-adds fused), picked at run time from the ISA level
// (the avx2 level; avx512 and above take kda_avx512.cpp's). The copies differ by rounding only,
// as the AVX-512 primitives do. On an AVX2-only AMD EPYC (Zen 2) the AVX2 copy took the decode
// step's KDA tiles from ~18.4 to ~15.6 ms a step (summed over 2 workers; the state's memory
// traffic bounds the rest) and a 256-token prefill ~8% faster (bench/RESULTS.md, session 19).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MD_KDA_VERSIONS(name, params, args)                     \
  void name##_portable params {                                 \
    name##_body args;                                           \
  }                                                             \
  __attribute__((target("avx2,fma"))) void name##_avx2 params { \
    name##_body args;                                           \
  }
#define MD_KDA_HAS_AVX2 1
#else
#define MD_KDA_VERSIONS(name, params, args) \
  void name##_portable params {             \
    name##_body args;                       \
  }
#endif

// clang-format off
MD_KDA_VERSIONS(decode_state,
                (float* S, const float* ck, const float* cq, const float* eg, const float* kn,
                 const float* v, float beta, float kq, int K, float* o),
                (S, ck, cq, eg, kn, v, beta, kq, K, o))
MD_KDA_VERSIONS(gemm_rows,
                (int M, int N, int P, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc, const float* c_scale, bool accumulate, int diag),
                (M, N, P, A, lda, B, ldb, C, ldc, c_scale, accumulate, diag))
MD_KDA_VERSIONS(pair_coeffs,
                (int L, int K, const float* gc, const float* qn, const float* kn,
                 const float* beta, const float* gcT, const float* kT, int64_t ldt, float* A,
                 float* P, int64_t ldp),
                (L, K, gc, qn, kn, beta, gcT, kT, ldt, A, P, ldp))
MD_KDA_VERSIONS(decay_vectors,
                (int64_t n, const float* g, const float* kn, const float* qn, float* eg, float* ck,
                 float* cq),
                (n, g, kn, qn, eg, ck, cq))
MD_KDA_VERSIONS(decayed_keys,
                (int K, int n, const float* g0, const float* gcT, const float* kT, int64_t ldt,
                 float* out),
                (K, n, g0, gcT, kT, ldt, out))
// clang-format on

// ---------------------------------------------------------------------------------------------
// Dispatch.

bool use_avx512() {
  return active_isa() >= Isa::kAvx512;
}

bool use_avx2() {
#ifdef MD_KDA_HAS_AVX2
  return active_isa() >= Isa::kAvx2;
#else
  return false;
#endif
}

struct Prims {
  decltype(&decode_state_portable) decode_state;
  decltype(&gemm_rows_portable) gemm_rows;
  decltype(&pair_coeffs_portable) pair_coeffs;
  decltype(&decay_vectors_portable) decay_vectors;
  decltype(&decayed_keys_portable) decayed_keys;
};

// The primitives for rows of K floats: decode_state and gemm_rows (whose rows are K long, or a
// multiple of 16 in the prefill's block products) need the AVX-512 vector width to divide K.
Prims prims(int K) {
  if (!use_avx512()) {
#ifdef MD_KDA_HAS_AVX2
    if (use_avx2())
      return {decode_state_avx2, gemm_rows_avx2, pair_coeffs_avx2, decay_vectors_avx2,
              decayed_keys_avx2};
#endif
    return {decode_state_portable, gemm_rows_portable, pair_coeffs_portable, decay_vectors_portable,
            decayed_keys_portable};
  }
  const bool rows = K % 16 == 0;
  return {rows ? kda_avx512::decode_state : decode_state_portable,
          rows ? kda_avx512::gemm_rows : gemm_rows_portable, kda_avx512::pair_coeffs,
          kda_avx512::decay_vectors, kda_avx512::decayed_keys};
}

// ---------------------------------------------------------------------------------------------
// Shared helpers.

// Per-thread scratch, 64-byte aligned, grown on demand: the prefill needs a few hundred KiB per
// call, which malloc would hand back to the OS (mmap threshold) and fault in again every call.
float* scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n + 16) buf.resize(n + 16);
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t{63});
}

size_t round16(size_t n) {
  return (n + 15) / 16 * 16;
}

// sum a[i] * b[i] in double through 8 interleaved partial sums: one running sum would be a chain
// of dependent adds that costs as much as a small head's O(K^2) work, while a fixed interleaving
// vectorises and stays deterministic.
double dot_f64(const float* a, const float* b, int n) {
  double acc[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += double{a[i + j]} * double{b[i + j]};
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += double{a[i]} * double{b[i]};
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// The reference's l2norm (x / sqrt(sum x^2 + 1e-6), a division, in fp32) followed by the query
// scale; the sum of squares is taken in double, at least as accurate as torch's reduction.
void l2norm_scaled(const float* x, int K, float scale, float* out) {
  const float n = std::sqrt(static_cast<float>(dot_f64(x, x, K)) + 1e-6f);
  for (int i = 0; i < K; ++i) out[i] = x[i] / n * scale;
}

// The reference multiplies by the Python float 1 / K ** 0.5, which torch applies in fp32.
float query_scale(int K) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(K)));
}

inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}
inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

// The bf16 reference rounds the conv output (a bf16 tensor) and then SiLU's output.
inline float conv_activation(float acc, bool round) {
  if (!round) return silu(acc);
  return round_bf16(silu(round_bf16(acc)));
}

}  // namespace

const char* kda_isa() {
  return use_avx512() ? "avx512" : use_avx2() ? "avx2" : "portable";
}

// ---------------------------------------------------------------------------------------------
// Short convolution.

void short_conv_decode(const float* x, float* cache, const float* weight, int W, int64_t C,
                       int64_t c0, int64_t c1, float* out, bool round_bf16) {
  for (int64_t c = c0; c < c1; ++c) {
    const float* w = weight + c * W;
    // Oldest tap first, as the convolution window is laid out.
    float acc = 0.0f;
    for (int j = 0; j < W - 1; ++j) acc += w[j] * cache[j * C + c];
    acc += w[W - 1] * x[c];
    for (int j = 0; j + 1 < W - 1; ++j) cache[j * C + c] = cache[(j + 1) * C + c];
    if (W > 1) cache[int64_t{W - 2} * C + c] = x[c];
    out[c] = conv_activation(acc, round_bf16);
  }
}

void short_conv_prefill(const float* x, int T, int64_t ldx, float* cache, const float* weight,
                        int W, int64_t C, int64_t c0, int64_t c1, float* out, int64_t ldo,
                        bool round_bf16) {
  if (T <= 0) return;
  // Input row tau of the stream that starts with the cache: tau < 0 is cache row W - 1 + tau.
  auto row = [&](int tau) { return tau >= 0 ? x + tau * ldx : cache + (W - 1 + tau) * C; };
  // A fixed array, not a vector: no allocation per call (the config caps the width).
  MD_CHECK(W >= 1 && W <= kMaxShortConvWidth, "short_conv_prefill: width {} not in [1, {}]", W,
           kMaxShortConvWidth);
  const float* win[kMaxShortConvWidth];
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < W; ++j) win[j] = row(t - (W - 1) + j);
    float* o = out + t * ldo;
    for (int64_t c = c0; c < c1; ++c) {
      const float* w = weight + c * W;
      float acc = 0.0f;
      for (int j = 0; j < W; ++j) acc += w[j] * win[j][c];
      o[c] = conv_activation(acc, round_bf16);
    }
  }
  // New cache row j is stream row T - (W - 1) + j. When that is still in the old cache it is old
  // row T + j > j, which increasing j has not overwritten yet, so the update can be in place.
  for (int j = 0; j < W - 1; ++j) {
    const int tau = T - (W - 1) + j;
    const float* src = tau >= 0 ? x + tau * ldx : cache + int64_t{T + j} * C;
    float* dst = cache + int64_t{j} * C;
    for (int64_t c = c0; c < c1; ++c) dst[c] = src[c];
  }
}

// ---------------------------------------------------------------------------------------------
// Gates and norm.

void kda_decay_gate(float* f, const float* A_log, const float* dt_bias, int K, int64_t c0,
                    int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    const float rate = std::exp(A_log[c / K]);
    const float x = f[c] + dt_bias[c];
    // log(1 + exp(x)) rather than log1p, as the reference writes it: for very negative x both
    // round 1 + exp(x) to 1, an absolute difference below one ulp of 1.
    const float sp = x > 20.0f ? x : std::log(1.0f + std::exp(x));
    f[c] = -rate * sp;
  }
}

void kda_decay_gate_bounded(float* f, const float* A_log, const float* dt_bias, int K,
                            float lower_bound, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    const float rate = std::exp(A_log[c / K]);
    f[c] = lower_bound * sigmoid(rate * (f[c] + dt_bias[c]));
  }
}

void kda_gated_norm(float* o, const float* gate, const float* w, int K, int h0, int h1, float eps) {
  for (int h = h0; h < h1; ++h) {
    float* x = o + int64_t{h} * K;
    const float* gt = gate + int64_t{h} * K;
    // Mean square in double: at least as accurate as torch's fp32 reduction.
    const float ms = static_cast<float>(dot_f64(x, x, K) / K);
    const float r = 1.0f / std::sqrt(ms + eps);
    for (int i = 0; i < K; ++i) x[i] = w[i] * (x[i] * r) * sigmoid(gt[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Recurrence.

void kda_decode_head(float* S, const float* q, const float* k, const float* v, const float* g,
                     float beta, int K, float* o) {
  float* buf = scratch(5 * round16(K));
  float* qn = buf;
  float* kn = qn + round16(K);
  float* eg = kn + round16(K);
  float* ck = eg + round16(K);
  float* cq = ck + round16(K);
  l2norm_scaled(q, K, query_scale(K), qn);
  l2norm_scaled(k, K, 1.0f, kn);
  const Prims pr = prims(K);
  pr.decay_vectors(K, g, kn, qn, eg, ck, cq);
  const float kq = static_cast<float>(dot_f64(kn, qn, K));
  pr.decode_state(S, ck, cq, eg, kn, v, beta, kq, K, o);
}

// Chunked form. Within a chunk of L tokens let gc_t = g_0 + ... + g_t (per key channel),
// E_ts = exp(gc_t - gc_s) for s <= t, and w_t = beta_t u_t the rank-one update of token t. Then
//   S_t = diag(exp(gc_t)) S0 + sum_{s<=t} diag(E_ts) k_s w_s^T, and from the recurrence
//   w_t + sum_{s<t} beta_t (k_t . E_ts k_s) w_s = beta_t (v_t - S0^T (exp(gc_t) k_t)),
// a unit lower-triangular system solved by forward substitution;
//   o_t = S0^T (exp(gc_t) q_t) + sum_{s<=t} (q_t . E_ts k_s) w_s,
//   S_L = diag(exp(gc_{L-1})) S0 + sum_s (E_{L-1,s} k_s) w_s^T.
// gc is non-increasing (adding g <= 0 never rounds up), so every exponential has a non-positive
// argument: nothing overflows, however long the chunk or strong the decay.

namespace {

// The coefficient matrices A (-beta_t k_t . E_ts k_s, s < t) and P (q_t . E_ts k_s, s <= t) of
// a chunk. Within a diagonal block of kBlock tokens E_ts is formed directly (pair_coeffs). Below
// it, for s < rb <= t with rb the first token of t's block, E_ts = exp(gc_t - gc_rb) *
// exp(gc_rb - gc_s): both factors lie in [E_ts, 1], so neither overflows nor underflows where
// E_ts does not, and the block becomes a [nb][K] x [K][rb] product, with K (nb + rb) instead of
// K nb rb exponentials. rT: [K][ldt] scratch; d, e, lk, lq: [kBlock][K] scratch.
void intra_chunk_coeffs(const Prims& pr, int L, int K, const float* gc, const float* qn,
                        const float* kn, const float* bt, const float* gcT, const float* kT,
                        int64_t ldt, float* rT, float* d, float* e, float* lk, float* lq, float* A,
                        float* P) {
  pr.pair_coeffs(L, K, gc, qn, kn, bt, gcT, kT, ldt, A, P, ldt);
  for (int rb = kBlock; rb < L; rb += kBlock) {
    const int nb = std::min(kBlock, L - rb);
    const float* gr = gc + int64_t{rb} * K;
    pr.decayed_keys(K, rb, gr, gcT, kT, ldt, rT);
    // Left factors: lk = k_t exp(gc_t - gc_rb) (times -beta_t below), lq = q_t exp(...).
    for (int t = 0; t < nb; ++t) {
      for (int i = 0; i < K; ++i) d[t * K + i] = gr[int64_t{t} * K + i] - gr[i];
    }
    pr.decay_vectors(int64_t{nb} * K, d, kn + int64_t{rb} * K, qn + int64_t{rb} * K, e, lk, lq);
    for (int t = 0; t < nb; ++t) {
      for (int i = 0; i < K; ++i) lk[t * K + i] *= -bt[rb + t];
    }
    pr.gemm_rows(nb, rb, K, lk, K, rT, ldt, A + rb * ldt, ldt, nullptr, false, K);
    pr.gemm_rows(nb, rb, K, lq, K, rT, ldt, P + rb * ldt, ldt, nullptr, false, K);
  }
}

}  // namespace

void kda_prefill_head(float* S, const float* q, const float* k, const float* v, const float* g,
                      const float* beta, int64_t ldb, int T, int K, int64_t ld, float* o,
                      int64_t ldo, int chunk) {
  if (T <= 0) return;
  const int CH = chunk >= 1 ? chunk : 64;
  const Prims pr = prims(K);

  // Rows of the transposed [K][ldt] and coefficient [CH][ldt] matrices are padded to whole
  // vectors, which the AVX-512 kernels load and store.
  const int64_t ldt = static_cast<int64_t>(round16(CH));
  const size_t n_tk = round16(static_cast<size_t>(CH) * K);    // a [CH][K] block
  const size_t n_kt = round16(static_cast<size_t>(K * ldt));   // a [K][ldt] block
  const size_t n_tt = round16(static_cast<size_t>(CH * ldt));  // a [CH][ldt] block
  const size_t n_bk = static_cast<size_t>(kBlock) * round16(K);
  float* buf = scratch(7 * n_tk + 2 * n_tt + 4 * n_kt + 4 * n_bk + round16(K) + ldt);
  float* qn = buf;                   // [CH][K] normalised, scaled queries
  float* kn = qn + n_tk;             // [CH][K] normalised keys
  float* gc = kn + n_tk;             // [CH][K] cumulative log decay
  float* egc = gc + n_tk;            // [CH][K] exp(gc)
  float* gk = egc + n_tk;            // [CH][K] exp(gc) * k
  float* gq = gk + n_tk;             // [CH][K] exp(gc) * q
  float* Wm = gq + n_tk;             // [CH][K] right-hand sides, then the solved w_t
  float* Am = Wm + n_tk;             // [CH][ldt]
  float* Pm = Am + n_tt;             // [CH][ldt]
  float* gcT = Pm + n_tt;            // [K][ldt]
  float* kT = gcT + n_kt;            // [K][ldt]
  float* kdT = kT + n_kt;            // [K][ldt] E_{L-1,s} k_s, transposed
  float* rT = kdT + n_kt;            // [K][ldt] scratch of intra_chunk_coeffs
  float* bd = rT + n_kt;             // 4 x [kBlock][K] scratch of intra_chunk_coeffs
  float* eg_last = bd + 4 * n_bk;    // [K]
  float* bt = eg_last + round16(K);  // [CH]
  // The vector kernels read whole rows of gcT/kT; keep the padding finite.
  std::fill(gcT, gcT + 2 * n_kt, 0.0f);

  const float qs = query_scale(K);
  for (int t0 = 0; t0 < T; t0 += CH) {
    const int L = std::min(CH, T - t0);
    for (int t = 0; t < L; ++t) {
      const int64_t r = int64_t{t0 + t} * ld;
      float* gt = gc + int64_t{t} * K;
      l2norm_scaled(q + r, K, qs, qn + int64_t{t} * K);
      l2norm_scaled(k + r, K, 1.0f, kn + int64_t{t} * K);
      // The reference's cumsum, in fp32 and in token order.
      const float* prev = t == 0 ? nullptr : gt - K;
      for (int i = 0; i < K; ++i) gt[i] = (prev ? prev[i] : 0.0f) + g[r + i];
      bt[t] = beta[(t0 + t) * ldb];
    }
    pr.decay_vectors(int64_t{L} * K, gc, kn, qn, egc, gk, gq);
    std::copy_n(egc + int64_t{L - 1} * K, K, eg_last);
    // Transposes, in strips of 16 key channels so that the 16 destination rows being filled
    // stay in L1 while the source is read contiguously.
    for (int i0 = 0; i0 < K; i0 += 16) {
      const int i1 = std::min(K, i0 + 16);
      for (int t = 0; t < L; ++t) {
        for (int i = i0; i < i1; ++i) {
          gcT[i * ldt + t] = gc[int64_t{t} * K + i];
          kT[i * ldt + t] = kn[int64_t{t} * K + i];
        }
      }
    }
    pr.decayed_keys(K, L, gc + int64_t{L - 1} * K, gcT, kT, ldt, kdT);

    float* oc = o + t0 * ldo;
    // Contributions of the incoming state: S0^T (exp(gc) k) and S0^T (exp(gc) q).
    pr.gemm_rows(L, K, K, gk, K, S, K, Wm, K, nullptr, false, K);
    pr.gemm_rows(L, K, K, gq, K, S, K, oc, ldo, nullptr, false, K);
    for (int t = 0; t < L; ++t) {
      float* w = Wm + int64_t{t} * K;
      const float* vt = v + int64_t{t0 + t} * ld;
      for (int j = 0; j < K; ++j) w[j] = bt[t] * (vt[j] - w[j]);
    }
    intra_chunk_coeffs(pr, L, K, gc, qn, kn, bt, gcT, kT, ldt, rT, bd, bd + n_bk, bd + 2 * n_bk,
                       bd + 3 * n_bk, Am, Pm);
    pr.gemm_rows(L, K, L, Am, ldt, Wm, K, Wm, K, nullptr, true, 0);    // forward substitution
    pr.gemm_rows(L, K, L, Pm, ldt, Wm, K, oc, ldo, nullptr, true, 1);  // intra-chunk output
    pr.gemm_rows(K, K, L, kdT, ldt, Wm, K, S, K, eg_last, true, L);    // state update
  }
}

}  // namespace md::cpu
