// Attention layers of the reference forward path: Kimi Delta Attention and NoPE MLA, with K3's
// options (full-rank KDA output gate, lower-bounded decay, q LoRA, MLA output gate).
#include <algorithm>
#include <vector>

#include "forward.h"
#include "megadecode/base/bf16.h"
#include "megadecode/kernels/cpu/kda.h"
#include "megadecode/kernels/cpu/mla.h"

namespace md::fwd {

void Forward::kda(int l, SequenceState& s, const float* h, int T, float* out) const {
  const KdaWeights& kw = w.layers[l].kda;
  const int H = c.kda_num_heads, K = c.kda_head_dim, W = c.kda_conv_size;
  const int64_t C = c.kda_dim(), D = c.hidden_size;
  const bool full_gate = c.kda_full_rank_gate;
  std::vector<float> q(T * C), k(T * C), v(T * C), fa(T * K), braw(T * H), gate(T * C);
  std::vector<float> ga(full_gate ? 0 : T * K);
  if (full_gate) {
    matmuls({{&kw.q, h, D, q.data(), C, T},
             {&kw.k, h, D, k.data(), C, T},
             {&kw.v, h, D, v.data(), C, T},
             {&kw.f_a, h, D, fa.data(), K, T},
             {&kw.g, h, D, gate.data(), C, T},
             {&kw.b, h, D, braw.data(), H, T}});
  } else {
    matmuls({{&kw.q, h, D, q.data(), C, T},
             {&kw.k, h, D, k.data(), C, T},
             {&kw.v, h, D, v.data(), C, T},
             {&kw.f_a, h, D, fa.data(), K, T},
             {&kw.g_a, h, D, ga.data(), K, T},
             {&kw.b, h, D, braw.data(), H, T}});
  }
  for (auto* b : {&q, &k, &v, &fa, &ga, &braw, &gate}) round(b->data(), int64_t(b->size()));
  std::vector<float> f(T * C);
  if (full_gate) {
    matmuls({{&kw.f_b, fa.data(), K, f.data(), C, T}});
  } else {
    matmuls({{&kw.f_b, fa.data(), K, f.data(), C, T}, {&kw.g_b, ga.data(), K, gate.data(), C, T}});
    round(gate.data(), T * C);
  }
  round(f.data(), T * C);

  // Short convolutions (+ SiLU) and the decay gate, split by channel.
  std::vector<float> qc(T * C), kc(T * C), vc(T * C);
  float* cache = s.conv_cache[l].data();
  const int64_t cstride = int64_t(W - 1) * C;
  pool.parallel_for(
      size_t(C),
      [&](size_t c0, size_t c1) {
        const float* in[3] = {q.data(), k.data(), v.data()};
        float* outp[3] = {qc.data(), kc.data(), vc.data()};
        const float* wt[3] = {kw.q_conv.data(), kw.k_conv.data(), kw.v_conv.data()};
        for (int i = 0; i < 3; ++i) {
          if (T == 1)
            cpu::short_conv_decode(in[i], cache + i * cstride, wt[i], W, C, c0, c1, outp[i], rnd());
          else
            cpu::short_conv_prefill(in[i], T, C, cache + i * cstride, wt[i], W, C, c0, c1, outp[i],
                                    C, rnd());
        }
        for (int t = 0; t < T; ++t) {
          if (c.kda_bounded_decay)
            cpu::kda_decay_gate_bounded(f.data() + t * C, kw.A_log.data(), kw.dt_bias.data(), K,
                                        float(c.kda_gate_lower_bound), c0, c1);
          else
            cpu::kda_decay_gate(f.data() + t * C, kw.A_log.data(), kw.dt_bias.data(), K, c0, c1);
        }
      },
      size_t(K));
  // beta = sigmoid(b), rounded or not (Numerics::round_beta).
  const bool round_beta = num.round_beta;
  std::vector<float> beta(T * H);
  for (int64_t i = 0; i < T * H; ++i) {
    beta[i] = cpu::sigmoidf(braw[i]);
    if (round_beta) beta[i] = round_bf16(beta[i]);
  }

  // The delta rule, one head per task.
  std::vector<float> o(T * C);
  float* S = s.kda_state[l].data();
  pool.parallel_for(size_t(H), [&](size_t h0, size_t h1) {
    for (size_t hh = h0; hh < h1; ++hh) {
      const int64_t off = int64_t(hh) * K;
      float* Sh = S + int64_t(hh) * K * K;
      if (T == 1)
        cpu::kda_decode_head(Sh, qc.data() + off, kc.data() + off, vc.data() + off, f.data() + off,
                             beta[hh], K, o.data() + off);
      else
        cpu::kda_prefill_head(Sh, qc.data() + off, kc.data() + off, vc.data() + off, f.data() + off,
                              beta.data() + hh, H, T, K, C, o.data() + off, C);
    }
  });
  round(o.data(), T * C);
  for (int t = 0; t < T; ++t)
    cpu::kda_gated_norm(o.data() + t * C, gate.data() + t * C, kw.o_norm.data(), K, 0, H,
                        float(c.rms_norm_eps));
  round(o.data(), T * C);
  matmuls({{&kw.o, o.data(), C, out, D, T}});
  round(out, T * D);
}

void Forward::mla(int l, SequenceState& s, const float* h, int T, float* out) const {
  const MlaWeights& mw = w.layers[l].mla;
  const int H = c.mla_num_heads, N = c.qk_nope_head_dim, P = c.qk_rope_head_dim, V = c.v_head_dim,
            R = c.kv_lora_rank, Q = c.q_lora_rank;
  const int64_t D = c.hidden_size, QW = int64_t(H) * (N + P), CW = R + P, OW = int64_t(H) * V;
  std::vector<float> q(T * QW), a(T * CW);
  std::vector<float> gate(c.mla_output_gate ? T * OW : 0);
  if (Q > 0) {
    // q LoRA: q = q_b(RMSNorm(q_a h)); q_a_layernorm uses the latent norms' eps.
    std::vector<float> qa(T * int64_t(Q)), qn(T * int64_t(Q));
    if (c.mla_output_gate)
      matmuls({{&mw.q_a, h, D, qa.data(), Q, T},
               {&mw.kv_a, h, D, a.data(), CW, T},
               {&mw.g, h, D, gate.data(), OW, T}});
    else
      matmuls({{&mw.q_a, h, D, qa.data(), Q, T}, {&mw.kv_a, h, D, a.data(), CW, T}});
    round(qa.data(), T * int64_t(Q));
    for (int t = 0; t < T; ++t)
      cpu::rmsnorm(qa.data() + t * int64_t(Q), mw.q_a_norm.data(), Q, float(c.latent_norm_eps),
                   qn.data() + t * int64_t(Q), rnd());
    matmuls({{&mw.q_b, qn.data(), Q, q.data(), QW, T}});
  } else if (c.mla_output_gate) {
    matmuls({{&mw.q, h, D, q.data(), QW, T},
             {&mw.kv_a, h, D, a.data(), CW, T},
             {&mw.g, h, D, gate.data(), OW, T}});
  } else {
    matmuls({{&mw.q, h, D, q.data(), QW, T}, {&mw.kv_a, h, D, a.data(), CW, T}});
  }
  round(q.data(), T * QW);
  round(a.data(), T * CW);
  round(gate.data(), int64_t(gate.size()));
  std::vector<float>& cache = s.mla_cache[l];
  const int64_t T0 = s.pos;
  cache.resize(size_t((T0 + T) * CW));
  for (int t = 0; t < T; ++t) {
    float* row = cache.data() + (T0 + t) * CW;
    cpu::rmsnorm(a.data() + t * CW, mw.kv_a_norm.data(), R, float(c.latent_norm_eps), row, rnd());
    std::copy(a.data() + t * CW + R, a.data() + (t + 1) * CW, row + R);
  }
  const cpu::MlaDims d{H, N, P, V, R};
  std::vector<float> att(T * OW);
  const bf16* kvb = mw.kv_b.bf16_data();
  if (T == 1) {
    const int n = pool.size();
    std::vector<float> scratch(size_t(n) * size_t(T0 + 1 + 2 * R));
    pool.run([&](int id, int nw) {
      auto [h0, h1] = split_range(size_t(H), nw, id);
      if (h0 < h1)
        cpu::mla_decode_absorbed(q.data(), cpu::LatentCache::contiguous(cache.data(), CW, T0 + 1),
                                 int(T0 + 1), kvb, d, int(h0), int(h1), att.data(),
                                 scratch.data() + size_t(id) * size_t(T0 + 1 + 2 * R));
    });
  } else {
    pool.parallel_for(size_t(H), [&](size_t h0, size_t h1) {
      cpu::mla_prefill(q.data(), QW, T, int(T0),
                       cpu::LatentCache::contiguous(cache.data(), CW, T0 + T), kvb, d, int(h0),
                       int(h1), att.data(), OW, rnd());
    });
  }
  round(att.data(), int64_t(att.size()));
  if (c.mla_output_gate) cpu::sigmoid_gate_inplace(att.data(), gate.data(), T * OW, rnd());
  matmuls({{&mw.o, att.data(), OW, out, D, T}});
  round(out, T * D);
}

}  // namespace md::fwd
