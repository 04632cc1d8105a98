#include "megadecode/kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "megadecode/base/bf16.h"

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

void silu_mul(const float* gate, const float* up, int64_t n, float* out, bool round) {
  if (round) {
    for (int64_t i = 0; i < n; ++i) {
      float s = round_bf16(gate[i] * sigmoidf(gate[i]));
      out[i] = round_bf16(s * up[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * sigmoidf(gate[i]) * up[i];
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
  std::vector<float> s(E), choice(E);
  for (int e = 0; e < E; ++e) {
    s[e] = sigmoidf(logits[e]);
    choice[e] = s[e] + bias[e];
  }
  // Higher score first; equal scores: lower id first.
  auto better = [&](int a, int b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); };
  if (p.num_groups > 1) {
    const int per = E / p.num_groups;
    std::vector<float> gscore(p.num_groups);
    for (int g = 0; g < p.num_groups; ++g) {
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
    std::vector<int> gorder(p.num_groups);
    std::iota(gorder.begin(), gorder.end(), 0);
    std::stable_sort(gorder.begin(), gorder.end(),
                     [&](int a, int b) { return gscore[a] > gscore[b]; });
    std::vector<char> keep(p.num_groups, 0);
    for (int i = 0; i < p.topk_groups; ++i) keep[gorder[i]] = 1;
    for (int e = 0; e < E; ++e)
      if (!keep[e / per]) choice[e] = -INFINITY;
  }
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + p.top_k, order.end(), better);
  std::sort(order.begin(), order.begin() + p.top_k);
  float sum = 0;
  for (int i = 0; i < p.top_k; ++i) {
    int e = order[i];
    ids[i] = e;
    weights[i] = p.biased_weights ? s[e] + bias[e] : s[e];
    sum += weights[i];
  }
  for (int i = 0; i < p.top_k; ++i) {
    if (p.renormalize) weights[i] /= (sum + 1e-20f);
    weights[i] *= p.scaling;
  }
}

}  // namespace md::cpu
