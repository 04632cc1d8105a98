// Small element-wise and reduction kernels shared by the KDA, MLA and FFN paths: RMSNorm,
// activations, bf16 rounding, and the sigmoid top-k router.
#pragma once
#include <cstdint>

namespace md::cpu {

// Rounds n floats in place through bf16 (round to nearest even), emulating a bf16 tensor.
void round_bf16_inplace(float* x, int64_t n);

// y = x * rsqrt(mean(x^2) + eps) * w over n values (statistics in fp32 or better). With
// round_bf16, the normalised value is rounded to bf16 before the weight multiply and the product
// rounded again, as the reference's RMSNorm does for bf16 activations.
void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* y, bool round_bf16);

// out[i] = silu(gate[i]) * up[i]; with round_bf16 the SiLU output and the product are rounded to
// bf16 (the reference computes both in bf16).
void silu_mul(const float* gate, const float* up, int64_t n, float* out, bool round_bf16);

// SiTU-GLU (Kimi K3's hidden_act "situ"): out[i] = beta * tanh(g / beta) * sigmoid(g) * u', with
// u' = linear_beta * tanh(u / linear_beta) when linear_beta > 0, else u (g = gate[i], u = up[i]).
// Computed in fp32 from the (bf16-valued) inputs; with round_bf16 the result alone is rounded, as
// the official SituAndMul computes in fp32 and casts back once.
void situ_mul(const float* gate, const float* up, int64_t n, float beta, float linear_beta,
              float* out, bool round_bf16);

// Sigmoid output gate: x[i] <- x[i] * sigmoid(gate[i]). With round_bf16 the sigmoid and the
// product are rounded to bf16 (a bf16 sigmoid, then a bf16 multiply), as K3's MLA output gate.
void sigmoid_gate_inplace(float* x, const float* gate, int64_t n, bool round_bf16);

inline float sigmoidf(float x) {
  return 1.0f / (1.0f + __builtin_expf(-x));
}

// Largest num_experts route_topk supports (it works in fixed stack buffers of this size; Kimi K3
// has 896). Config parsing rejects models above it.
inline constexpr int kMaxRouterExperts = 2048;

struct RouterParams {
  int num_experts = 0;
  int top_k = 0;
  int num_groups = 1;  // grouped top-k: pick topk_groups groups by the sum of their top-2 scores
  int topk_groups = 1;
  bool renormalize = true;
  float scaling = 1.0f;
  bool biased_weights = false;  // weights from s + bias instead of s (original remote code)
};

// Sigmoid routing with a score-correction bias (noaux_tc). logits: [E] fp32; bias: [E].
// Chooses top_k experts by sigmoid(logit) + bias (ties: lowest id); weights are the unbiased
// sigmoid scores of those experts, renormalised to sum 1 (+1e-20) if requested, times scaling.
// ids/weights are written sorted by ascending expert id (the reference's accumulation order).
// Requires 1 <= top_k <= num_experts <= kMaxRouterExperts and 1 <= topk_groups <= num_groups <=
// num_experts (md::Error otherwise). Does not allocate.
void route_topk(const float* logits, const float* bias, const RouterParams& p, int* ids,
                float* weights);

}  // namespace md::cpu
