// The draft plan's tiles on the CPU (plan.h kDraft*; docs/speculative.md "The draft plan"). Each
// reproduces, for its rows / heads / vocabulary block, the operations and rounding points of
// DraftModel's forward (spec/draft_forward.cpp) with the same kernels, so a draft plan drafts
// bit for bit what DraftModel drafts. The block's other ops are the decode plan's own tiles.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/gqa_attention.h"
#include "megadecode/kernels/cpu/rope.h"
#include "megadecode/plan/ops.h"
#include "tiles.h"

namespace md::exec {

using plan::Instr;

namespace detail {

namespace {

// Per-head RMSNorm (q_norm / k_norm over head_dim) of heads [h0, h1) of one row, then RoPE of
// those heads at `position` (DraftModel's norm_rope, restricted to the heads).
void norm_rope_heads(const StepCtx& s, float* row, int h0, int h1, const float* w,
                     int64_t position) {
  const DraftConfig& c = s.plan->draft.cfg;
  const int d = c.head_dim;
  for (int h = h0; h < h1; ++h)
    cpu::rmsnorm(row + h * d, w, d, s.num.eps, row + h * d, s.num.round_bf16);
  cpu::rope_neox(row + h0 * d, h1 - h0, d, position, c.rope_theta, s.num.round_bf16);
}

const bf16* bf16_row(const WeightView& w, int64_t r) {
  return static_cast<const bf16*>(w.data) + r * w.cols;
}

}  // namespace

// [W, X, Y] over the context rows: Y[t][r0:r1] = round(W X[t]) (fc, or a layer's k / v).
void draft_ctx_proj_tile(const StepCtx& s, const Instr& in, const Args& a) {
  using G = plan::arg::Gemv;
  const int64_t n = int64_t(in.r1) - in.r0;
  float* Y = a.f(G::y);
  gemv_rows(a.w(G::w), in.r0, in.r1, a.f(G::x), s.n_ctx, a.ld(G::x), Y + in.r0, a.ld(G::y),
            s.num.round_bf16);
  if (s.num.round_bf16)
    for (int t = 0; t < s.n_ctx; ++t) cpu::round_bf16_inplace(a.f(G::y, t) + in.r0, n);
}

// [x, hidden_norm, h]: context rows [r0, r1).
void draft_ctx_norm_tile(const StepCtx& s, const Instr& in, const Args& a) {
  using F = plan::arg::FfnNorm;
  for (int t = int(in.r0); t < int(in.r1); ++t)
    cpu::rmsnorm(a.f(F::x, t), a.vec(F::norm), s.cfg->hidden_size, s.num.eps, a.f(F::h, t),
                 s.num.round_bf16);
}

// [k, v, k_norm, ctx_pos, ring] of sequence r0: each of its context rows' key (k_norm, RoPE at
// the row's position) and value into ring slot position % window; layer 0 records the slot's
// position (the slot's rows of every layer are written in the same step).
void draft_ctx_write_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using Cw = plan::arg::DraftCtxWrite;
  const DraftConfig& c = s.plan->draft.cfg;
  const int b = int(in.r0), C = s.plan->draft.ctx_rows;
  const int64_t KV = c.kv_width();
  const SeqView& v = a.seq(b);
  float* key = sc.f.data();
  for (int j = 0; j < C; ++j) {
    const int t = b * C + j;
    const int32_t p = a.ints(Cw::ctx_pos, t)[0];
    if (p < 0) continue;
    std::memcpy(key, a.f(Cw::k, t), size_t(KV) * 4);
    norm_rope_heads(s, key, 0, c.num_kv_heads, a.vec(Cw::k_norm), p);
    const int64_t slot = p % c.window;
    std::memcpy(v.ring_k + slot * KV, key, size_t(KV) * 4);
    std::memcpy(v.ring_v + slot * KV, a.f(Cw::v, t), size_t(KV) * 4);
    if (in.layer == 0) v.ring_pos[slot] = p;
  }
}

// [q, k, v, q_norm, k_norm, att, ring]: KV heads [r0, r1) of sequence `seq` and their query
// heads, every block row: normed and rotated q and k (in scratch), then each row attends to the
// visible ring slots (filled, before the anchor, within the window) and to the block's rows up
// to its own; att rounded as the reference rounds the whole attention output.
void draft_attn_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using At = plan::arg::DraftAttn;
  const DraftConfig& c = s.plan->draft.cfg;
  const int b = in.seq, G = s.rows_of(b), t0 = s.first_row(b);
  const int H = c.num_heads, Hkv = c.num_kv_heads, grp = H / Hkv, d = c.head_dim;
  const int k0 = int(in.r0), k1 = int(in.r1), q0 = k0 * grp, q1 = k1 * grp;
  const int64_t Q = c.q_width(), ldv = a.ld(At::v);
  const int64_t anchor = s.pos[b];
  const SeqView& v = a.seq(b);
  int32_t* visible = sc.i.data();
  int nvis = 0;
  for (int32_t slot = 0; slot < c.window; ++slot) {
    const int64_t p = v.ring_pos[slot];
    if (p >= 0 && p < anchor && p >= anchor - c.window) visible[nvis++] = slot;
  }
  float* q = sc.f.data();          // [G][Q]: this tile's heads
  float* k = q + int64_t(G) * Q;   // [G][ldv]: this tile's KV heads
  for (int r = 0; r < G; ++r) {
    const int64_t pos = anchor + r;
    float* qr = q + r * Q;
    std::memcpy(qr + q0 * d, a.f(At::q, t0 + r) + q0 * d, size_t(q1 - q0) * size_t(d) * 4);
    norm_rope_heads(s, qr, q0, q1, a.vec(At::q_norm), pos);
    float* kr = k + r * ldv;
    std::memcpy(kr + k0 * d, a.f(At::k, t0 + r) + k0 * d, size_t(k1 - k0) * size_t(d) * 4);
    norm_rope_heads(s, kr, k0, k1, a.vec(At::k_norm), pos);
  }
  const float scale = float(1.0 / std::sqrt(double(d)));
  const int64_t KV = c.kv_width();
  for (int r = 0; r < G; ++r) {
    const cpu::KvSegment seg[2] = {{v.ring_k, v.ring_v, KV, visible, nvis},
                                   {k, a.f(At::v, t0), ldv, nullptr, r + 1}};
    float* out = a.f(At::att, t0 + r);
    cpu::gqa_attend(q + r * Q, H, Hkv, d, q0, q1, seg, scale, s.num.round_bf16, out);
    if (s.num.round_bf16) cpu::round_bf16_inplace(out + q0 * d, int64_t(q1 - q0) * d);
  }
}

