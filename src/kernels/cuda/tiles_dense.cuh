// The dense, FFN and MoE tiles of the decode plan on CUDA: the twins of
// src/exec/cpu/tiles.cpp, with the same operands, outputs and bf16 rounding points. Element-wise
// steps (residual adds, the routed sum, activations) do exactly the CPU's operations per element;
// the reductions (GEMV rows, RMSNorm statistics) sum in the block's order (gemv.cuh), an fp32
// reordering of the CPU's.
#pragma once
#include "gemv.cuh"

MD_CUDA_BEGIN

// [W, X, Y]: Y[t][r0:r1] = round(W X[t]) for every token row (lm_head: every logit row). A
// distributed rank's partial sums (kFlagPartial) stay fp32 until kAllReduce adds them up.
MD_DEV void gemv_tile(const DevStep& s, const plan::Instr& in, const Args& a, Pipe& pipe) {
  using G = plan::arg::Gemv;
  int B = s.n;
  float* Y;
  int64_t ldy;
  if (a.a[G::y].kind == plan::BufKind::kLogits) {
    Y = s.logits;
    ldy = s.cfg.vocab;
    B = s.n_logits;
  } else {
    Y = a.f(G::y);
    ldy = a.ld(G::y);
  }
  const float* X = a.f(G::x);
  const int64_t ldx = a.ld(G::x);
  const bool rnd = s.num.round_bf16 && !(in.flags & plan::kFlagPartial);
  gemv_block(
      a.w(G::w), in.r0, in.r1, B, [&](int t) { return X + t * ldx; },
      [&](int t, int64_t r, float v) { Y[t * ldy + r] = maybe_round(v, rnd); }, pipe,
      then_tile_end());
}

// arg::AttnOut: out = round(resid + round(W x)) (without kFlagResidual: round(W x)). A distributed
// rank's share (kFlagPartial): out = W x, which kAllReduce sums, rounds and adds.
MD_DEV void attn_out_tile(const DevStep& s, const plan::Instr& in, const Args& a, Pipe& pipe) {
  using A = plan::arg::AttnOut;
  const bool partial = in.flags & plan::kFlagPartial;
  const bool resid = !partial && (in.flags & plan::kFlagResidual);
  const bool rnd = !partial && s.num.round_bf16;
  const float* X = a.f(A::x);
  const int64_t ldx = a.ld(A::x);
  gemv_block(
      a.w(A::w), in.r0, in.r1, s.n, [&](int t) { return X + t * ldx; },
      [&](int t, int64_t r, float v) {
        float y = maybe_round(v, rnd);
        if (resid) {
          const float x = a.f(A::resid, t)[r];
          y = rnd ? round_bf16_d(x + y) : x + y;
        }
        a.f(A::out, t)[r] = y;
      },
      pipe, then_tile_end());
}

// [Wg, Wu, X, act]: act = glu(round(G X), round(U X)); the first pass leaves round(G X) in act,
// the second combines it with round(U X) (each element by the same lane, after a barrier).
MD_DEV void gate_up_tile(const DevStep& s, const plan::Instr& in, const Args& a, Pipe& pipe) {
  using U = plan::arg::GateUp;
  const bool rnd = s.num.round_bf16;
  const float* X = a.f(U::x);
  const int64_t ldx = a.ld(U::x);
  auto xrow = [&](int t) { return X + t * ldx; };
  gemv_block(
      a.w(U::gate), in.r0, in.r1, s.n, xrow,
      [&](int t, int64_t r, float v) { a.f(U::act, t)[r] = maybe_round(v, rnd); }, pipe,
      then_stream(a.w(U::up), in.r0, in.r1));
  gemv_block(
      a.w(U::up), in.r0, in.r1, s.n, xrow,
      [&](int t, int64_t r, float v) {
        float* act = a.f(U::act, t) + r;
        *act = glu_d(s.num, *act, maybe_round(v, rnd));
      },
      pipe, then_tile_end());
}

