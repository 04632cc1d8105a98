// The reference forward path of the Kimi Linear architecture on CPU threads. Each op is one
// fork-join region over the thread pool; independent matmuls that read the same input run in one
// region. The decode plan / megakernel (plan/, exec/) reproduces this arithmetic tile by tile.
#include "megadecode/engine/model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/kda.h"
#include "megadecode/kernels/cpu/matmul.h"
#include "megadecode/kernels/cpu/mla.h"
#include "megadecode/kernels/cpu/ops.h"

namespace md {

namespace {

// Y[b][r] = W X[b] for one weight matrix, B input vectors.
struct MatJob {
  const Mat* w;
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
  int B;
};

// Runs several matmuls in one parallel region: the union of their rows is split evenly (in
// blocks of 16 rows) across the workers. A row's result does not depend on the split.
void run_matmuls(ThreadPool& pool, std::span<const MatJob> jobs, bool x_bf16) {
  int64_t total = 0;
  for (const MatJob& j : jobs) total += j.w->rows;
  pool.parallel_for(
      static_cast<size_t>(total),
      [&](size_t b, size_t e) {
        int64_t base = 0;
        for (const MatJob& j : jobs) {
          int64_t r0 = std::max<int64_t>(int64_t(b) - base, 0);
          int64_t r1 = std::min<int64_t>(int64_t(e) - base, j.w->rows);
          if (r0 < r1) {
            if (j.w->dtype == DType::F32)
              cpu::matmul_f32(j.w->f32_data(), j.w->cols, r0, r1, j.x, j.B, j.ldx, j.y, j.ldy);
            else
              cpu::matmul_bf16(j.w->bf16_data(), j.w->cols, r0, r1, j.x, j.B, j.ldx, j.y, j.ldy,
                               x_bf16);
          }
          base += j.w->rows;
        }
      },
      16);
}

void add_inplace(float* x, const float* y, int64_t n, bool round) {
  if (round)
    for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i] + y[i]);
  else
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace

size_t SequenceState::bytes() const {
  size_t n = 0;
  for (auto* v : {&kda_state, &conv_cache, &mla_cache})
    for (const auto& x : *v) n += x.size() * sizeof(float);
  return n;
}

struct Model::Impl {
  Model& m;
  explicit Impl(Model& model) : m(model) {}

  bool rnd() const { return m.opt_.precision == Precision::BF16; }
  void round(float* x, int64_t n) const {
    if (rnd()) cpu::round_bf16_inplace(x, n);
  }
  void matmuls(std::initializer_list<MatJob> jobs) {
    run_matmuls(*m.pool_, std::span<const MatJob>(jobs.begin(), jobs.size()), rnd());
  }

