// The attention tiles of the decode plan on the CPU kernels: Kimi Delta Attention cores and the
// MLA latent rows, cores (with KV splits) and merges, and K3's q LoRA. Each reproduces, for its
// heads and token rows, the operations and bf16 rounding points of the reference path
// (engine/forward_attention.cpp) fed one token at a time: a step of R rows per sequence computes
// exactly what R decode steps compute (up to plan::kMaxChainedRows; above that the KDA core uses
// the reference prefill's chunked form).
#include <algorithm>
#include <cstring>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/kda.h"
#include "megadecode/kernels/cpu/mla.h"
#include "megadecode/plan/ops.h"
#include "tiles.h"

namespace md::exec {

using plan::Instr;

namespace {

// Row-log offsets (SeqView, row_log_floats).
struct RowLogLayout {
  int64_t C, H;
  int64_t raw(int i) const { return int64_t(i) * C; }  // i: 0 q, 1 k, 2 v
  int64_t conv(int i) const { return (3 + int64_t(i)) * C; }
  int64_t f() const { return 6 * C; }
  int64_t beta() const { return 7 * C; }
  int64_t row() const { return 7 * C + H; }
};

}  // namespace

namespace detail {

// [q, k, v, fa, ga, braw, o, f_b, g_b, q_conv, k_conv, v_conv, A_log, dt_bias, o_norm,
//  kda_state, conv_cache]: heads [r0, r1) of sequence seq over its R token rows (Forward::kda:
// every step is per channel or per head, so a head range computes exactly what the whole layer
// does there; the rows are chained through the conv cache and the state in order).
void kda_core_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using K_ = plan::arg::KdaCore;  // q, k, v are consecutive slots
  const ModelConfig& c = *s.cfg;
  const int b = in.seq, h0 = int(in.r0), h1 = int(in.r1), R = s.rows, t0 = b * R;
  const int K = c.kda_head_dim, Wc = c.kda_conv_size, H = c.kda_num_heads;
  const int64_t C = c.kda_dim(), c0 = int64_t(h0) * K, c1 = int64_t(h1) * K, n = c1 - c0;
  // Channel-indexed scratch, [R][C] each (the kernels take absolute channel indices), then the
  // betas [R][H].
  float* f = sc.f.data();
  float* gate = f + R * C;
  float* qc = gate + R * C;
  float* kc = qc + R * C;
  float* vc = kc + R * C;
  float* beta = vc + R * C;
  // f = round(f_b fa), gate = round(g_b ga) on these heads' rows, for all R rows in one pass
  // over the weights (K3's full-rank gate is operand 4 itself, round(g h) from the projection).
  const bool full_gate = in.flags & plan::kFlagFullRankGate;
  gemv_rows(a.w(K_::f_b), c0, c1, a.f(K_::fa, t0), R, a.ld(K_::fa), f + c0, C, s.num.round_bf16);
  for (int i = 0; i < R; ++i) maybe_round(f + i * C + c0, n, s.num.round_bf16);
  if (!full_gate) {
    gemv_rows(a.w(K_::g_b), c0, c1, a.f(K_::ga, t0), R, a.ld(K_::ga), gate + c0, C,
              s.num.round_bf16);
    for (int i = 0; i < R; ++i) maybe_round(gate + i * C + c0, n, s.num.round_bf16);
  }
  auto gate_row = [&](int i) { return full_gate ? a.f(K_::ga, t0 + i) : gate + i * C; };
  for (int i = 0; i < R; ++i) {
    const float* braw = a.f(K_::braw, t0 + i);
    for (int h = h0; h < h1; ++h) {
      float bt = cpu::sigmoidf(braw[h]);
      if (s.num.round_beta) bt = round_bf16(bt);
      beta[i * H + h] = bt;
    }
  }