// [tokens, embed, x0, norm, h0]; token rows [r0, r1).
MD_DEV void embed_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using E = plan::arg::Embed;
  const int64_t D = s.cfg.hidden;
  const DevWeight& e = a.w(E::embed);
  for (int t = int(in.r0); t < int(in.r1); ++t) {
    const int64_t tok = s.tokens[t];
    float* x = a.f(E::x0, t);
    for (int64_t j = port::thread_id(); j < D; j += port::block_threads())
      x[j] = e.dtype == WDType::kF32 ? static_cast<const float*>(e.data)[tok * e.cols + j]
                                     : bf16f(static_cast<const uint16_t*>(e.data)[tok * e.cols + j]);
    port::sync_block();
    rmsnorm_block(x, a.vec(E::norm), D, s.num.eps, a.f(E::h0, t), s.num.round_bf16, work());
    port::sync_block();
  }
}

// K3's block attention residual mix of token row t (cpu::attn_res_mix): operands first ..
// nargs - 1 are [score weights, sources...]. Each source's score is (src . w) / rms(src), in
// double; a softmax over the sources in double; out[d] = sum_j p_j src_j[d] in double, in source
// order, rounded. The block's double sums reorder the CPU's sequential ones (~1e-16 relative).
MD_DEV void res_mix_block(const DevStep& s, const plan::Instr& in, const Args& a, int first, int t,
                          float* out) {
  const int S = int(in.nargs) - first - 1;
  if (S < 1 || S > plan::kMaxResSources) port::trap("attention-residual mix: bad source count");
  const int64_t D = s.cfg.hidden;
  const float* w = a.vec(first);
  double* red = reinterpret_cast<double*>(work() + 64);
  double* p = reinterpret_cast<double*>(work() + 64) + port::block_threads();  // [S]
  for (int j = 0; j < S; ++j) {
    const float* x = a.f(first + 1 + j, t);
    double ss = 0, dot = 0;
    for (int64_t d = port::thread_id(); d < D; d += port::block_threads()) {
      const double v = x[d];
      ss += v * v;
      dot += v * double(w[d]);
    }
    // (two sums through the same buffer, one after the other)
    red[port::thread_id()] = ss;
    port::sync_block();
    double sss = 0;
    for (uint32_t i = 0; i < port::block_threads(); ++i) sss += red[i];
    port::sync_block();
    red[port::thread_id()] = dot;
    port::sync_block();
    double sdot = 0;
    for (uint32_t i = 0; i < port::block_threads(); ++i) sdot += red[i];
    port::sync_block();
    if (port::thread_id() == 0) p[j] = sdot / port::sqrt_d(sss / double(D) + double(s.num.eps));
  }
  port::sync_block();
  if (port::thread_id() == 0) {
    double best = p[0];
    for (int j = 1; j < S; ++j) best = p[j] > best ? p[j] : best;
    double sum = 0;
    for (int j = 0; j < S; ++j) sum += (p[j] = port::exp_d(p[j] - best));
    for (int j = 0; j < S; ++j) p[j] /= sum;
  }
  port::sync_block();
  for (int64_t d = port::thread_id(); d < D; d += port::block_threads()) {
    double acc = 0;
    for (int j = 0; j < S; ++j) acc += p[j] * double(a.f(first + 1 + j, t)[d]);
    out[d] = s.num.round_bf16 ? round_bf16_d(float(acc)) : float(acc);
  }
  port::sync_block();
}

// [x_mid, norm, h2] (+ K3's [res_w, sources...]: the norm of the mix, made in h2 and normalised
// in place).
MD_DEV void ffn_norm_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using F = plan::arg::FfnNorm;
  for (int t = int(in.r0); t < int(in.r1); ++t) {
    const float* x = a.f(F::x, t);
    if (in.flags & plan::kFlagAttnRes) {
      res_mix_block(s, in, a, F::count, t, a.f(F::h, t));
      x = a.f(F::h, t);
    }
    rmsnorm_block(x, a.vec(F::norm), s.cfg.hidden, s.num.eps, a.f(F::h, t), s.num.round_bf16,
                  work());
    port::sync_block();
  }
}