  void kda(int l, SequenceState& s, const float* h, int T, float* out) {
    const ModelConfig& c = m.cfg_;
    const KdaWeights& w = m.w_.layers[l].kda;
    const int H = c.kda_num_heads, K = c.kda_head_dim, W = c.kda_conv_size;
    const int64_t C = c.kda_dim(), D = c.hidden_size;
    std::vector<float> q(T * C), k(T * C), v(T * C), fa(T * K), ga(T * K), braw(T * H);
    matmuls({{&w.q, h, D, q.data(), C, T},
             {&w.k, h, D, k.data(), C, T},
             {&w.v, h, D, v.data(), C, T},
             {&w.f_a, h, D, fa.data(), K, T},
             {&w.g_a, h, D, ga.data(), K, T},
             {&w.b, h, D, braw.data(), H, T}});
    for (auto* b : {&q, &k, &v, &fa, &ga, &braw}) round(b->data(), int64_t(b->size()));
    std::vector<float> f(T * C), gate(T * C);
    matmuls({{&w.f_b, fa.data(), K, f.data(), C, T}, {&w.g_b, ga.data(), K, gate.data(), C, T}});
    round(f.data(), T * C);
    round(gate.data(), T * C);

    // Short convolutions (+ SiLU) and the decay gate, split by channel.
    std::vector<float> qc(T * C), kc(T * C), vc(T * C);
    float* cache = s.conv_cache[l].data();
    const int64_t cstride = int64_t(W - 1) * C;
    m.pool_->parallel_for(
        size_t(C),
        [&](size_t c0, size_t c1) {
          const float* in[3] = {q.data(), k.data(), v.data()};
          float* outp[3] = {qc.data(), kc.data(), vc.data()};
          const float* wt[3] = {w.q_conv.data(), w.k_conv.data(), w.v_conv.data()};
          for (int i = 0; i < 3; ++i) {
            if (T == 1)
              cpu::short_conv_decode(in[i], cache + i * cstride, wt[i], W, C, c0, c1, outp[i],
                                     rnd());
            else
              cpu::short_conv_prefill(in[i], T, C, cache + i * cstride, wt[i], W, C, c0, c1,
                                      outp[i], C, rnd());
          }
          for (int t = 0; t < T; ++t)
            cpu::kda_decay_gate(f.data() + t * C, w.A_log.data(), w.dt_bias.data(), K, c0, c1);
        },
        size_t(K));
    std::vector<float> beta(T * H);
    for (int64_t i = 0; i < T * H; ++i) {
      beta[i] = cpu::sigmoidf(braw[i]);
      if (rnd()) beta[i] = round_bf16(beta[i]);
    }

    // The delta rule, one head per task.
    std::vector<float> o(T * C);
    float* S = s.kda_state[l].data();
    m.pool_->parallel_for(size_t(H), [&](size_t h0, size_t h1) {
      for (size_t hh = h0; hh < h1; ++hh) {
        const int64_t off = int64_t(hh) * K;
        float* Sh = S + int64_t(hh) * K * K;
        if (T == 1)
          cpu::kda_decode_head(Sh, qc.data() + off, kc.data() + off, vc.data() + off,
                               f.data() + off, beta[hh], K, o.data() + off);
        else
          cpu::kda_prefill_head(Sh, qc.data() + off, kc.data() + off, vc.data() + off,
                                f.data() + off, beta.data() + hh, H, T, K, C, o.data() + off, C);
      }
    });
    round(o.data(), T * C);
    for (int t = 0; t < T; ++t)
      cpu::kda_gated_norm(o.data() + t * C, gate.data() + t * C, w.o_norm.data(), K, 0, H,
                          float(c.rms_norm_eps));
    round(o.data(), T * C);
    matmuls({{&w.o, o.data(), C, out, D, T}});
    round(out, T * D);
  }

  void mla(int l, SequenceState& s, const float* h, int T, float* out) {
    const ModelConfig& c = m.cfg_;
    const MlaWeights& w = m.w_.layers[l].mla;
    const int H = c.mla_num_heads, N = c.qk_nope_head_dim, P = c.qk_rope_head_dim,
              V = c.v_head_dim, R = c.kv_lora_rank;
    const int64_t D = c.hidden_size, QW = int64_t(H) * (N + P), CW = R + P;
    std::vector<float> q(T * QW), a(T * CW);
    matmuls({{&w.q, h, D, q.data(), QW, T}, {&w.kv_a, h, D, a.data(), CW, T}});
    round(q.data(), T * QW);
    round(a.data(), T * CW);
    std::vector<float>& cache = s.mla_cache[l];
    const int64_t T0 = s.pos;
    cache.resize(size_t((T0 + T) * CW));
    for (int t = 0; t < T; ++t) {
      float* row = cache.data() + (T0 + t) * CW;
      cpu::rmsnorm(a.data() + t * CW, w.kv_a_norm.data(), R, float(c.latent_norm_eps), row, rnd());
      std::copy(a.data() + t * CW + R, a.data() + (t + 1) * CW, row + R);
    }
    const cpu::MlaDims d{H, N, P, V, R};
    std::vector<float> att(T * int64_t(H) * V);
    const bf16* kvb = w.kv_b.bf16_data();
    if (T == 1) {
      const int n = m.pool_->size();
      std::vector<float> scratch(size_t(n) * size_t(T0 + 1 + 2 * R));
      m.pool_->run([&](int id, int nw) {
        auto [h0, h1] = split_range(size_t(H), nw, id);
        if (h0 < h1)
          cpu::mla_decode_absorbed(q.data(), cache.data(), CW, int(T0 + 1), kvb, d, int(h0),
                                   int(h1), att.data(),
                                   scratch.data() + size_t(id) * size_t(T0 + 1 + 2 * R));
      });
    } else {
      m.pool_->parallel_for(size_t(H), [&](size_t h0, size_t h1) {
        cpu::mla_prefill(q.data(), QW, T, int(T0), cache.data(), CW, kvb, d, int(h0), int(h1),
                         att.data(), int64_t(H) * V, rnd());
      });
    }
    round(att.data(), int64_t(att.size()));
    matmuls({{&w.o, att.data(), int64_t(H) * V, out, D, T}});
    round(out, T * D);
  }

