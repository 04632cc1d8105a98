// The speculative draft's plan (plan.h compile_draft_plan; docs/speculative.md "The draft plan"):
// the DSpark draft's context update and block as instructions, in DraftModel's op order
// (spec/draft_forward.cpp, the reference these tiles reproduce bit for bit):
//   context: fc over the aux rows, hidden_norm, then per layer k | v of the context rows and
//            their k_norm + RoPE into the ring;
//   block:   embed, per layer q | k | v, attention over the ring and the block, o_proj +
//            residual, post-attention norm, the SiLU MLP and its residual (the decode plan's own
//            tiles: the draft's geometry is handed to them as a ModelConfig), the final norm,
//            lm_head of every block row, then the Markov-biased greedy picks slot by slot.
// The block's first layer does not wait for the context: its embedding and projections overlap
// the context update, and only its attention waits for the ring.
#include <algorithm>

#include "builder.h"

namespace md::plan {

namespace detail {

void Builder::build_draft() {
  const DraftConfig& dc = p_.draft.cfg;
  const int64_t D = dc.hidden_size, V = dc.vocab_size, Q = dc.q_width(), KV = dc.kv_width(),
                CW = dc.context_width();
  const int L = dc.num_layers, C = p_.draft.ctx_rows, NC = B_ * C, G = R_;
  p_.router_ids_buffer.assign(size_t(L), kNone);
  const size_t e = 2;  // bf16 matrices (what the draft's checkpoints hold)

  // Rows [t0, t1) of `n` in ranges of about n / (2W).
  auto ranges = [&](int n) {
    const int per = std::max(1, n / (2 * W_));
    std::vector<std::pair<int, int>> r;
    for (int t = 0; t < n; t += per) r.emplace_back(t, std::min(n, t + per));
    return r;
  };
  // Y = round(W X) over the NC context rows, in row blocks.
  auto ctx_gemv = [&](int layer, WeightKind k, int64_t rows, int64_t cols, const BufferDesc& x,
                      const BufferDesc& y, Wait wt, uint32_t sig) {
    const int64_t rb = tile_rows(rows, double(cols) * double(e), p_.options, W_);
    auto a = args({weight(k, layer), x, y});
    for (int64_t r = 0; r < rows; r += rb) {
      Instr in = make(Op::kDraftCtxProj, layer, {wt}, sig);
      in.r0 = uint32_t(r);
      in.r1 = uint32_t(std::min(rows, r + rb));
      emit(in, a,
           uint64_t(in.r1 - in.r0) * uint64_t(cols) * e +
               uint64_t(NC) * uint64_t(cols + (in.r1 - in.r0)) * 4);
    }
  };

  // ---- the context update -------------------------------------------------------------------
  std::vector<uint32_t> written(size_t(L), kNone);  // per layer: the ring rows are in
  if (C > 0) {
    const BufferDesc aux = arena_rows(CW, NC), feat = arena_rows(D, NC), ctx = arena_rows(D, NC),
                     pos = arena_rows(1, NC);
    p_.draft.aux = args({aux}).first;
    p_.draft.ctx_pos = args({pos}).first;
    const uint32_t fc_done = counter(Op::kDraftCtxProj, -1);
    ctx_gemv(-1, WeightKind::kDraftFc, D, CW, aux, feat, Wait{}, fc_done);
    const uint32_t normed = counter(Op::kDraftCtxNorm, -1);
    {
      auto a = args({feat, weight(WeightKind::kDraftHiddenNorm), ctx});
      for (auto r : ranges(NC)) {
        Instr in = make(Op::kDraftCtxNorm, -1, {all_of(fc_done)}, normed);
        in.r0 = uint32_t(r.first);
        in.r1 = uint32_t(r.second);
        emit(in, a, uint64_t(r.second - r.first) * uint64_t(D) * 12);
      }
    }
    for (int l = 0; l < L; ++l) {
      const BufferDesc ck = arena_rows(KV, NC), cv = arena_rows(KV, NC);
      const uint32_t kv_done = counter(Op::kDraftCtxProj, l);
      ctx_gemv(l, WeightKind::kDraftK, KV, D, ctx, ck, all_of(normed), kv_done);
      ctx_gemv(l, WeightKind::kDraftV, KV, D, ctx, cv, all_of(normed), kv_done);
      written[size_t(l)] = counter(Op::kDraftCtxWrite, l);
      auto a = args({ck, cv, weight(WeightKind::kDraftKNorm, l), pos,
                     state(StateKind::kDraftRing, l)});
      for (int b = 0; b < B_; ++b) {
        Instr in = make(Op::kDraftCtxWrite, l, {all_of(kv_done)}, written[size_t(l)]);
        in.seq = uint16_t(b);
        in.r0 = uint32_t(b);
        in.r1 = uint32_t(b + 1);
        emit(in, a, uint64_t(C) * uint64_t(KV) * 16);
      }
    }
  }
  if (G == 0) return;

  // ---- the block ----------------------------------------------------------------------------
  BufferDesc x = arena(D), h = arena(D);
  uint32_t ready = embed_tiles(x, h);
  // KV-head ranges per sequence: enough tiles for the workers, whole GQA groups each.
  const int Hkv = dc.num_kv_heads;
  const int per_kv = std::max(1, Hkv / std::max(1, int(ceil_div(W_, B_))));
  for (int l = 0; l < L; ++l) {
    const BufferDesc q = arena(Q), k = arena(KV), v = arena(KV), att = arena(Q);
    const uint32_t proj = counter(Op::kDraftProj, l);
    gemv_tiles(Op::kDraftProj, l, weight(WeightKind::kDraftQ, l), Q, D, e, h, q, all_of(ready),
               proj);
    gemv_tiles(Op::kDraftProj, l, weight(WeightKind::kDraftK, l), KV, D, e, h, k, all_of(ready),
               proj);
    gemv_tiles(Op::kDraftProj, l, weight(WeightKind::kDraftV, l), KV, D, e, h, v, all_of(ready),
               proj);
    const uint32_t attended = counter(Op::kDraftAttn, l);
    {
      auto a = args({q, k, v, weight(WeightKind::kDraftQNorm, l),
                     weight(WeightKind::kDraftKNorm, l), att, state(StateKind::kDraftRing, l)});
      const Wait ring = C > 0 ? all_of(written[size_t(l)]) : Wait{};
      for (int b = 0; b < B_; ++b)
        for (int h0 = 0; h0 < Hkv; h0 += per_kv) {
          Instr in = make(Op::kDraftAttn, l, {all_of(proj), ring}, attended);
          in.seq = uint16_t(b);
          in.r0 = uint32_t(h0);
          in.r1 = uint32_t(std::min(Hkv, h0 + per_kv));
          // The ring's visible rows (up to the window) and the block's, keys and values.
          emit(in, a,
               uint64_t(in.r1 - in.r0) * uint64_t(dc.head_dim) * 8 *
                   uint64_t(dc.window + G) / 4);
        }
    }
    BufferDesc x_mid = arena(D);
    const uint32_t attn_done = counter(Op::kAttnOut, l);
    gemv_tiles(Op::kAttnOut, l, weight(WeightKind::kDraftO, l), D, Q, e, att, x_mid,
               all_of(attended), attn_done, 0, kFlagResidual, &x, &x_mid);
    BufferDesc h2 = arena(D);
    const uint32_t norm_done = counter(Op::kFfnNorm, l);
    row_tiles(Op::kFfnNorm, l, args({x_mid, weight(WeightKind::kPostAttnNorm, l), h2}),
              {all_of(attn_done)}, norm_done, uint64_t(D) * 12);
    const FfnIo fio = ffn_io(l, x_mid, h2, norm_done);
    dense_ffn(l, fio);
    x = fio.x_next;
    h = fio.h_next;
    ready = fio.combined;
  }
  p_.draft.hidden = args({h}).first;

  // lm_head of every block row into the base logits.
  const BufferDesc base = arena(V), biased = arena(V);
  p_.draft.base = args({base}).first;
  p_.draft.biased = args({biased}).first;
  const uint32_t logits_done = counter(Op::kLmHead, -1);
  gemv_tiles(Op::kLmHead, -1, weight(WeightKind::kLmHead), V, D, e, h, base, all_of(ready),
             logits_done);

  // The Markov picks, slot after slot: each slot's tiles read its vocabulary rows of markov_w2
  // once for every sequence, and its pick reduces their (value, id) bests.
  const int64_t r = dc.markov_rank;
  const int64_t rb = tile_rows(V, double(r) * double(e), p_.options, W_);
  const int T = int(ceil_div(V, rb));
  const BufferDesc drafts = arena_rows(G, B_), best = arena_rows(2 * T, B_);
  p_.draft.drafts = args({drafts}).first;
  auto ma = args({base, weight(WeightKind::kMarkovW1), weight(WeightKind::kMarkovW2),
                  io(BufKind::kTokens), drafts, biased, best});
  auto pa = args({best, drafts});
  uint32_t picked = kNone;
  for (int k = 0; k < G; ++k) {
    const uint32_t scored = counter(Op::kDraftMarkov, -1, uint32_t(k));
    for (int j = 0; j < T; ++j) {
      Instr in = make(Op::kDraftMarkov, -1,
                      {all_of(logits_done), k > 0 ? all_of(picked) : Wait{}}, scored);
      in.slot = uint16_t(k);
      in.seq = uint16_t(j);
      in.r0 = uint32_t(int64_t(j) * rb);
      in.r1 = uint32_t(std::min<int64_t>(V, int64_t(j + 1) * rb));
      emit(in, ma,
           uint64_t(in.r1 - in.r0) * (uint64_t(r) * e + uint64_t(B_) * 8) +
               uint64_t(B_) * uint64_t(r) * 2);
    }
    picked = counter(Op::kDraftPick, -1, uint32_t(k));
    for (auto s : ranges(B_)) {
      Instr in = make(Op::kDraftPick, -1, {all_of(scored)}, picked);
      in.slot = uint16_t(k);
      in.seq = uint16_t(s.first);
      in.r0 = uint32_t(s.first);
      in.r1 = uint32_t(s.second);
      emit(in, pa, uint64_t(s.second - s.first) * uint64_t(T) * 8);
    }
  }
}

}  // namespace detail

ModelConfig draft_model_config(const DraftConfig& d) {
  ModelConfig c;
  c.vocab_size = d.vocab_size;
  c.hidden_size = d.hidden_size;
  c.num_layers = d.num_layers;
  c.rms_norm_eps = d.rms_norm_eps;
  c.activation = Activation::kSilu;
  c.attn_kind.assign(size_t(d.num_layers), AttnKind::MLA);
  c.ffn_kind.assign(size_t(d.num_layers), FfnKind::Dense);
  c.intermediate_size = d.intermediate_size;
  return c;
}

}  // namespace md::plan