// Sigmoid top-k with the score-correction bias for one token row (cpu::route_topk): one thread,
// the same comparisons and arithmetic in the same order. choice: E floats of scratch.
MD_DEV void route_row(const float* logits, const float* bias, const cpu::RouterParams& p,
                      int32_t* ids, float* wts, float* choice) {
  const int E = p.num_experts;
  for (int e = 0; e < E; ++e) choice[e] = sigmoid_d(logits[e]) + bias[e];
  const float ninf = -__builtin_huge_valf();
  if (p.num_groups > 1) {
    // Groups by the sum of their two best scores; keep topk_groups of them (ties: lower index).
    const int G = p.num_groups, per = E / G;
    uint64_t kept = 0;  // at most 64 groups
    for (int i = 0; i < p.topk_groups; ++i) {
      int best = -1;
      float bs = 0;
      for (int g = 0; g < G; ++g) {
        if (kept >> g & 1) continue;
        float m1 = ninf, m2 = ninf;
        for (int e = g * per; e < (g + 1) * per; ++e) {
          if (choice[e] > m1) {
            m2 = m1;
            m1 = choice[e];
          } else if (choice[e] > m2) {
            m2 = choice[e];
          }
        }
        const float gs = m1 + m2;
        if (best < 0 || gs > bs) best = g, bs = gs;
      }
      kept |= uint64_t(1) << best;
    }
    for (int e = 0; e < E; ++e)
      if (!(kept >> (e / per) & 1)) choice[e] = ninf;
  }
  // top_k by score (ties: lower id), then ascending id.
  for (int i = 0; i < p.top_k; ++i) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int j = 0; j < i; ++j) taken |= ids[j] == e;
      if (taken) continue;
      if (best < 0 || choice[e] > choice[best]) best = e;
    }
    ids[i] = best;
  }
  for (int i = 1; i < p.top_k; ++i)
    for (int j = i; j > 0 && ids[j - 1] > ids[j]; --j) {
      const int32_t x = ids[j];
      ids[j] = ids[j - 1];
      ids[j - 1] = x;
    }
  float sum = 0;
  for (int i = 0; i < p.top_k; ++i) {
    const int e = ids[i];
    const float sc = sigmoid_d(logits[e]);
    wts[i] = p.biased_weights ? sc + bias[e] : sc;
    sum += wts[i];
  }
  for (int i = 0; i < p.top_k; ++i) {
    if (p.renormalize) wts[i] /= (sum + 1e-20f);
    wts[i] *= p.scaling;
  }
}

// arg::Gemv [router, h2, logits]: the router's logits rows [r0, r1) for every token row, fp32
// (never rounded, as the reference's).
MD_DEV void router_logits_tile(const DevStep& s, const plan::Instr& in, const Args& a,
                               Pipe& pipe) {
  using G = plan::arg::Gemv;
  const float* X = a.f(G::x);
  const int64_t ldx = a.ld(G::x), ldy = a.ld(G::y);
  float* Y = a.f(G::y);
  gemv_block(
      a.w(G::w), in.r0, in.r1, s.n, [&](int t) { return X + t * ldx; },
      [&](int t, int64_t r, float v) { Y[t * ldy + r] = v; }, pipe, then_tile_end());
}

// [logits, bias, ids, wts]: the top-k of token rows [r0, r1), one thread.
MD_DEV void router_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using Ro = plan::arg::Router;
  float* choice = work();
  if (port::thread_id() == 0)
    for (int t = int(in.r0); t < int(in.r1); ++t)
      route_row(a.f(Ro::logits, t), a.vec(Ro::bias), s.num.router, a.ints(Ro::ids, t),
                a.f(Ro::wts, t), choice);
  port::sync_block();
}

