// One instruction of the decode plan on the CPU kernels: the dense ops, the FFN and MoE tiles,
// sampling, the dispatch, the scratch sizes and the weight prefetcher (the attention tiles are in
// tiles_attention.cpp). Every tile reproduces, for its matrix rows / heads / token rows, exactly
// the operations and bf16 rounding points of Model::forward's decode path (engine/model.cpp),
// the comments name the reference statement each step mirrors. Activations are per token row
// (StepCtx: N = batch * rows); a row's arithmetic does not depend on how many rows a step has.
#include "tiles.h"

#include "megadecode/plan/ops.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <span>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/attn_res.h"
#include "megadecode/kernels/cpu/expert_slots.h"
#include "megadecode/kernels/cpu/kda.h"
#include "megadecode/kernels/cpu/linear.h"
#include "megadecode/kernels/cpu/matmul.h"
#include "megadecode/kernels/cpu/mla.h"
#include "megadecode/kernels/cpu/mxfp4.h"

namespace md::exec {

using plan::BufferDesc;
using plan::BufKind;
using plan::Instr;
using plan::Op;

namespace {}  // namespace

namespace detail {

void gemv_rows(const WeightView& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
               float* Y, int64_t ldy, bool x_bf16) {
  // Y holds the outputs of rows r0..: the kernel writes Y[b * ldy + r] for r in [r0, r1).
  const cpu::LinearWeights lw{w.data,  w.scales,       w.dtype,       w.quant,   w.cols,
                              w.group, w.int_act_bits, w.zero_points, w.col_perm};
  cpu::linear_rows(lw, r0, r1, X, B, ldx, Y - r0, ldy, x_bf16);
}

}  // namespace detail

namespace {

using detail::Args;
using detail::gemv_rows;
using detail::maybe_round;

// [W, X, Y]: Y[t][r0:r1] = round(W X[t]) for every token row (lm_head: every logit row).
void gemv_tile(const StepCtx& s, const Instr& in, const Args& a) {
  using G = plan::arg::Gemv;
  const WeightView& w = a.w(G::w);
  int B = s.n;
  float* Y;
  int64_t ldy;
  if (a.a[G::y].kind == BufKind::kLogits) {
    Y = s.logits;
    ldy = s.cfg->vocab_size;
    B = s.n_logits;
    if (B == 0) return;
  } else {
    Y = a.f(G::y);
    ldy = a.ld(G::y);
  }
  const int64_t n = int64_t(in.r1) - in.r0;
  gemv_rows(w, in.r0, in.r1, a.f(G::x), B, a.ld(G::x), Y + in.r0, ldy, s.num.round_bf16);
  // A distributed rank's partial sums stay fp32 until the all-reduce has added them up.
  if (s.num.round_bf16 && !(in.flags & plan::kFlagPartial))
    for (int b = 0; b < B; ++b) cpu::round_bf16_inplace(Y + b * ldy + in.r0, n);
}

// arg::AttnOut: out = round(resid + round(W x)) on rows [r0, r1) (o_proj, add_inplace).
// Without kFlagResidual (K3, a new block's partial sum): out = round(W x).
void attn_out_tile(const StepCtx& s, const Instr& in, const Args& a) {
  using A = plan::arg::AttnOut;
  const int B = s.n;
  const bool resid = in.flags & plan::kFlagResidual;
  const int64_t n = int64_t(in.r1) - in.r0;
  float* out = a.f(A::out);
  gemv_rows(a.w(A::w), in.r0, in.r1, a.f(A::x), B, a.ld(A::x), out + in.r0, a.ld(A::out),
            s.num.round_bf16);
  if (in.flags & plan::kFlagPartial) return;  // distributed: kAllReduce rounds and adds
  for (int b = 0; b < B; ++b) {
    float* y = a.f(A::out, b) + in.r0;
    maybe_round(y, n, s.num.round_bf16);
    if (!resid) continue;
    // x = round(x + o): the residual is the left operand, as in the reference.
    const float* x = a.f(A::resid, b) + in.r0;
    if (s.num.round_bf16)
      for (int64_t i = 0; i < n; ++i) y[i] = round_bf16(x[i] + y[i]);
    else
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] + y[i];
  }
}

// K3's block attention residual mix of sequence b: operands first .. nargs-1 of the
// instruction are [score weights, sources...] (the block summaries, then the partial sum).
const float* res_mix(const StepCtx& s, const Instr& in, const Args& a, int first, int b,
                     float* out) {
  const float* src[plan::kMaxResSources];
  const int n = int(in.nargs) - first - 1;
  MD_CHECK(n >= 1 && n <= plan::kMaxResSources, "decode plan: #{} mixes {} sources", in.id, n);
  for (int j = 0; j < n; ++j) src[j] = a.f(first + 1 + j, b);
  cpu::attn_res_mix(src, n, a.vec(first), s.cfg->hidden_size, s.num.eps, out, s.num.round_bf16);
  return out;
}

// [Wg, Wu, X, act]: act[t][r0:r1] = glu(round(G X), round(U X)).
void gate_up_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using U = plan::arg::GateUp;
  const int B = s.n;
  const int64_t n = int64_t(in.r1) - in.r0;
  float* g = sc.f.data();
  float* u = g + B * n;
  gemv_rows(a.w(U::gate), in.r0, in.r1, a.f(U::x), B, a.ld(U::x), g, n, s.num.round_bf16);
  gemv_rows(a.w(U::up), in.r0, in.r1, a.f(U::x), B, a.ld(U::x), u, n, s.num.round_bf16);
  maybe_round(g, B * n, s.num.round_bf16);
  maybe_round(u, B * n, s.num.round_bf16);
  for (int b = 0; b < B; ++b) glu(s.num, g + b * n, u + b * n, n, a.f(U::act, b) + in.r0);
}