  const SeqView& sv = a.seq(b);
  const int64_t cstride = int64_t(Wc - 1) * C;
  const RowLogLayout lg{C, H};
  if (sv.kda_state0) {  // the state before the step, for a commit to a prefix
    std::memcpy(sv.kda_state0 + c0 * K, sv.kda_state + c0 * K, size_t(n) * size_t(K) * 4);
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < Wc - 1; ++j) {
        const int64_t off = i * cstride + j * C + c0;
        std::memcpy(sv.conv0 + off, sv.conv_cache + off, size_t(n) * 4);
      }
  }
  float* o_rows = a.f(K_::o, t0);
  const int64_t ldo = a.ld(K_::o);
  const float* wconv[3] = {a.vec(K_::q_conv), a.vec(K_::k_conv), a.vec(K_::v_conv)};
  float* conv_out[3] = {qc, kc, vc};
  if (R > plan::kMaxChainedRows) {
    // The chunked form (the reference prefill's): conv over the R rows, then per head the
    // chunked delta rule from the state.
    for (int i = 0; i < 3; ++i)
      cpu::short_conv_prefill(a.f(K_::q + i, t0), R, a.ld(K_::q + i), sv.conv_cache + i * cstride,
                              wconv[i], Wc, C, c0, c1, conv_out[i], C, s.num.round_bf16);
    for (int i = 0; i < R; ++i) {
      if (in.flags & plan::kFlagBoundedDecay)
        cpu::kda_decay_gate_bounded(f + i * C, a.vec(K_::a_log), a.vec(K_::dt_bias), K,
                                    float(c.kda_gate_lower_bound), c0, c1);
      else
        cpu::kda_decay_gate(f + i * C, a.vec(K_::a_log), a.vec(K_::dt_bias), K, c0, c1);
    }
    for (int h = h0; h < h1; ++h) {
      const int64_t ch = int64_t(h) * K;
      cpu::kda_prefill_head(sv.kda_state + ch * K, qc + ch, kc + ch, vc + ch, f + ch, beta + h, H,
                            R, K, C, o_rows + ch, ldo);
    }
  } else {
    // Row by row, as that many decode steps: conv + SiLU, the decay gate, the delta rule.
    for (int i = 0; i < R; ++i) {
      for (int j = 0; j < 3; ++j)
        cpu::short_conv_decode(a.f(K_::q + j, t0 + i), sv.conv_cache + j * cstride, wconv[j], Wc, C,
                               c0, c1, conv_out[j] + i * C, s.num.round_bf16);
      float* fi = f + i * C;
      if (in.flags & plan::kFlagBoundedDecay)
        cpu::kda_decay_gate_bounded(fi, a.vec(K_::a_log), a.vec(K_::dt_bias), K,
                                    float(c.kda_gate_lower_bound), c0, c1);
      else
        cpu::kda_decay_gate(fi, a.vec(K_::a_log), a.vec(K_::dt_bias), K, c0, c1);
      if (sv.rowlog) {
        float* log = sv.rowlog + i * lg.row();
        for (int j = 0; j < 3; ++j) {
          std::memcpy(log + lg.raw(j) + c0, a.f(K_::q + j, t0 + i) + c0, size_t(n) * 4);
          std::memcpy(log + lg.conv(j) + c0, conv_out[j] + i * C + c0, size_t(n) * 4);
        }
        std::memcpy(log + lg.f() + c0, fi + c0, size_t(n) * 4);
        std::memcpy(log + lg.beta() + h0, beta + i * H + h0, size_t(h1 - h0) * 4);
      }
    }
    for (int h = h0; h < h1; ++h) {
      const int64_t ch = int64_t(h) * K;
      float* S = sv.kda_state + ch * K;
      for (int i = 0; i < R; ++i)
        cpu::kda_decode_head(S, qc + i * C + ch, kc + i * C + ch, vc + i * C + ch, f + i * C + ch,
                             beta[i * H + h], K, o_rows + i * ldo + ch);
    }
  }
  // round(o), gated norm, round(o), per row.
  for (int i = 0; i < R; ++i) {
    float* o = o_rows + i * ldo;
    maybe_round(o + c0, n, s.num.round_bf16);
    cpu::kda_gated_norm(o, gate_row(i), a.vec(K_::o_norm), K, h0, h1, s.num.eps);
    maybe_round(o + c0, n, s.num.round_bf16);
  }
}

// [a, kv_a_norm, mla_cache]: the new cache rows of token rows [r0, r1).
void mla_latent_tile(const StepCtx& s, const Instr& in, const Args& a) {
  using L_ = plan::arg::MlaLatent;
  const ModelConfig& c = *s.cfg;
  const int R = c.kv_lora_rank;
  const int64_t CW = c.mla_cache_width();
  for (int t = int(in.r0); t < int(in.r1); ++t) {
    float* row = a.seq(s.seq_of(t)).mla_cache + s.pos_of(t) * CW;
    const float* x = a.f(L_::a, t);
    cpu::rmsnorm(x, a.vec(L_::kv_a_norm), R, s.num.latent_eps, row, s.num.round_bf16);
    std::copy(x + R, x + CW, row + R);
  }
}

// [q, kv_b, mla_cache, att]: heads [r0, r1) of sequence seq; row i attends to its cache rows
// [0, pos + i] (causal within the step's rows).
void mla_core_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using M = plan::arg::MlaCore;
  const ModelConfig& c = *s.cfg;
  const int b = in.seq;
  const cpu::MlaDims d{c.mla_num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                       c.kv_lora_rank};
  const cpu::LatentCache cache =
      cpu::LatentCache::contiguous(a.seq(b).mla_cache, c.mla_cache_width(), s.pos[b] + s.rows);
  const bf16* kvb = static_cast<const bf16*>(a.w(M::kv_b).data);
  for (int i = 0; i < s.rows; ++i) {
    const int t = b * s.rows + i;
    const int T = int(s.pos[b] + i + 1);
    if (in.splits > 1) {
      // [q, kv_b, cache, parts]: split `slot`'s partials of heads [r0, r1).
      int t0 = 0, t1 = 0;
      cpu::mla_split_rows(T, int(in.splits), in.slot, &t0, &t1);
      float* part = a.f(M::out, t) + (int64_t(in.slot) * d.H + in.r0) * (d.R + 2);
      cpu::mla_decode_partial(a.f(M::q, t), cache, t0, t1, kvb, d, int(in.r0), int(in.r1), part,
                              sc.f.data());
      continue;
    }
    // [q, kv_b, cache, att]; the scratch holds the unsplit decode's workspace (scratch_floats).
    float* att = a.f(M::out, t);
    cpu::mla_decode_absorbed(a.f(M::q, t), cache, T, kvb, d, int(in.r0), int(in.r1), att,
                             sc.f.data());
    const int64_t o0 = int64_t(in.r0) * d.V, on = int64_t(in.r1 - in.r0) * d.V;
    maybe_round(att + o0, on, s.num.round_bf16);
    // K3: att *= sigmoid(g) on these heads (operand 4: round(g_proj h)).
    if (in.flags & plan::kFlagOutputGate)
      cpu::sigmoid_gate_inplace(att + o0, a.f(M::gate, t) + o0, on, s.num.round_bf16);
  }
}