// [base, w1, w2, tokens, drafts, biased, best]: slot k over vocabulary rows [r0, r1) for every
// sequence: bias = round(w2[r0:r1] w1[prev]) (prev: the anchor for k = 0, else draft k - 1),
// biased = base + bias in fp32, and the block's first maximum as (value, id) in column `seq`.
void draft_markov_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using Mk = plan::arg::DraftMarkov;
  const DraftConfig& c = s.plan->draft.cfg;
  const int B = s.batch, k = in.slot, j = in.seq;
  const int64_t r = c.markov_rank, n = int64_t(in.r1) - in.r0;
  const WeightView& w1 = a.w(Mk::w1);
  float* e = sc.f.data();  // [B][r]: w1 rows of the previous tokens
  float* bias = e + B * r;  // [B][n]
  for (int b = 0; b < B; ++b) {
    const int32_t prev = k == 0 ? s.tokens[s.first_row(b)] : a.ints(Mk::drafts, b)[k - 1];
    if (w1.dtype == DType::F32) {
      const float* row = static_cast<const float*>(w1.data) + int64_t(prev) * w1.cols;
      std::copy(row, row + r, e + b * r);
    } else {
      const bf16* row = bf16_row(w1, prev);
      for (int64_t i = 0; i < r; ++i) e[b * r + i] = bf16_to_f32(row[i]);
    }
  }
  gemv_rows(a.w(Mk::w2), in.r0, in.r1, e, B, r, bias, n, s.num.round_bf16);
  maybe_round(bias, B * n, s.num.round_bf16);
  for (int b = 0; b < B; ++b) {
    const int t = s.first_row(b) + k;
    const float* base = a.f(Mk::base, t) + in.r0;
    float* biased = a.present(Mk::biased) ? a.f(Mk::biased, t) + in.r0 : nullptr;
    const float* y = bias + b * n;
    float best = base[0] + y[0];
    int64_t at = 0;
    if (biased) biased[0] = best;
    for (int64_t i = 1; i < n; ++i) {
      const float x = base[i] + y[i];
      if (biased) biased[i] = x;
      if (x > best) {
        best = x;
        at = i;
      }
    }
    float* cell = a.f(Mk::best, b) + 2 * j;
    cell[0] = best;
    const int32_t id = int32_t(in.r0 + at);
    std::memcpy(cell + 1, &id, 4);
  }
}