// [tokens, embed, x0, norm, h0] of token row b
void embed_seq(const StepCtx& s, const Args& a, int b) {
  using E = plan::arg::Embed;
  const int64_t D = s.cfg->hidden_size;
  const WeightView& e = a.w(E::embed);
  const int32_t tok = s.tokens[b];
  float* x = a.f(E::x0, b);
  if (e.dtype == DType::F32) {
    const float* row = static_cast<const float*>(e.data) + int64_t(tok) * e.cols;
    std::copy(row, row + D, x);
  } else {
    const bf16* row = static_cast<const bf16*>(e.data) + int64_t(tok) * e.cols;
    for (int64_t j = 0; j < D; ++j) x[j] = bf16_to_f32(row[j]);
  }
  cpu::rmsnorm(x, a.vec(E::norm), D, s.num.eps, a.f(E::h0, b), s.num.round_bf16);
}

// [tokens, embed, x0, norm, h0]; token rows [r0, r1).
void embed_tile(const StepCtx& s, const Instr& in, const Args& a) {
  for (int b = int(in.r0); b < int(in.r1); ++b) embed_seq(s, a, b);
}

// [logits, next]: logit rows [r0, r1) (of those the step has) pick their next token from their
// SampleRow (plain data; none: greedy, ties to the lowest id).
void sample_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  if (s.greedy_exchange) return;  // kLogitsGather wrote the ids
  const int64_t V = s.cfg->vocab_size;
  const SampleRow greedy;
  for (int b = int(in.r0); b < std::min(int(in.r1), s.n_logits); ++b) {
    const float* row = s.logits + int64_t(b) * V;
    const SampleRow& r = s.sampling ? s.sampling[b] : greedy;
    a.ints(plan::arg::Sample::next, b)[0] =
        sample_row(r, std::span<const float>(row, size_t(V)), sc.sample);
  }
}

// [x_mid, norm, h2] (+ K3's [res_w, sources...]: the norm of the mix, not of x_mid)
void ffn_norm_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using F = plan::arg::FfnNorm;
  for (int b = int(in.r0); b < int(in.r1); ++b) {
    const float* x = a.f(F::x, b);
    if (in.flags & plan::kFlagAttnRes) x = res_mix(s, in, a, F::count, b, sc.f.data());
    cpu::rmsnorm(x, a.vec(F::norm), s.cfg->hidden_size, s.num.eps, a.f(F::h, b), s.num.round_bf16);
  }
}