// [parts, kv_b, att]: heads [r0, r1) of one sequence's rows, splits merged in ascending order.
void mla_merge_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using Mg = plan::arg::MlaMerge;
  const ModelConfig& c = *s.cfg;
  const cpu::MlaDims d{c.mla_num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                       c.kv_lora_rank};
  for (int i = 0; i < s.rows; ++i) {
    const int t = in.seq * s.rows + i;
    const float* part = a.f(Mg::parts, t) + int64_t(in.r0) * (d.R + 2);
    float* att = a.f(Mg::att, t);
    cpu::mla_decode_merge(part, int64_t(d.H) * (d.R + 2), int(in.splits),
                          static_cast<const bf16*>(a.w(Mg::kv_b).data), d, int(in.r0), int(in.r1),
                          att, sc.f.data());
    const int64_t o0 = int64_t(in.r0) * d.V, on = int64_t(in.r1 - in.r0) * d.V;
    maybe_round(att + o0, on, s.num.round_bf16);
    if (in.flags & plan::kFlagOutputGate)
      cpu::sigmoid_gate_inplace(att + o0, a.f(Mg::gate, t) + o0, on, s.num.round_bf16);
  }
}

// [q_b, qa, q_a_norm, q]: K3's q LoRA, rows [r0, r1) of q = round(q_b RMSNorm(qa)) for every
// token row (Forward::mla: q_a_layernorm with the latent norms' eps). Each tile normalises the
// rows' qa itself.
void mla_q_up_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using Q_ = plan::arg::MlaQUp;
  const int64_t Q = s.cfg->q_lora_rank;
  const int N = s.n;
  float* qn = sc.f.data();
  for (int t = 0; t < N; ++t)
    cpu::rmsnorm(a.f(Q_::qa, t), a.vec(Q_::q_a_norm), Q, s.num.latent_eps, qn + t * Q,
                 s.num.round_bf16);
  const int64_t n = int64_t(in.r1) - in.r0;
  float* Y = a.f(Q_::q);
  gemv_rows(a.w(Q_::q_b), in.r0, in.r1, qn, N, Q, Y + in.r0, a.ld(Q_::q), s.num.round_bf16);
  if (s.num.round_bf16)
    for (int t = 0; t < N; ++t) cpu::round_bf16_inplace(Y + t * a.ld(Q_::q) + in.r0, n);
}

}  // namespace detail

void replay_kda_rows(const ModelConfig& c, const SeqView& v, int k, int h0, int h1,
                     float* scratch) {
  const int K = c.kda_head_dim, Wc = c.kda_conv_size, H = c.kda_num_heads;
  const int64_t C = c.kda_dim(), c0 = int64_t(h0) * K, c1 = int64_t(h1) * K, n = c1 - c0;
  const RowLogLayout lg{C, H};
  std::memcpy(v.kda_state + c0 * K, v.kda_state0 + c0 * K, size_t(n) * size_t(K) * 4);
  for (int h = h0; h < h1; ++h) {
    const int64_t ch = int64_t(h) * K;
    float* S = v.kda_state + ch * K;
    for (int i = 0; i < k; ++i) {
      const float* log = v.rowlog + i * lg.row();
      cpu::kda_decode_head(S, log + lg.conv(0) + ch, log + lg.conv(1) + ch, log + lg.conv(2) + ch,
                           log + lg.f() + ch, log[lg.beta() + h], K, scratch);
    }
  }
  // The conv cache after k rows holds the last W-1 inputs of [cache before the step, raw rows
  // 0..k-1], oldest first.
  const int64_t cstride = int64_t(Wc - 1) * C;
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < Wc - 1; ++j) {
      const int src = k + j;
      const float* from = src < Wc - 1 ? v.conv0 + i * cstride + src * C
                                       : v.rowlog + (src - (Wc - 1)) * lg.row() + lg.raw(i);
      std::memcpy(v.conv_cache + i * cstride + j * C + c0, from + c0, size_t(n) * 4);
    }
}

}  // namespace md::exec