// [best, drafts]: sequences [r0, r1), slot k: the first maximum over the vocabulary blocks in
// order (so ties go to the lowest id, as DraftModel's argmax).
void draft_pick_tile(const StepCtx& s, const Instr& in, const Args& a) {
  using Pk = plan::arg::DraftPick;
  const int T = int(a.a[Pk::best].count / 2);
  for (int b = int(in.r0); b < int(in.r1); ++b) {
    const float* cells = a.f(Pk::best, b);
    int best = 0;
    for (int j = 1; j < T; ++j)
      if (cells[2 * j] > cells[2 * best]) best = j;
    int32_t id;
    std::memcpy(&id, cells + 2 * best + 1, 4);
    a.ints(Pk::drafts, b)[in.slot] = id;
  }
  (void)s;
}

size_t draft_scratch_floats(const plan::Plan& p) {
  if (!p.draft.on) return 0;
  const DraftConfig& c = p.draft.cfg;
  const int64_t G = p.rows, B = p.batch;
  int64_t block = 0;  // the largest Markov tile's vocabulary rows
  for (const plan::Instr& in : p.instrs)
    if (in.op == plan::Op::kDraftMarkov) block = std::max<int64_t>(block, in.r1 - in.r0);
  int64_t n = c.kv_width() + 16;                                    // ctx write
  n = std::max<int64_t>(n, G * (c.q_width() + c.kv_width() + 16));  // attention
  n = std::max<int64_t>(n, B * (c.markov_rank + block));            // Markov: w1 rows, bias
  return size_t(n + 64);
}

size_t draft_scratch_ints(const plan::Plan& p) {
  return p.draft.on ? size_t(p.draft.cfg.window) + 16 : 0;
}

}  // namespace detail

WeightView bind_draft_weight(const DraftWeights& w, const plan::WeightRef& r) {
  using plan::WeightKind;
  auto mat = [](const Mat& m) {
    return WeightView{m.data, m.dtype, m.rows, m.cols, m.scales, m.quant, m.group, m.int_act_bits};
  };
  auto vec = [](const std::vector<float>& v) {
    return WeightView{v.data(), DType::F32, 1, int64_t(v.size()), nullptr};
  };
  const bool layered = r.layer != plan::kNoLayer && r.layer < w.layers.size();
  MD_CHECK(r.layer == plan::kNoLayer || layered, "draft plan: weight of layer {} of {}", r.layer,
           w.layers.size());
  const DraftLayerWeights* L = layered ? &w.layers[r.layer] : nullptr;
  switch (r.kind) {
    case WeightKind::kEmbed:
      return mat(w.embed);
    case WeightKind::kLmHead:
      return mat(w.lm_head);
    case WeightKind::kFinalNorm:
      return vec(w.final_norm);
    case WeightKind::kDraftFc:
      return mat(w.fc);
    case WeightKind::kDraftHiddenNorm:
      return vec(w.hidden_norm);
    case WeightKind::kMarkovW1:
      return mat(w.markov_w1);
    case WeightKind::kMarkovW2:
      return mat(w.markov_w2);
    default:
      break;
  }
  MD_CHECK(L, "draft plan: weight {} needs a layer", plan::weight_kind_name(r.kind));
  switch (r.kind) {
    case WeightKind::kInputNorm:
      return vec(L->input_norm);
    case WeightKind::kPostAttnNorm:
      return vec(L->post_attn_norm);
    case WeightKind::kDraftQ:
      return mat(L->q);
    case WeightKind::kDraftK:
      return mat(L->k);
    case WeightKind::kDraftV:
      return mat(L->v);
    case WeightKind::kDraftO:
      return mat(L->o);
    case WeightKind::kDraftQNorm:
      return vec(L->q_norm);
    case WeightKind::kDraftKNorm:
      return vec(L->k_norm);
    case WeightKind::kDenseGate:
      return mat(L->mlp.gate);
    case WeightKind::kDenseUp:
      return mat(L->mlp.up);
    case WeightKind::kDenseDown:
      return mat(L->mlp.down);
    default:
      break;
  }
  fail("draft plan: weight kind {} is not one of the draft's", plan::weight_kind_name(r.kind));
}

}  // namespace md::exec