// [router, h2, logits]: the router's logits rows [r0, r1) for every token row, fp32 (the
// reference's router never rounds them).
void router_logits_tile(const StepCtx& s, const Instr& in, const Args& a) {
  using G = plan::arg::Gemv;
  gemv_rows(a.w(G::w), in.r0, in.r1, a.f(G::x), s.n, a.ld(G::x), a.f(G::y) + in.r0, a.ld(G::y),
            s.num.round_bf16);
}

// [logits, bias, ids, wts]
void router_tile(const StepCtx& s, const Instr& in, const Args& a) {
  using Ro = plan::arg::Router;
  for (int b = int(in.r0); b < int(in.r1); ++b)
    cpu::route_topk(a.f(Ro::logits, b), a.vec(Ro::bias), s.num.router, a.ints(Ro::ids, b),
                    a.f(Ro::wts, b));
}

// The u-th distinct expert chosen by the step's token rows (ascending id) and the (row, slot)
// pairs that chose it, in row order. Returns false when the rows chose fewer experts.
// Both expert ops read the router's ids in their first slot.
constexpr int kIds = plan::arg::ExpertGateUp::ids;
static_assert(kIds == plan::arg::ExpertDown::ids);
bool expert_slot(const StepCtx& s, const Args& a, int u, Scratch& sc, int* expert, int* n) {
  const int E = s.cfg->num_experts, k = s.cfg->num_experts_per_token, B = s.n;
  int* members = sc.i.data() + E;  // pairs (b, j)
  int32_t* list = members + 2 * B * k;
  const int nd =
      cpu::distinct_experts(a.ints(kIds), size_t(a.ld(kIds)), B, k, E, sc.i.data(), list);
  if (u >= nd) return false;
  const int e = list[u];
  int m = 0;
  for (int b = 0; b < B; ++b) {
    const int32_t* ids = a.ints(kIds, b);
    for (int j = 0; j < k; ++j)
      if (ids[j] == e) {
        members[2 * m] = b;
        members[2 * m + 1] = j;
        ++m;
      }
  }
  *expert = e;
  *n = m;
  return true;
}

// [ids, h2, gate set, up set, act]: rows [r0, r1) of gate/up of the slot's expert for every
// sequence that chose it; act[b][j * I + r] for the pair (b, j).
void expert_gate_up_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using Xg = plan::arg::ExpertGateUp;
  int e, n;
  if (!expert_slot(s, a, in.slot, sc, &e, &n)) return;
  if (!a.w(Xg::gate, e).data) return;  // another rank's expert (distributed)
  const int64_t D = s.cfg->expert_dim(), I = s.cfg->moe_intermediate_size;  // D: input width
  const int64_t rows = int64_t(in.r1) - in.r0;
  const int* members = sc.i.data() + s.cfg->num_experts;
  float* g = sc.f.data();
  float* u = g + int64_t(n) * rows;
  const float* X;
  int64_t ldx;
  if (n == 1) {
    X = a.f(Xg::x, members[0]);
    ldx = a.ld(Xg::x);
  } else {
    float* xg = u + int64_t(n) * rows;
    for (int m = 0; m < n; ++m) std::memcpy(xg + m * D, a.f(Xg::x, members[2 * m]), size_t(D) * 4);
    X = xg;
    ldx = D;
  }
  gemv_rows(a.w(Xg::gate, e), in.r0, in.r1, X, n, ldx, g, rows, s.num.round_bf16);
  gemv_rows(a.w(Xg::up, e), in.r0, in.r1, X, n, ldx, u, rows, s.num.round_bf16);
  maybe_round(g, n * rows, s.num.round_bf16);
  maybe_round(u, n * rows, s.num.round_bf16);
  for (int m = 0; m < n; ++m) {
    float* act = a.f(Xg::act, members[2 * m]) + int64_t(members[2 * m + 1]) * I + in.r0;
    glu(s.num, g + m * rows, u + m * rows, rows, act);
  }
}

