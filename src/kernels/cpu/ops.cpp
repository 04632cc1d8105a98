#include "megadecode/kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "fast_exp.h"
#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"

namespace md::cpu {

void round_bf16_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
}

void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* y, bool round) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  const float r = 1.0f / std::sqrt(float(ss / double(n)) + eps);
  if (round) {
    for (int64_t i = 0; i < n; ++i) y[i] = round_bf16(w[i] * round_bf16(x[i] * r));
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
  }
}

// sigmoid(g) with fast_exp_inf (fast_exp.h, within ~2 ulp of expf): a loop over it vectorises,
// where a call to expf per element cost ~1 us of a 112-row expert tile's ~19 us (bench/RESULTS.md,
// session 25). out may alias gate (each element is read before it is written).
void silu_mul(const float* gate, const float* up, int64_t n, float* out, bool round) {
  if (round) {
    for (int64_t i = 0; i < n; ++i) {
      const float g = gate[i];
      const float s = round_bf16(g * (1.0f / (1.0f + fast_exp_inf(-g))));
      out[i] = round_bf16(s * up[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float g = gate[i];
      out[i] = g * (1.0f / (1.0f + fast_exp_inf(-g))) * up[i];
    }
  }
}

void situ_mul(const float* gate, const float* up, int64_t n, float beta, float linear_beta,
              float* out, bool round) {
  const float ib = 1.0f / beta, il = linear_beta > 0 ? 1.0f / linear_beta : 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    float u = up[i];
    if (linear_beta > 0) u = linear_beta * std::tanh(u * il);
    const float v = beta * std::tanh(g * ib) * sigmoidf(g) * u;
    out[i] = round ? round_bf16(v) : v;
  }
}

void sigmoid_gate_inplace(float* x, const float* gate, int64_t n, bool round) {
  if (round) {
    for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i] * round_bf16(sigmoidf(gate[i])));
  } else {
    for (int64_t i = 0; i < n; ++i) x[i] *= sigmoidf(gate[i]);
  }
}

void route_topk(const float* logits, const float* bias, const RouterParams& p, int* ids,
                float* weights) {
  const int E = p.num_experts;
  // Fixed stack buffers instead of per-call vectors: the router runs once per token and layer on
  // the decode hot path. The bounds are validated when the config is parsed; the check here
  // (cheap next to the E sigmoids) keeps a hand-built RouterParams from overrunning them.
  MD_CHECK(E >= 1 && E <= kMaxRouterExperts && p.top_k >= 1 && p.top_k <= E &&
               p.num_groups >= 1 && p.num_groups <= E && p.topk_groups >= 1 &&
               p.topk_groups <= p.num_groups,
           "route_topk: unsupported router (experts {} (max {}), top_k {}, groups {}, topk_groups "
           "{})",
           E, kMaxRouterExperts, p.top_k, p.num_groups, p.topk_groups);
  float choice[kMaxRouterExperts];
  int order[kMaxRouterExperts];
  for (int e = 0; e < E; ++e) choice[e] = sigmoidf(logits[e]) + bias[e];
  // Higher score first; equal scores: lower id first.
  auto better = [&](int a, int b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); };
  if (p.num_groups > 1) {
    const int G = p.num_groups, per = E / G;
    float gscore[kMaxRouterExperts];
    for (int g = 0; g < G; ++g) {
      float m1 = -INFINITY, m2 = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        if (choice[e] > m1) {
          m2 = m1;
          m1 = choice[e];
        } else if (choice[e] > m2) {
          m2 = choice[e];
        }
      }
      gscore[g] = m1 + m2;
    }
    // Groups by descending score, ties by ascending index: the order a stable sort of 0..G-1
    // gives, without the temporary buffer std::stable_sort allocates.
    std::iota(order, order + G, 0);
    std::sort(order, order + G, [&](int a, int b) {
      return gscore[a] > gscore[b] || (gscore[a] == gscore[b] && a < b);
    });
    bool keep[kMaxRouterExperts] = {};
    for (int i = 0; i < p.topk_groups; ++i) keep[order[i]] = true;
    for (int e = 0; e < E; ++e)
      if (!keep[e / per]) choice[e] = -INFINITY;
  }
  std::iota(order, order + E, 0);
  std::partial_sort(order, order + p.top_k, order + E, better);
  std::sort(order, order + p.top_k);
  float sum = 0;
  for (int i = 0; i < p.top_k; ++i) {
    const int e = order[i];
    // Recomputed rather than stored: the same expression on the same input, so the same bits.
    const float s = sigmoidf(logits[e]);
    ids[i] = e;
    weights[i] = p.biased_weights ? s + bias[e] : s;
    sum += weights[i];
  }
  for (int i = 0; i < p.top_k; ++i) {
    if (p.renormalize) weights[i] /= (sum + 1e-20f);
    weights[i] *= p.scaling;
  }
}

}  // namespace md::cpu
