// Kimi Delta Attention kernels (as transformers' kimi_linear and fla compute it). Layout conventions: a KDA layer has H heads of
// dimension K (= V); per-token projections q, k, v, f (decay gate pre-activation) and the output
// gate are vectors of C = H*K floats, channel c = h*K + i. The recurrent state of one head is
// S[K][V] fp32, row index = key dimension. All math here is fp32.
#pragma once
#include <cstdint>

namespace md::cpu {

// Causal depthwise conv of width W followed by SiLU, for one new token, on channels [c0, c1).
// x: the token's pre-conv inputs [C]; cache: the previous W-1 pre-conv inputs, [W-1][C], oldest
// first (it is shifted and the new input appended); weight: [C][W] fp32, tap W-1 multiplies the
// current token. out[c] = silu(sum_j weight[c][j] * window[j]).
// round_bf16: round the conv result and the SiLU output to bf16 as the bf16 reference does.
// W is at most kMaxShortConvWidth (checked when the config is parsed and by short_conv_prefill).
inline constexpr int kMaxShortConvWidth = 64;
void short_conv_decode(const float* x, float* cache, const float* weight, int W, int64_t C,
                       int64_t c0, int64_t c1, float* out, bool round_bf16);

// The same for T consecutive tokens x[T][C] (row stride ldx) starting from `cache`; writes
// out[T][C] (row stride ldo) and leaves in cache the last W-1 inputs (cache then seeds decode).
void short_conv_prefill(const float* x, int T, int64_t ldx, float* cache, const float* weight,
                        int W, int64_t C, int64_t c0, int64_t c1, float* out, int64_t ldo,
                        bool round_bf16);

// Decay gate, in place on channels [c0, c1): f[c] <- -exp(A_log[c / K]) * softplus(f[c] +
// dt_bias[c]), softplus(x) = x for x > 20 (the reference's threshold). Result <= 0.
void kda_decay_gate(float* f, const float* A_log, const float* dt_bias, int K, int64_t c0,
                    int64_t c1);

// Kimi K3's lower-bounded ("safe") decay gate, in place on channels [c0, c1):
// f[c] <- lower_bound * sigmoid(exp(A_log[c / K]) * (f[c] + dt_bias[c])), all fp32. The result
// lies in (lower_bound, 0), so every decay exp(g) is in (exp(lower_bound), 1).
void kda_decay_gate_bounded(float* f, const float* A_log, const float* dt_bias, int K,
                            float lower_bound, int64_t c0, int64_t c1);

// One decode step of one head: q, k, v, g are that head's K values (g = log decay, <= 0), beta its
// scalar write strength. q and k are L2-normalised here (x / sqrt(sum x^2 + 1e-6)), q scaled by
// K^-0.5; then S = diag(exp(g)) S; u = v - S^T k; S += k (beta u)^T; o = S^T q.
void kda_decode_head(float* S, const float* q, const float* k, const float* v, const float* g,
                     float beta, int K, float* o);

// T tokens of one head from state S (updated in place to the state after the last token), using
// the chunked form with chunk size `chunk` (64 in the reference); equal to T decode steps in exact
// arithmetic. q, k, v, g: [T][*] with row stride ld (the head's K values start at each row);
// beta: [T] with stride ldb; o: [T][*] with stride ldo.
void kda_prefill_head(float* S, const float* q, const float* k, const float* v, const float* g,
                      const float* beta, int64_t ldb, int T, int K, int64_t ld, float* o,
                      int64_t ldo, int chunk = 64);

// Per-head gated output norm for heads [h0, h1) of one token: o[h*K+i] <- o_i * rsqrt(mean(o^2)
// + eps) * w[i] * sigmoid(gate[h*K+i]) (all fp32, the reference's "strict fp32" gated norm).
void kda_gated_norm(float* o, const float* gate, const float* w, int K, int h0, int h1,
                    float eps);

// Which implementation the KDA kernels use at the active ISA level (cpu_features.h): "avx512" at
// the avx512 and avx512bf16 levels, "portable" below (there is no AVX2 copy).
const char* kda_isa();

}  // namespace md::cpu