// [ids, act, down set, dn]: rows [r0, r1) of the slot's expert's down projection;
// dn[b][j * D + r] = round(down act[b][j]) (D: the experts' output width, K3's latent).
void expert_down_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using Dn = plan::arg::ExpertDown;
  int e, n;
  if (!expert_slot(s, a, in.slot, sc, &e, &n)) return;
  const int64_t D = s.cfg->expert_dim(), I = s.cfg->moe_intermediate_size;
  const int64_t rows = int64_t(in.r1) - in.r0;
  const int* members = sc.i.data() + s.cfg->num_experts;
  if (!a.w(Dn::down, e).data) {
    // Another rank's expert (distributed): zeros, so that the all-reduce adds only its owner's.
    for (int m = 0; m < n; ++m) {
      float* out = a.f(Dn::out, members[2 * m]) + int64_t(members[2 * m + 1]) * D + in.r0;
      std::fill(out, out + rows, 0.0f);
    }
    return;
  }
  float* y = sc.f.data();
  float* xg = y + int64_t(n) * rows;
  for (int m = 0; m < n; ++m)
    std::memcpy(xg + m * I, a.f(Dn::act, members[2 * m]) + int64_t(members[2 * m + 1]) * I,
                size_t(I) * 4);
  gemv_rows(a.w(Dn::down, e), in.r0, in.r1, xg, n, I, y, rows, s.num.round_bf16);
  maybe_round(y, n * rows, s.num.round_bf16 && !(in.flags & plan::kFlagPartial));
  for (int m = 0; m < n; ++m)
    std::copy(y + m * rows, y + (m + 1) * rows,
              a.f(Dn::out, members[2 * m]) + int64_t(members[2 * m + 1]) * D + in.r0);
}

// MoE: [x_mid, wts, dn, shared_out, x_next, norm, h_next]; dense: [x_mid, out, x_next, norm,
// h_next]; K3's latent MoE: [x_mid, -, up, shared_out, x_next, norm, h_next]. The routed sum
// runs over the sequence's experts in ascending id with a rounding after each product and each
// add (Forward::moe), then the shared expert, then the residual. With kFlagAttnRes the
// operands go on with [res_w, sources...] and the norm is of K3's mix.
void combine_seq(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc, int b) {
  using Cb = plan::arg::Combine;
  const int64_t D = s.cfg->hidden_size;
  const bool moe = in.flags & plan::kFlagMoeCombine;
  float* x = a.f(Cb::x_next, b);
  std::copy(a.f(Cb::x_mid, b), a.f(Cb::x_mid, b) + D, x);
  if (moe && (in.flags & plan::kFlagLatentMoe)) {
    float* out = sc.f.data();
    std::copy(a.f(Cb::out, b), a.f(Cb::out, b) + D, out);
    if (in.flags & plan::kFlagSharedExpert)
      add_inplace(out, a.f(Cb::shared, b), D, s.num.round_bf16);
    add_inplace(x, out, D, s.num.round_bf16);
  } else if (moe) {
    const int k = s.cfg->num_experts_per_token;
    float* out = sc.f.data();
    float* tmp = out + D;
    std::fill(out, out + D, 0.0f);
    const float* wts = a.f(Cb::wts, b);
    for (int j = 0; j < k; ++j) {
      const float* y = a.f(Cb::out, b) + int64_t(j) * D;
      const float wt = wts[j];
      for (int64_t i = 0; i < D; ++i) tmp[i] = y[i] * wt;
      maybe_round(tmp, D, s.num.round_bf16);
      add_inplace(out, tmp, D, s.num.round_bf16);
    }
    if (in.flags & plan::kFlagSharedExpert)
      add_inplace(out, a.f(Cb::shared, b), D, s.num.round_bf16);
    add_inplace(x, out, D, s.num.round_bf16);
  } else {
    add_inplace(x, a.f(Cb::out, b), D, s.num.round_bf16);
  }
  // The last layer's combine writes the final norm only for the rows that asked for logits,
  // compacted (the lm_head's input).
  int dst = b;
  if (in.flags & plan::kFlagLogitRows) {
    dst = s.logit_of_row[b];
    if (dst < 0) return;
  }
  const float* src = x;
  if (in.flags & plan::kFlagAttnRes) src = res_mix(s, in, a, Cb::count, b, sc.f.data() + 2 * D);
  cpu::rmsnorm(src, a.vec(Cb::norm), D, s.num.eps, a.f(Cb::h_next, dst), s.num.round_bf16);
}

