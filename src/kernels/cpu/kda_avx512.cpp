// AVX-512 versions of the KDA primitives (contracts in kda.cpp, which declares these functions
// and calls them only after checking for AVX-512F). The structure is the portable one with the
// accumulators held in registers: for K = V = 128 a whole state row is 8 vectors, so each state
// element is loaded once per pass instead of also loading and storing an accumulator; the
// exponentials are evaluated 16 at a time.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace md::cpu::kda_avx512 {

namespace {

// GCC 12 warns (-Wmaybe-uninitialized) inside the unmasked forms of max/min/roundscale/scalef,
// which pass _mm512_undefined_ps() as the merge source; the zero-masking forms with an all-ones
// mask are the same instructions without it.
constexpr __mmask16 kAll = 0xffff;

// exp(x) by the same reduction as the portable fast_exp, with vscalefps for the 2^n factor (it
// covers the whole range, so the clamp only keeps -inf and huge arguments away from n).
inline __m512 exp512(__m512 x) {
  x = _mm512_maskz_max_ps(kAll, x, _mm512_set1_ps(-100.0f));
  x = _mm512_maskz_min_ps(kAll, x, _mm512_set1_ps(88.5f));
  const __m512 n =
      _mm512_maskz_roundscale_ps(kAll, _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(kAll, p, n);
}

// Rows of the state requested ahead of pass 1's reads. The state (K x K fp32, 64 KiB a head at
// K = 128) comes from DRAM once a step, and the hardware prefetchers stop at every 4 KiB page
// (8 rows at K = 128): 8 rows ahead keeps a page in flight. Prefetch only: results unchanged.
constexpr int kStateRowsAhead = 8;

// Columns [c0, c0 + 16 NV) of the decode step. Pass 1 keeps 2 NV accumulators (16 for NV = 8,
// enough independent FMA chains to hide the latency); pass 2 keeps d in registers.
template <int NV>
void decode_tile(float* S, const float* ck, const float* cq, const float* eg, const float* kn,
                 const float* v, float beta, float kq, int K, int c0, float* o) {
  __m512 kv[NV], oa[NV], d[NV];
  for (int j = 0; j < NV; ++j) kv[j] = oa[j] = _mm512_setzero_ps();
  for (int i = 0; i < K; ++i) {
    const float* s = S + int64_t{i} * K + c0;
    if (i + kStateRowsAhead < K) {
      for (int j = 0; j < NV; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(s + int64_t{kStateRowsAhead} * K + 16 * j),
                     _MM_HINT_T0);
    }
    const __m512 a = _mm512_set1_ps(ck[i]), b = _mm512_set1_ps(cq[i]);
    for (int j = 0; j < NV; ++j) {
      const __m512 x = _mm512_loadu_ps(s + 16 * j);
      kv[j] = _mm512_fmadd_ps(a, x, kv[j]);
      oa[j] = _mm512_fmadd_ps(b, x, oa[j]);
    }
  }
  const __m512 vb = _mm512_set1_ps(beta), vkq = _mm512_set1_ps(kq);
  for (int j = 0; j < NV; ++j) {
    d[j] = _mm512_mul_ps(vb, _mm512_sub_ps(_mm512_loadu_ps(v + c0 + 16 * j), kv[j]));
    _mm512_storeu_ps(o + c0 + 16 * j, _mm512_fmadd_ps(vkq, d[j], oa[j]));
  }
  for (int i = 0; i < K; ++i) {
    float* s = S + int64_t{i} * K + c0;
    const __m512 e = _mm512_set1_ps(eg[i]), kk = _mm512_set1_ps(kn[i]);
    for (int j = 0; j < NV; ++j) {
      const __m512 x = _mm512_loadu_ps(s + 16 * j);
      _mm512_storeu_ps(s + 16 * j, _mm512_fmadd_ps(kk, d[j], _mm512_mul_ps(e, x)));
    }
  }
}

// Rows of gemm_rows for columns [c0, c0 + 16 NV), MR rows at a time so that each B vector
// loaded feeds MR FMAs; with NV = 4 the B panel (K rows of 64 floats, 32 KiB for K = 128) stays
// in L1 across all row groups. Row m + r's range of p exceeds row m's by at most r: the shared
// part runs jointly, then the rows are finished and stored in order, so that with diag = 0 row
// m + r reads the final rows before it (forward substitution, B aliasing C).
template <int NV, int MR>
void gemm_tile(int M, int P, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
               int64_t ldc, const float* c_scale, bool accumulate, int diag, int c0) {
  int m = 0;
  for (; m + MR <= M; m += MR) {
    __m512 acc[MR][NV];
    for (int r = 0; r < MR; ++r) {
      const float* c = C + (m + r) * ldc + c0;
      if (!accumulate) {
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
      } else {
        const __m512 sc = _mm512_set1_ps(c_scale ? c_scale[m + r] : 1.0f);
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_mul_ps(sc, _mm512_loadu_ps(c + 16 * j));
      }
    }
    const float* a = A + m * lda;
    const int pe0 = std::min(P, m + diag);
    for (int p = 0; p < pe0; ++p) {
      const float* b = B + p * ldb + c0;
      __m512 bv[NV];
      for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_ps(b + 16 * j);
      for (int r = 0; r < MR; ++r) {
        const __m512 ap = _mm512_set1_ps(a[r * lda + p]);
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(ap, bv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int p = pe0; p < std::min(P, m + r + diag); ++p) {
        const __m512 ap = _mm512_set1_ps(a[r * lda + p]);
        const float* b = B + p * ldb + c0;
        for (int j = 0; j < NV; ++j) {
          acc[r][j] = _mm512_fmadd_ps(ap, _mm512_loadu_ps(b + 16 * j), acc[r][j]);
        }
      }
      float* c = C + (m + r) * ldc + c0;
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(c + 16 * j, acc[r][j]);
    }
  }
  if (m < M) {
    gemm_tile<NV, 1>(M - m, P, A + m * lda, lda, B, ldb, C + m * ldc, ldc,
                     c_scale ? c_scale + m : nullptr, accumulate, diag + m, c0);
  }
}

// A and P entries (t, s) for the block s in [sb, sb + 16) that holds t; lanes with s > t
// contribute zero (their exponent is positive and their values are never used).
void pair_block(int t, int sb, int K, const float* gc, const float* qn, const float* kn, float bt,
                const float* gcT, const float* kT, int64_t ldt, float* a_row, float* p_row) {
  __m512 acc_a = _mm512_setzero_ps(), acc_p = _mm512_setzero_ps();
  const int valid = t + 1 - sb;  // 1..16
  const __mmask16 live = static_cast<__mmask16>(valid >= 16 ? 0xffffu : (1u << valid) - 1u);
  for (int i = 0; i < K; ++i) {
    const __m512 gt = _mm512_set1_ps(gc[int64_t{t} * K + i]);
    const __m512 ca = _mm512_set1_ps(-bt * kn[int64_t{t} * K + i]);
    const __m512 cq = _mm512_set1_ps(qn[int64_t{t} * K + i]);
    const __m512 e = exp512(_mm512_sub_ps(gt, _mm512_loadu_ps(gcT + i * ldt + sb)));
    const __m512 ke = _mm512_maskz_mul_ps(live, _mm512_loadu_ps(kT + i * ldt + sb), e);
    acc_a = _mm512_fmadd_ps(ca, ke, acc_a);
    acc_p = _mm512_fmadd_ps(cq, ke, acc_p);
  }
  _mm512_storeu_ps(a_row + sb, acc_a);
  _mm512_storeu_ps(p_row + sb, acc_p);
}

}  // namespace

void decode_state(float* S, const float* ck, const float* cq, const float* eg, const float* kn,
                  const float* v, float beta, float kq, int K, float* o) {
  // Panels of up to 8 vectors (128 columns): index = vectors in the panel.
  static constexpr decltype(&decode_tile<1>) kPanel[] = {
      nullptr,        decode_tile<1>, decode_tile<2>, decode_tile<3>, decode_tile<4>,
      decode_tile<5>, decode_tile<6>, decode_tile<7>, decode_tile<8>};
  for (int c0 = 0; c0 < K; c0 += 128) {
    kPanel[std::min(8, (K - c0) / 16)](S, ck, cq, eg, kn, v, beta, kq, K, c0, o);
  }
}

void gemm_rows(int M, int N, int P, const float* A, int64_t lda, const float* B, int64_t ldb,
               float* C, int64_t ldc, const float* c_scale, bool accumulate, int diag) {
  // Column panels of up to 4 vectors, 4 rows at a time: index = vectors in the panel.
  static constexpr decltype(&gemm_tile<1, 4>) kPanel[] = {nullptr, gemm_tile<1, 4>, gemm_tile<2, 4>,
                                                          gemm_tile<3, 4>, gemm_tile<4, 4>};
  for (int c0 = 0; c0 < N; c0 += 64) {
    kPanel[std::min(4, (N - c0) / 16)](M, P, A, lda, B, ldb, C, ldc, c_scale, accumulate, diag, c0);
  }
}

void pair_coeffs(int L, int K, const float* gc, const float* qn, const float* kn, const float* beta,
                 const float* gcT, const float* kT, int64_t ldt, float* A, float* P, int64_t ldp) {
  // Diagonal blocks only, of 16 tokens (kBlock in kda.cpp): one vector of s per row t.
  for (int t = 0; t < L; ++t) {
    pair_block(t, t / 16 * 16, K, gc, qn, kn, beta[t], gcT, kT, ldt, A + t * ldp, P + t * ldp);
  }
}

void decay_vectors(int64_t n, const float* g, const float* kn, const float* qn, float* eg,
                   float* ck, float* cq) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = static_cast<__mmask16>(n - i >= 16 ? 0xffffu : (1u << (n - i)) - 1u);
    const __m512 e = exp512(_mm512_maskz_loadu_ps(m, g + i));
    _mm512_mask_storeu_ps(eg + i, m, e);
    _mm512_mask_storeu_ps(ck + i, m, _mm512_mul_ps(e, _mm512_maskz_loadu_ps(m, kn + i)));
    _mm512_mask_storeu_ps(cq + i, m, _mm512_mul_ps(e, _mm512_maskz_loadu_ps(m, qn + i)));
  }
}

void decayed_keys(int K, int n, const float* g0, const float* gcT, const float* kT, int64_t ldt,
                  float* out) {
  for (int i = 0; i < K; ++i) {
    const __m512 g = _mm512_set1_ps(g0[i]);
    const float* gs = gcT + i * ldt;
    const float* ks = kT + i * ldt;
    float* os = out + i * ldt;
    for (int s = 0; s < n; s += 16) {
      const __mmask16 m = static_cast<__mmask16>(n - s >= 16 ? 0xffffu : (1u << (n - s)) - 1u);
      const __m512 e = exp512(_mm512_sub_ps(g, _mm512_maskz_loadu_ps(m, gs + s)));
      _mm512_mask_storeu_ps(os + s, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ks + s), e));
    }
  }
}

}  // namespace md::cpu::kda_avx512