  void dense_ffn(const FfnWeights& f, const float* h, int T, float* out) {
    const int64_t D = m.cfg_.hidden_size, I = f.gate.rows;
    std::vector<float> g(T * I), u(T * I);
    matmuls({{&f.gate, h, D, g.data(), I, T}, {&f.up, h, D, u.data(), I, T}});
    round(g.data(), T * I);
    round(u.data(), T * I);
    cpu::silu_mul(g.data(), u.data(), T * I, g.data(), rnd());
    matmuls({{&f.down, g.data(), I, out, D, T}});
    round(out, T * D);
  }

  void moe(int l, const float* h, int T, float* out) {
    const ModelConfig& c = m.cfg_;
    const MoeWeights& w = m.w_.layers[l].moe;
    const int E = c.num_experts, k = c.num_experts_per_token;
    const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
    std::vector<float> logits(T * E);
    matmuls({{&w.router, h, D, logits.data(), E, T}});
    cpu::RouterParams rp{E, k, c.num_expert_group, c.topk_group, c.moe_renormalize,
                         float(c.routed_scaling_factor), m.opt_.router_biased_weights};
    std::vector<int> ids(T * k);
    std::vector<float> wts(T * k);
    for (int t = 0; t < T; ++t)
      cpu::route_topk(logits.data() + t * E, w.router_bias.data(), rp, ids.data() + t * k,
                      wts.data() + t * k);

    // Group the (token, slot) pairs by expert, in ascending expert id (the reference's order).
    struct Group {
      int expert;
      std::vector<int> tokens, slots;
    };
    std::vector<Group> groups;
    {
      std::vector<int> where(E, -1);
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) {
          int e = ids[t * k + j];
          if (where[e] < 0) where[e] = 0;
        }
      for (int e = 0; e < E; ++e)
        if (where[e] == 0) {
          where[e] = int(groups.size());
          groups.push_back({e, {}, {}});
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
    std::vector<float> xin(rows * D), gt(rows * I), up(rows * I), dn(rows * D);
    for (int g = 0; g < G; ++g)
      for (size_t i = 0; i < groups[g].tokens.size(); ++i)
        std::copy(h + groups[g].tokens[i] * D, h + (groups[g].tokens[i] + 1) * D,
                  xin.data() + (off[g] + int64_t(i)) * D);

    const bool shared = w.has_shared;
    const int64_t IS = shared ? w.shared.gate.rows : 0;
    std::vector<float> sg(T * IS), su(T * IS), sd(T * D);
    std::vector<MatJob> jobs;
    for (int g = 0; g < G; ++g) {
      const FfnWeights& f = w.experts[groups[g].expert];
      int n = int(off[g + 1] - off[g]);
      jobs.push_back({&f.gate, xin.data() + off[g] * D, D, gt.data() + off[g] * I, I, n});
      jobs.push_back({&f.up, xin.data() + off[g] * D, D, up.data() + off[g] * I, I, n});
    }
    if (shared) {
      jobs.push_back({&w.shared.gate, h, D, sg.data(), IS, T});
      jobs.push_back({&w.shared.up, h, D, su.data(), IS, T});
    }
    run_matmuls(*m.pool_, jobs, rnd());
    for (auto* b : {&gt, &up, &sg, &su}) round(b->data(), int64_t(b->size()));
    cpu::silu_mul(gt.data(), up.data(), rows * I, gt.data(), rnd());
    if (shared) cpu::silu_mul(sg.data(), su.data(), T * IS, sg.data(), rnd());
    jobs.clear();
    for (int g = 0; g < G; ++g) {
      const FfnWeights& f = w.experts[groups[g].expert];
      int n = int(off[g + 1] - off[g]);
      jobs.push_back({&f.down, gt.data() + off[g] * I, I, dn.data() + off[g] * D, D, n});
    }
    if (shared) jobs.push_back({&w.shared.down, sg.data(), IS, sd.data(), D, T});
    run_matmuls(*m.pool_, jobs, rnd());
    round(dn.data(), rows * D);
    round(sd.data(), T * D);

    // Weighted sum in ascending expert order, rounding after each add as the bf16 reference's
    // index_add_ does; then the shared expert.
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
    if (shared) add_inplace(out, sd.data(), T * D, rnd());
  }

  void forward(SequenceState& s, std::span<const int32_t> ids, float* logits, bool all) {
    const ModelConfig& c = m.cfg_;
    const int T = int(ids.size());
    const int64_t D = c.hidden_size;
    MD_CHECK(T >= 1, "forward: no tokens given");
    for (int32_t id : ids)
      MD_CHECK(id >= 0 && id < c.vocab_size, "token id {} is outside the vocabulary [0, {})", id,
               c.vocab_size);
    std::vector<float> x(T * D), h(T * D), o(T * D);
    for (int t = 0; t < T; ++t) {
      const bf16* row = static_cast<const bf16*>(m.w_.embed.row(ids[t]));
      for (int64_t j = 0; j < D; ++j) x[t * D + j] = bf16_to_f32(row[j]);
    }
    const float eps = float(c.rms_norm_eps);
    for (int l = 0; l < c.num_layers; ++l) {
      const LayerWeights& L = m.w_.layers[l];
      for (int t = 0; t < T; ++t)
        cpu::rmsnorm(x.data() + t * D, L.input_norm.data(), D, eps, h.data() + t * D, rnd());
      if (c.attn_kind[l] == AttnKind::KDA)
        kda(l, s, h.data(), T, o.data());
      else
        mla(l, s, h.data(), T, o.data());
      add_inplace(x.data(), o.data(), T * D, rnd());
      for (int t = 0; t < T; ++t)
        cpu::rmsnorm(x.data() + t * D, L.post_attn_norm.data(), D, eps, h.data() + t * D, rnd());
      if (c.ffn_kind[l] == FfnKind::Dense)
        dense_ffn(L.dense, h.data(), T, o.data());
      else
        moe(l, h.data(), T, o.data());
      add_inplace(x.data(), o.data(), T * D, rnd());
    }
    s.pos += T;
    if (!logits) return;
    const int first = all ? 0 : T - 1, n = T - first;
    for (int t = first; t < T; ++t)
      cpu::rmsnorm(x.data() + t * D, m.w_.final_norm.data(), D, eps, h.data() + (t - first) * D,
                   rnd());
    matmuls({{&m.w_.lm_head, h.data(), D, logits, c.vocab_size, n}});
    // The official bf16 model's logits are bf16 (lm_head output); so are ours in that mode, so
    // that greedy ties break the same way (lowest id among equal values).
    round(logits, n * c.vocab_size);
  }
};

Model::Model(const std::string& dir, const ModelOptions& opt) : opt_(opt) {
  namespace fs = std::filesystem;
  MD_CHECK(fs::is_directory(dir), "model directory {} does not exist or is not a directory", dir);
  cfg_ = load_config_file((fs::path(dir) / "config.json").string());
  ckpt_ = std::make_unique<Checkpoint>(dir);
  w_ = bind_weights(cfg_, *ckpt_);
  if (opt.precision == Precision::BF16) {
    // The bf16 reference holds A_log in bf16 (it is not among the modules it keeps in fp32), so a
    // checkpoint's F32 A_log is rounded there; dt_bias stays fp32.
    for (LayerWeights& L : w_.layers)
      for (float& a : L.kda.A_log) a = round_bf16(a);
  }
  pool_ = std::make_unique<ThreadPool>(opt.threads, opt.pin_threads);
  impl_ = std::make_unique<Impl>(*this);
}

Model::~Model() = default;

void Model::touch_weights(const std::function<void(double, double)>& progress) const {
  const double total = double(ckpt_->total_bytes());
  double done = 0, reported = 0;
  volatile uint8_t sink = 0;
  for (const auto& [name, t] : ckpt_->tensors()) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    uint8_t acc = 0;
    for (size_t i = 0; i < t.nbytes; i += 4096) acc ^= p[i];
    sink = sink ^ acc;
    done += double(t.nbytes);
    if (progress && (done - reported > total / 200 || done == total)) {
      progress(done, total);
      reported = done;
    }
  }
}

SequenceState Model::new_sequence() const {
  SequenceState s;
  const ModelConfig& c = cfg_;
  s.kda_state.resize(c.num_layers);
  s.conv_cache.resize(c.num_layers);
  s.mla_cache.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.attn_kind[l] == AttnKind::KDA) {
      s.kda_state[l].assign(size_t(c.kda_num_heads) * c.kda_head_dim * c.kda_head_dim, 0.0f);
      s.conv_cache[l].assign(size_t(3) * (c.kda_conv_size - 1) * size_t(c.kda_dim()), 0.0f);
    }
  }
  return s;
}

void Model::forward(SequenceState& seq, std::span<const int32_t> ids, float* logits,
                    bool all_positions) {
  impl_->forward(seq, ids, logits, all_positions);
}

}  // namespace md