// [wts, dn, latent_norm (or null), r]: K3's routed sum of sequences [r0, r1) in the latent:
// fp32 products and adds in ascending expert id, rounded once, then RMSNorm (Forward::moe).
void latent_norm_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  using Ln = plan::arg::LatentNorm;
  const int64_t X = s.cfg->expert_dim();
  const int k = s.cfg->num_experts_per_token;
  float* acc = sc.f.data();
  for (int b = int(in.r0); b < int(in.r1); ++b) {
    std::fill(acc, acc + X, 0.0f);
    const float* wts = a.f(Ln::wts, b);
    for (int j = 0; j < k; ++j) {
      const float* y = a.f(Ln::dn, b) + int64_t(j) * X;
      const float wt = wts[j];
      for (int64_t i = 0; i < X; ++i) acc[i] += y[i] * wt;
    }
    maybe_round(acc, X, s.num.round_bf16);
    if (a.present(Ln::norm))
      cpu::rmsnorm(acc, a.vec(Ln::norm), X, s.num.eps, a.f(Ln::r, b), s.num.round_bf16);
    else
      std::copy(acc, acc + X, a.f(Ln::r, b));
  }
}

void combine_tile(const StepCtx& s, const Instr& in, const Args& a, Scratch& sc) {
  for (int b = int(in.r0); b < int(in.r1); ++b) combine_seq(s, in, a, sc, b);
}

}  // namespace

size_t scratch_floats(const plan::Plan& p) {
  const ModelConfig& c = p.cfg;
  const int64_t B = p.token_rows(), R = p.rows, D = c.hidden_size;
  const int64_t I =
      std::max({c.intermediate_size, c.moe_intermediate_size, c.shared_intermediate()});
  const int64_t X = std::max(D, c.expert_dim());                      // the routed experts' width
  int64_t n = 3 * D;                                                  // combine (+ K3's mix)
  n = std::max<int64_t>(n, R * (5 * c.kda_dim() + c.kda_num_heads));  // kda core
  n = std::max<int64_t>(n, 2 * B * I);          // gate/up
  n = std::max<int64_t>(n, B * X + 2 * B * I);  // expert gate/up (+ gathered inputs)
  n = std::max<int64_t>(n, B * I + B * X);      // expert down
  n = std::max<int64_t>(n, B * c.q_lora_rank);  // K3's q LoRA: the normed q_a of the batch
  // MLA decode (mla_decode_absorbed: partials, absorbed queries, block scores, merge accumulator).
  const int64_t mla = int64_t(c.mla_num_heads) * (2 * c.kv_lora_rank + c.qk_rope_head_dim + 2) +
                      c.kv_lora_rank + 64;
  n = std::max<int64_t>(n, mla);
  n = std::max<int64_t>(n, c.mla_cache_width());  // a latent row before it is stored
  return std::max(size_t(n + 64), detail::draft_scratch_floats(p));
}

size_t scratch_ints(const plan::Plan& p) {
  // expert_slot: marks [E], members [2 N k], the distinct list [E].
  return std::max(size_t(2 * p.cfg.num_experts +
                         2 * p.token_rows() * std::max(p.cfg.num_experts_per_token, 1) + 16),
                  detail::draft_scratch_ints(p));
}

namespace {

// Ops whose [r0, r1) are token rows (op table): the plan covers batch x rows of them, a step may
// have fewer (sequences with fewer rows than the plan's).
const std::array<bool, plan::kNumOps>& token_row_ops() {
  static const std::array<bool, plan::kNumOps> t = [] {
    std::array<bool, plan::kNumOps> r{};
    for (size_t i = 0; i < r.size(); ++i) r[i] = plan::op_desc(Op(i)).ranges == "token rows";
    return r;
  }();
  return t;
}

}  // namespace