// The slot's expert (the u-th distinct id chosen by the step's token rows, ascending) and its
// members, (row, j) pairs in row order, into the work area (one thread, then a barrier).
// Returns the member count (0: an empty slot); *expert receives the id.
MD_DEV int expert_slot(const DevStep& s, const Args& a, int u, int* expert) {
  constexpr int kIds = plan::arg::ExpertGateUp::ids;
  const int E = s.cfg.num_experts, k = s.cfg.top_k, N = s.n;
  int* w = reinterpret_cast<int*>(work());
  int* members = w + 2;
  if (port::thread_id() == 0) {
    // Ascending ids: the smallest id above the previous one, u + 1 times.
    int e = -1;
    for (int i = 0; i <= u; ++i) {
      int next = E;
      for (int t = 0; t < N; ++t)
        for (int j = 0; j < k; ++j) {
          const int id = a.ints(kIds, t)[j];
          if (id > e && id < next) next = id;
        }
      e = next;
      if (e == E) break;
    }
    int m = 0;
    if (e < E)
      for (int t = 0; t < N; ++t)
        for (int j = 0; j < k; ++j)
          if (a.ints(kIds, t)[j] == e) {
            members[2 * m] = t;
            members[2 * m + 1] = j;
            ++m;
          }
    w[0] = e;
    w[1] = m;
  }
  port::sync_block();
  *expert = w[0];
  const int m = w[1];
  port::sync_block();  // members stay; the counts are read before anyone reuses the words
  return m;
}

MD_DEV const int* slot_members() {
  return reinterpret_cast<const int*>(work()) + 2;
}

// [ids, h2, gate set, up set, act]: act[row][j * I + r] for the slot's (row, j) pairs.
MD_DEV void expert_gate_up_tile(const DevStep& s, const plan::Instr& in, const Args& a,
                                Pipe& pipe) {
  using Xg = plan::arg::ExpertGateUp;
  int e;
  const int n = expert_slot(s, a, in.slot, &e);
  if (n == 0) return;
  if (!a.w(Xg::gate, e).data) return;  // another rank's expert (distributed)
  const int* mem = slot_members();
  const int64_t I = s.cfg.moe_inter;
  const bool rnd = s.num.round_bf16;
  auto xrow = [&](int m) { return a.f(Xg::x, mem[2 * m]); };
  auto act = [&](int m) { return a.f(Xg::act, mem[2 * m]) + int64_t(mem[2 * m + 1]) * I; };
  gemv_block(
      a.w(Xg::gate, e), in.r0, in.r1, n, xrow,
      [&](int m, int64_t r, float v) { act(m)[r] = maybe_round(v, rnd); }, pipe,
      then_stream(a.w(Xg::up, e), in.r0, in.r1));
  gemv_block(
      a.w(Xg::up, e), in.r0, in.r1, n, xrow,
      [&](int m, int64_t r, float v) {
        float* p = act(m) + r;
        *p = glu_d(s.num, *p, maybe_round(v, rnd));
      },
      pipe, then_tile_end());
}

// [ids, act, down set, dn]: dn[row][j * D + r] = round(down act[row][j]). A distributed rank:
// partial sums unrounded (kFlagPartial), and zeros for another rank's expert, so that the
// all-reduce adds only its owner's.
MD_DEV void expert_down_tile(const DevStep& s, const plan::Instr& in, const Args& a, Pipe& pipe) {
  using Dn = plan::arg::ExpertDown;
  int e;
  const int n = expert_slot(s, a, in.slot, &e);
  if (n == 0) return;
  const int* mem = slot_members();
  const int64_t D = s.cfg.expert_dim, I = s.cfg.moe_inter;
  if (!a.w(Dn::down, e).data) {
    const int64_t rows = int64_t(in.r1) - int64_t(in.r0);
    for (int m = 0; m < n; ++m) {
      float* out = a.f(Dn::out, mem[2 * m]) + int64_t(mem[2 * m + 1]) * D + in.r0;
      for (int64_t i = port::thread_id(); i < rows; i += port::block_threads()) out[i] = 0.0f;
    }
    port::sync_block();
    return;
  }
  const bool rnd = s.num.round_bf16 && !(in.flags & plan::kFlagPartial);
  gemv_block(
      a.w(Dn::down, e), in.r0, in.r1, n,
      [&](int m) { return a.f(Dn::act, mem[2 * m]) + int64_t(mem[2 * m + 1]) * I; },
      [&](int m, int64_t r, float v) {
        a.f(Dn::out, mem[2 * m])[int64_t(mem[2 * m + 1]) * D + r] = maybe_round(v, rnd);
      },
      pipe, then_tile_end());
}

