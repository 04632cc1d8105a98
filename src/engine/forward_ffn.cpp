// FFN layers of the reference forward path: the dense gated MLP and the sigmoid-routed MoE, with
// K3's options (SiTU activation, latent MoE with its norm, MXFP4 routed experts).
#include <algorithm>
#include <vector>

#include "forward.h"
#include "megadecode/base/bf16.h"
#include "megadecode/kernels/cpu/expert_slots.h"

namespace md::fwd {

void Forward::dense_ffn(const FfnWeights& f, const float* h, int T, float* out) const {
  const int64_t D = c.hidden_size, I = f.gate.rows;
  std::vector<float> g(T * I), u(T * I);
  matmuls({{&f.gate, h, D, g.data(), I, T}, {&f.up, h, D, u.data(), I, T}});
  round(g.data(), T * I);
  round(u.data(), T * I);
  glu(num, g.data(), u.data(), T * I, g.data());
  matmuls({{&f.down, g.data(), I, out, D, T}});
  round(out, T * D);
}

void Forward::moe(int l, const float* h, int T, float* out) const {
  const MoeWeights& mw = w.layers[l].moe;
  const int E = c.num_experts, k = c.num_experts_per_token;
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size, X = c.expert_dim();
  const bool latent = c.latent_size > 0;
  std::vector<float> logits(T * E);
  matmuls({{&mw.router, h, D, logits.data(), E, T}});
  const cpu::RouterParams& rp = num.router;
  std::vector<int> ids(T * k);
  std::vector<float> wts(T * k);
  for (int t = 0; t < T; ++t)
    cpu::route_topk(logits.data() + t * E, mw.router_bias.data(), rp, ids.data() + t * k,
                    wts.data() + t * k);

  // Latent MoE: the router reads the hidden state, the routed experts its projection z [T][X].
  std::vector<float> z;
  const float* xsrc = h;
  if (latent) {
    z.resize(size_t(T) * size_t(X));
    matmuls({{&mw.latent_down, h, D, z.data(), X, T}});
    round(z.data(), T * X);
    xsrc = z.data();
  }

  // Group the (token, slot) pairs by expert, in ascending expert id (the reference's order).
  struct Group {
    int expert;
    std::vector<int> tokens, slots;
  };
  std::vector<Group> groups;
  {
    std::vector<int> where(E, -1), mark(static_cast<size_t>(E));
    std::vector<int32_t> list(static_cast<size_t>(E));
    const int nd = cpu::distinct_experts(ids.data(), size_t(k), T, k, E, mark.data(), list.data());
    for (int g = 0; g < nd; ++g) {
      where[list[size_t(g)]] = g;
      groups.push_back({list[size_t(g)], {}, {}});
    }
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) {
        Group& g = groups[where[ids[t * k + j]]];
        g.tokens.push_back(t);
        g.slots.push_back(j);
      }
  }
  const int G = int(groups.size());
  std::vector<int64_t> off(G + 1, 0);
  for (int g = 0; g < G; ++g) off[g + 1] = off[g] + int64_t(groups[g].tokens.size());
  const int64_t rows = off[G];
  std::vector<float> xin(rows * X), gt(rows * I), up(rows * I), dn(rows * X);
  for (int g = 0; g < G; ++g)
    for (size_t i = 0; i < groups[g].tokens.size(); ++i)
      std::copy(xsrc + groups[g].tokens[i] * X, xsrc + (groups[g].tokens[i] + 1) * X,
                xin.data() + (off[g] + int64_t(i)) * X);

  const bool shared = mw.has_shared;
  const int64_t IS = shared ? mw.shared.gate.rows : 0;
  std::vector<float> sg(T * IS), su(T * IS), sd(T * D);
  std::vector<MatJob> jobs;
  for (int g = 0; g < G; ++g) {
    const FfnWeights& f = mw.experts[groups[g].expert];
    int n = int(off[g + 1] - off[g]);
    jobs.push_back({&f.gate, xin.data() + off[g] * X, X, gt.data() + off[g] * I, I, n});
    jobs.push_back({&f.up, xin.data() + off[g] * X, X, up.data() + off[g] * I, I, n});
  }
  if (shared) {
    jobs.push_back({&mw.shared.gate, h, D, sg.data(), IS, T});
    jobs.push_back({&mw.shared.up, h, D, su.data(), IS, T});
  }
  run_matmuls(pool, jobs, rnd());
  for (auto* b : {&gt, &up, &sg, &su}) round(b->data(), int64_t(b->size()));
  glu(num, gt.data(), up.data(), rows * I, gt.data());
  if (shared) glu(num, sg.data(), su.data(), T * IS, sg.data());
  jobs.clear();
  for (int g = 0; g < G; ++g) {
    const FfnWeights& f = mw.experts[groups[g].expert];
    int n = int(off[g + 1] - off[g]);
    jobs.push_back({&f.down, gt.data() + off[g] * I, I, dn.data() + off[g] * X, X, n});
  }
  if (shared) jobs.push_back({&mw.shared.down, sg.data(), IS, sd.data(), D, T});
  run_matmuls(pool, jobs, rnd());
  round(dn.data(), rows * X);
  round(sd.data(), T * D);

  // The weighted sum of the routed experts, in ascending expert order.
  std::vector<float> acc(size_t(T) * size_t(X), 0.0f);
  if (latent) {
    // The official K3 code sums the weighted expert outputs in fp32 and rounds the sum once.
    for (int g = 0; g < G; ++g)
      for (size_t i = 0; i < groups[g].tokens.size(); ++i) {
        const int t = groups[g].tokens[i];
        const float wt = wts[t * k + groups[g].slots[i]];
        const float* y = dn.data() + (off[g] + int64_t(i)) * X;
        float* a = acc.data() + t * X;
        for (int64_t j = 0; j < X; ++j) a[j] += y[j] * wt;
      }
    round(acc.data(), T * X);
    std::vector<float> r(acc.size());
    const float* rin = acc.data();
    if (c.latent_norm) {
      for (int t = 0; t < T; ++t)
        cpu::rmsnorm(acc.data() + t * X, mw.latent_norm.data(), X, float(c.rms_norm_eps),
                     r.data() + t * X, rnd());
      rin = r.data();
    }
    matmuls({{&mw.latent_up, rin, X, out, D, T}});
    round(out, T * D);
  } else {
    // Rounding after each product and add, as the bf16 reference's index_add_ does.
    std::fill(out, out + T * D, 0.0f);
    std::vector<float> tmp(D);
    for (int g = 0; g < G; ++g)
      for (size_t i = 0; i < groups[g].tokens.size(); ++i) {
        const int t = groups[g].tokens[i];
        const float wt = wts[t * k + groups[g].slots[i]];
        const float* y = dn.data() + (off[g] + int64_t(i)) * D;
        for (int64_t j = 0; j < D; ++j) tmp[j] = y[j] * wt;
        round(tmp.data(), D);
        add_inplace(out + t * D, tmp.data(), D, rnd());
      }
  }
  if (shared) add_inplace(out, sd.data(), T * D, rnd());
}

}  // namespace md::fwd