void run_instr(const StepCtx& s, const Instr& instr, Scratch& sc) {
  using namespace detail;
  const Instr* ip = &instr;
  Instr clipped;
  if (token_row_ops()[size_t(instr.op)] && instr.r1 > uint32_t(s.n)) {
    if (instr.r0 >= uint32_t(s.n)) return;  // rows this step does not have
    clipped = instr;
    clipped.r1 = uint32_t(s.n);
    ip = &clipped;
  }
  const Instr& in = *ip;
  const Args a{s, s.plan->buffers.data() + in.args, in.layer};
  switch (in.op) {
    case Op::kEmbed:
      return embed_tile(s, in, a);
    case Op::kKdaProj:
    case Op::kMlaProj:
    case Op::kDenseDown:
    case Op::kSharedDown:
    case Op::kLatentDown:
    case Op::kLatentUp:
    case Op::kLmHead:
      return gemv_tile(s, in, a);
    case Op::kMlaQUp:
      return mla_q_up_tile(s, in, a, sc);
    case Op::kLatentNorm:
      return latent_norm_tile(s, in, a, sc);
    case Op::kKdaCore:
      return kda_core_tile(s, in, a, sc);
    case Op::kMlaLatent:
      return mla_latent_tile(s, in, a, sc);
    case Op::kMlaCore:
      return mla_core_tile(s, in, a, sc);
    case Op::kMlaMerge:
      return mla_merge_tile(s, in, a, sc);
    case Op::kAttnOut:
      return attn_out_tile(s, in, a);
    case Op::kFfnNorm:
      return ffn_norm_tile(s, in, a, sc);
    case Op::kRouterLogits:
      return router_logits_tile(s, in, a);
    case Op::kRouter:
      return router_tile(s, in, a);
    case Op::kDenseGateUp:
    case Op::kSharedGateUp:
      return gate_up_tile(s, in, a, sc);
    case Op::kExpertGateUp:
      return expert_gate_up_tile(s, in, a, sc);
    case Op::kExpertDown:
      return expert_down_tile(s, in, a, sc);
    case Op::kCombine:
      return combine_tile(s, in, a, sc);
    case Op::kSample:
      return sample_tile(s, in, a, sc);
    case Op::kDraftCtxProj:
      return draft_ctx_proj_tile(s, in, a);
    case Op::kDraftCtxNorm:
      return draft_ctx_norm_tile(s, in, a);
    case Op::kDraftCtxWrite:
      return draft_ctx_write_tile(s, in, a, sc);
    case Op::kDraftProj:
      return gemv_tile(s, in, a);
    case Op::kDraftAttn:
      return draft_attn_tile(s, in, a, sc);
    case Op::kDraftMarkov:
      return draft_markov_tile(s, in, a, sc);
    case Op::kDraftPick:
      return draft_pick_tile(s, in, a);
    case Op::kAllReduce:
      return all_reduce_tile(s, in, a);
    case Op::kLogitsGather:
      return logits_gather_tile(s, in, a);
    case Op::kAllGather:
      return all_gather_tile(s, in, a);
    case Op::kCount:
      break;
  }
  fail("decode plan: instruction #{} has an unknown opcode {}", in.id, int(in.op));
}

// Bytes of one row as stored (quantized: the codes; the scales, a few percent of that, are not
// prefetched).
static size_t stored_row_bytes(const WeightView& w) {
  return cpu::stored_row_bytes(w.quant, w.dtype, w.cols);
}

void Prefetcher::add(const void* base, size_t row_bytes, uint32_t rows) {
  if (n_ < 3 && base && row_bytes && rows)
    r_[n_++] = Range{static_cast<const char*>(base), row_bytes, rows};
}