MD_DEV float add_r(float x, float y, bool rnd) {
  return rnd ? round_bf16_d(x + y) : x + y;
}

// MoE: [x_mid, wts, dn, shared_out, x_next, norm, h_next]; dense: [x_mid, out, ...]; K3's latent
// MoE: [x_mid, -, up, shared, ...]. Per element exactly combine_seq's operations (tiles.cpp).
MD_DEV void combine_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using Cb = plan::arg::Combine;
  const int64_t D = s.cfg.hidden;
  const bool moe = in.flags & plan::kFlagMoeCombine, rnd = s.num.round_bf16;
  const bool latent = moe && (in.flags & plan::kFlagLatentMoe);
  const bool shared = in.flags & plan::kFlagSharedExpert;
  const int k = s.cfg.top_k;
  for (int t = int(in.r0); t < int(in.r1); ++t) {
    float* x = a.f(Cb::x_next, t);
    const float* xm = a.f(Cb::x_mid, t);
    for (int64_t i = port::thread_id(); i < D; i += port::block_threads()) {
      float xi = xm[i];
      if (latent) {
        float o = a.f(Cb::out, t)[i];
        if (shared) o = add_r(o, a.f(Cb::shared, t)[i], rnd);
        xi = add_r(xi, o, rnd);
      } else if (moe) {
        const float* wts = a.f(Cb::wts, t);
        float o = 0.0f;
        for (int j = 0; j < k; ++j) o = add_r(o, maybe_round(a.f(Cb::out, t)[j * D + i] * wts[j], rnd), rnd);
        if (shared) o = add_r(o, a.f(Cb::shared, t)[i], rnd);
        xi = add_r(xi, o, rnd);
      } else {
        xi = add_r(xi, a.f(Cb::out, t)[i], rnd);
      }
      x[i] = xi;
    }
    port::sync_block();
    int dst = t;
    if (in.flags & plan::kFlagLogitRows) dst = s.logit_of_row[t];
    if (dst >= 0) {
      const float* src = x;
      if (in.flags & plan::kFlagAttnRes) {  // the norm of K3's mix (made in h_next)
        res_mix_block(s, in, a, Cb::count, t, a.f(Cb::h_next, dst));
        src = a.f(Cb::h_next, dst);
      }
      rmsnorm_block(src, a.vec(Cb::norm), D, s.num.eps, a.f(Cb::h_next, dst), rnd, work());
    }
    port::sync_block();
  }
}

// [wts, dn, latent_norm (or null), r]: K3's routed sum in the latent (latent_norm_tile).
MD_DEV void latent_norm_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using Ln = plan::arg::LatentNorm;
  const int64_t X = s.cfg.expert_dim;
  const int k = s.cfg.top_k;
  const bool rnd = s.num.round_bf16;
  for (int t = int(in.r0); t < int(in.r1); ++t) {
    float* r = a.f(Ln::r, t);
    const float* wts = a.f(Ln::wts, t);
    for (int64_t i = port::thread_id(); i < X; i += port::block_threads()) {
      float acc = 0.0f;
      for (int j = 0; j < k; ++j) acc += a.f(Ln::dn, t)[j * X + i] * wts[j];
      r[i] = maybe_round(acc, rnd);
    }
    port::sync_block();
    if (a.present(Ln::norm)) rmsnorm_block(r, a.vec(Ln::norm), X, s.num.eps, r, rnd, work());
    port::sync_block();
  }
}

MD_CUDA_END