void Prefetcher::start(const StepCtx& s, const Instr& in, bool expert_ids_visible) {
  n_ = cur_ = 0;
  group_ = row_ = 0;
  col_ = 0;
  budget_ = size_t{1} << 20;  // at most half a core's L2 ahead
  const BufferDesc* a = s.plan->buffers.data() + in.args;
  auto rows_of = [&](int i, uint32_t r0, uint32_t r1) {
    if (a[i].kind != BufKind::kWeight) return;
    const WeightView& w = s.weights[a[i].offset];
    const size_t rb = stored_row_bytes(w);
    add(static_cast<const char*>(w.data) + size_t(r0) * rb, rb, r1 - r0);
  };
  const plan::OpDesc& d = plan::op_desc(in.op);
  const uint8_t* so = d.stream_operands;
  switch (d.stream) {
    case plan::Stream::kNone:
      break;
    case plan::Stream::kRows:
      for (int k = 0; k < 2; ++k)
        if (so[k] != 0xff) rows_of(so[k], in.r0, in.r1);
      break;
    case plan::Stream::kKdaHeads: {
      const int K = s.cfg->kda_head_dim;
      for (int k = 0; k < 2; ++k)
        if (so[k] != 0xff) rows_of(so[k], in.r0 * K, in.r1 * K);
      // This sequence's state of these heads (contiguous).
      const float* S = s.seqs[size_t(in.seq) * size_t(s.cfg->num_layers) + in.layer].kda_state;
      add(S + size_t(in.r0) * K * K, size_t(K) * K * 4, in.r1 - in.r0);
      break;
    }
    case plan::Stream::kMlaHeads: {
      const int NV = s.cfg->qk_nope_head_dim + s.cfg->v_head_dim;
      rows_of(so[0], in.r0 * NV, in.r1 * NV);
      break;
    }
    case plan::Stream::kMlaValues: {  // the W_UV rows of the heads
      const int N = s.cfg->qk_nope_head_dim, NV = N + s.cfg->v_head_dim;
      for (uint32_t h = in.r0; h < in.r1 && h < in.r0 + 3; ++h)
        rows_of(so[0], h * NV + N, (h + 1) * NV);
      break;
    }
    case plan::Stream::kExpert: {
      if (!expert_ids_visible) break;
      // The slot's expert: the u-th distinct id the rows chose, ascending (as expert_slot).
      const int E = s.cfg->num_experts, k = s.cfg->num_experts_per_token;
      if (int(mark_.size()) < 2 * E) mark_.resize(size_t(2 * E));  // once per worker
      const int nd =
          cpu::distinct_experts(reinterpret_cast<const int32_t*>(s.arena + a[kIds].offset),
                                a[kIds].stride / 4, s.n, k, E, mark_.data(), mark_.data() + E);
      if (int(in.slot) >= nd) break;  // an empty slot
      const int e = mark_[size_t(E) + in.slot];
      for (int j = 0; j < 2; ++j) {
        if (so[j] == 0xff) continue;
        const WeightView& w = s.weights[a[so[j]].offset + uint64_t(e)];
        if (!w.data) continue;  // another rank's expert (distributed)
        const size_t rb = stored_row_bytes(w);
        add(static_cast<const char*>(w.data) + size_t(in.r0) * rb, rb, in.r1 - in.r0);
      }
      break;
    }
  }
}

int Prefetcher::spans(cpu::ByteSpan* out, int max) const {
  int k = 0;
  for (int i = 0; i < n_ && k < max; ++i)
    out[k++] = {r_[i].base, r_[i].base + r_[i].row_bytes * r_[i].rows};
  return k;
}

bool Prefetcher::step(int lines) {
  while (lines > 0 && cur_ < n_) {
    const Range& r = r_[cur_];
    const uint32_t g0 = group_ * 16, gn = std::min<uint32_t>(16, r.rows - g0);
    __builtin_prefetch(r.base + size_t(g0 + row_) * r.row_bytes + col_, 0, 2);
    --lines;
    if (budget_ <= 64) {
      cur_ = n_;
      break;
    }
    budget_ -= 64;
    if (++row_ < gn) continue;
    row_ = 0;
    col_ += 64;
    if (col_ < r.row_bytes) continue;
    col_ = 0;
    if (++group_ * 16 < r.rows) continue;
    group_ = 0;
    ++cur_;
  }
  return cur_ < n_;
}

}  // namespace md::exec
