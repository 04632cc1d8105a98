// The decode plan's attention ops (builder.h): Kimi Delta Attention and NoPE MLA, with Kimi K3's
// options (full-rank KDA output gate, lower-bounded decay, q LoRA, MLA output gate).
#include <algorithm>

#include "builder.h"

namespace md::plan::detail {

std::tuple<BufferDesc, uint32_t, int64_t, const Mat*> Builder::kda_layer(int l, const BufferDesc& h,
                                                                         uint32_t ready) {
  const ModelConfig& c = c_;
  const int H = c.kda_num_heads, K = c.kda_head_dim;
  const int64_t C = c.kda_dim(), D = c.hidden_size;
  const LayerWeights* L = lw(l);
  // K3's full-rank output gate g [C] replaces the low-rank g_a/g_b; its rows are per channel, so
  // they are tiled with q, k and v.
  const bool full_gate = c.kda_full_rank_gate;
  BufferDesc q = arena(C), k = arena(C), v = arena(C), fa = arena(K),
             ga = arena(full_gate ? C : int64_t(K)), braw = arena(H), o = arena(C);
  const Wait in_ready = all_of(ready);

  // Low-rank gate inputs and beta (every head needs them): f_a, g_a, b.
  const uint32_t lowrank = counter(Op::kKdaProj, l, uint32_t(H));
  gemv_tiles(Op::kKdaProj, l, weight(WeightKind::kKdaFA, l), K, D, elt(L ? &L->kda.f_a : nullptr),
             h, fa, in_ready, lowrank);
  if (!full_gate)
    gemv_tiles(Op::kKdaProj, l, weight(WeightKind::kKdaGA, l), K, D, elt(L ? &L->kda.g_a : nullptr),
               h, ga, in_ready, lowrank);
  gemv_tiles(Op::kKdaProj, l, weight(WeightKind::kKdaB, l), H, D, elt(L ? &L->kda.b : nullptr), h,
             braw, in_ready, lowrank);

  // The cores work on ranges of consecutive heads of one sequence: enough ranges to occupy
  // the workers at small batch, and contiguous, so that two workers rarely write neighbouring
  // heads of one sequence's conv cache and state (which the sequence stores unaligned: false
  // sharing).
  const int ranges = int(std::clamp<int64_t>(ceil_div(2 * int64_t(W_), B_), 1, H));
  const int hpr = int(ceil_div(H, ranges));
  // q, k, v row blocks aligned to heads and nested in the core ranges; one counter per range.
  const double e = elt(L ? &L->kda.q : nullptr);
  HeadTiling ht = head_tiling(H, K, double(D) * double(e), p_.options, W_);
  if (ht.group > 1) {
    ht.group = std::min(ht.group, hpr);
    while (hpr % ht.group) --ht.group;
  }
  auto aq = args({weight(WeightKind::kKdaQ, l), h, q});
  auto ak = args({weight(WeightKind::kKdaK, l), h, k});
  auto av = args({weight(WeightKind::kKdaV, l), h, v});
  std::pair<uint32_t, uint32_t> ag{0, 0};  // K3's full-rank gate rows (none: nargs 0)
  if (full_gate) ag = args({weight(WeightKind::kKdaG, l), h, ga});
  std::vector<uint32_t> range_ctr;
  for (int r0 = 0; r0 < H; r0 += hpr) {
    const int r1 = std::min(H, r0 + hpr);
    const uint32_t ctr = counter(Op::kKdaProj, l, uint32_t(r0));
    range_ctr.push_back(ctr);
    for (int h0 = r0; h0 < r1; h0 += ht.group) {
      const int h1 = std::min(r1, h0 + ht.group);
      // One tile of whole heads [h0, h1), or one head in `split` parts.
      const int64_t step = ht.split > 1 ? int64_t(K) / ht.split : int64_t(h1 - h0) * K;
      for (auto* a : {&aq, &ak, &av, &ag}) {
        if (a->second == 0) continue;
        for (int64_t r = int64_t(h0) * K; r < int64_t(h1) * K; r += step) {
          Instr in = make(Op::kKdaProj, l, {in_ready}, ctr);
          in.r0 = uint32_t(r);
          in.r1 = uint32_t(r + step);
          emit(in, *a, uint64_t(step) * uint64_t(D) * e + uint64_t(N_) * uint64_t(D + step) * 4);
        }
      }
    }
  }

  // Per head range and sequence: conv + gates + delta rule + gated norm, over its R rows.
  const uint32_t core_done = counter(Op::kKdaCore, l);
  // ga: the low-rank gate input [K], or (full_gate) the gate itself [C]; g_b absent then.
  auto a = args({q, k, v, fa, ga, braw, o, weight(WeightKind::kKdaFB, l),
                 full_gate ? null() : weight(WeightKind::kKdaGB, l),
                 weight(WeightKind::kKdaQConv, l), weight(WeightKind::kKdaKConv, l),
                 weight(WeightKind::kKdaVConv, l), weight(WeightKind::kKdaALog, l),
                 weight(WeightKind::kKdaDtBias, l), weight(WeightKind::kKdaONorm, l),
                 state(StateKind::kKdaState, l), state(StateKind::kConvCache, l)});
  const uint64_t head_bytes = 2ull * K * K * 4 + (full_gate ? 1ull : 2ull) * K * K * 2 +
                              6ull * K * uint64_t(c.kda_conv_size) * 4 + 8ull * K * 4;
  for (size_t r = 0; r < range_ctr.size(); ++r)
    for (int b = 0; b < B_; ++b) {
      Instr in = make(Op::kKdaCore, l, {all_of(range_ctr[r]), all_of(lowrank)}, core_done);
      in.seq = uint16_t(b);
      in.flags = uint32_t((full_gate ? kFlagFullRankGate : 0) |
                          (c.kda_bounded_decay ? kFlagBoundedDecay : 0));
      in.r0 = uint32_t(int(r) * hpr);
      in.r1 = uint32_t(std::min(H, int(r + 1) * hpr));
      emit(in, a, head_bytes * (in.r1 - in.r0) * uint64_t(R_));
    }
  return {o, core_done, C, L ? &L->kda.o : nullptr};
}

std::tuple<BufferDesc, uint32_t, int64_t, const Mat*> Builder::mla_layer(int l, const BufferDesc& h,
                                                                         uint32_t ready) {
  const ModelConfig& c = c_;
  const int H = c.mla_num_heads, N = c.qk_nope_head_dim, P = c.qk_rope_head_dim, V = c.v_head_dim,
            R = c.kv_lora_rank;
  const int64_t D = c.hidden_size, QW = int64_t(H) * (N + P), CW = R + P;
  const LayerWeights* L = lw(l);
  const int Q = c.q_lora_rank;
  const bool gated = c.mla_output_gate;
  BufferDesc q = arena(QW), a_out = arena(CW), att = arena(int64_t(H) * V);
  BufferDesc qa = Q > 0 ? arena(Q) : null(), gate = gated ? arena(int64_t(H) * V) : null();
  const Wait in_ready = all_of(ready);

  // K3's q LoRA: q_a on h first (its rows signal qa_done).
  uint32_t qa_done = kNone;
  if (Q > 0) {
    qa_done = counter(Op::kMlaProj, l, 2);
    gemv_tiles(Op::kMlaProj, l, weight(WeightKind::kMlaQA, l), Q, D, elt(L ? &L->mla.q_a : nullptr),
               h, qa, in_ready, qa_done);
  }
  const uint32_t kva_done = counter(Op::kMlaProj, l, 1);
  gemv_tiles(Op::kMlaProj, l, weight(WeightKind::kMlaKvA, l), CW, D,
             elt(L ? &L->mla.kv_a : nullptr), h, a_out, in_ready, kva_done);
  // q_done: every query row and (K3) every output-gate row, which the cores (or the merges)
  // apply to their heads: one counter keeps the cores at two waits.
  const uint32_t q_done = counter(Q > 0 ? Op::kMlaQUp : Op::kMlaProj, l, 0);
  if (gated)
    gemv_tiles(Op::kMlaProj, l, weight(WeightKind::kMlaG, l), int64_t(H) * V, D,
               elt(L ? &L->mla.g : nullptr), h, gate, in_ready, q_done);
  if (Q > 0) {
    // q = round(q_b RMSNorm(q_a h)): each row block normalises the batch's q_a rows itself
    // (Q values per sequence, cheap next to its rows of q_b), which saves a synchronisation.
    const double e = elt(L ? &L->mla.q_b : nullptr);
    const int64_t rb = tile_rows(QW, double(Q) * double(e), p_.options, W_);
    auto a = args({weight(WeightKind::kMlaQB, l), qa, weight(WeightKind::kMlaQANorm, l), q});
    for (int64_t r = 0; r < QW; r += rb) {
      Instr in = make(Op::kMlaQUp, l, {all_of(qa_done)}, q_done);
      in.r0 = uint32_t(r);
      in.r1 = uint32_t(std::min(QW, r + rb));
      emit(in, a,
           uint64_t(in.r1 - in.r0) * uint64_t(Q) * e +
               uint64_t(N_) * uint64_t(2 * Q + (in.r1 - in.r0)) * 4);
    }
  } else {
    gemv_tiles(Op::kMlaProj, l, weight(WeightKind::kMlaQ, l), QW, D, elt(L ? &L->mla.q : nullptr),
               h, q, in_ready, q_done);
  }

  // Latent cache rows by ranges of whole sequences (the executor gives the caches their pages
  // before the step; a sequence's rows are known only then), so that a sequence's cores wait
  // for one counter.
  std::vector<uint32_t> latent(static_cast<size_t>(B_));  // counter of b's range
  {
    auto a = args({a_out, weight(WeightKind::kMlaKvANorm, l), state(StateKind::kMlaCache, l)});
    for (auto r : seq_row_ranges()) {
      const int b0 = r.first / R_, b1 = r.second / R_;
      const uint32_t ctr = counter(Op::kMlaLatent, l, uint32_t(b0));
      for (int b = b0; b < b1; ++b) latent[size_t(b)] = ctr;
      Instr in = make(Op::kMlaLatent, l, {all_of(kva_done)}, ctr);
      in.seq = uint16_t(b0);
      in.r0 = uint32_t(b0);
      in.r1 = uint32_t(b1);
      emit(in, a, uint64_t(r.second - r.first) * uint64_t(CW) * 12);
    }
  }

  // Attention by head range per sequence: enough tiles to occupy the workers at small batch,
  // few enough that the latent cache is not re-read more than needed. When the batch's head
  // ranges still cannot occupy the workers (few heads, many workers: a GPU), each range is
  // also split over the cache rows, and a merge per range combines the splits.
  int tiles = int(std::clamp<int64_t>(ceil_div(2 * int64_t(W_), B_), 1, H));
  // A multi-row plan (prefill chunks beside decode rows, a verify) may carry all its rows in one
  // sequence, whose attention is then most of the step's: every sequence gets at least one head
  // range per worker (up to H), emitted range-major below, so that the scheduler's runs give each
  // worker a share of every sequence. (The other sequences' latent caches are read once per
  // range.) Heads are independent, so results do not change.
  const bool multi_row = R_ > 1;
  if (multi_row) tiles = std::max(tiles, std::min(W_, H));
  const int per = int(ceil_div(H, tiles));
  const int ranges = int(ceil_div(H, per));
  int S = p_.options.mla_kv_splits;
  if (S <= 0) {
    // Automatic: split only when the head ranges would leave most workers idle (at least 4
    // workers per range: wide GPUs). On a few CPU cores the merge costs more than it gains.
    const int64_t units = int64_t(B_) * ranges;
    S = 4 * units <= W_ ? int(std::clamp<int64_t>(ceil_div(W_, units), 1, 16)) : 1;
  }
  const double e = elt(L ? &L->mla.kv_b : nullptr);
  if (S == 1) {
    const uint32_t core_done = counter(Op::kMlaCore, l);
    auto a = args({q, weight(WeightKind::kMlaKvB, l), state(StateKind::kMlaCache, l), att, gate});
    // Sequence-major for decode plans (a sequence's ranges share its cache in cache), range-major
    // for multi-row ones (see above).
    const int nr = ranges, nb = B_;
    for (int t = 0; t < nr * nb; ++t) {
      const int b = multi_row ? t % nb : t / nr, h0 = (multi_row ? t / nb : t % nr) * per;
      Instr in = make(Op::kMlaCore, l, {all_of(q_done), all_of(latent[size_t(b)])}, core_done);
      in.seq = uint16_t(b);
      in.flags = gated ? kFlagOutputGate : 0;
      in.r0 = uint32_t(h0);
      in.r1 = uint32_t(std::min(H, h0 + per));
      emit(in, a, uint64_t(in.r1 - in.r0) * uint64_t(N + V) * uint64_t(R) * e * uint64_t(R_));
    }
    return {att, core_done, int64_t(H) * V, L ? &L->mla.o : nullptr};
  }
  // Partials [S][H][R + 2] per sequence: split i of head h at (i * H + h) * (R + 2).
  BufferDesc parts = arena(int64_t(S) * H * (R + 2));
  auto a = args({q, weight(WeightKind::kMlaKvB, l), state(StateKind::kMlaCache, l), parts, null()});
  std::vector<uint32_t> range_ctr;
  for (int b = 0; b < B_; ++b)
    for (int h0 = 0; h0 < H; h0 += per) {
      const uint32_t ctr = counter(Op::kMlaCore, l, uint32_t(b * ranges + h0 / per));
      range_ctr.push_back(ctr);
      for (int i = 0; i < S; ++i) {
        Instr in = make(Op::kMlaCore, l, {all_of(q_done), all_of(latent[size_t(b)])}, ctr);
        in.seq = uint16_t(b);
        in.slot = uint16_t(i);
        in.splits = uint32_t(S);
        in.r0 = uint32_t(h0);
        in.r1 = uint32_t(std::min(H, h0 + per));
        // The absorbed query is recomputed by every split (N x R per head); the cache rows
        // are the split's share (counted in the step's bytes, not here: unknown at compile).
        emit(in, a, uint64_t(in.r1 - in.r0) * uint64_t(N) * uint64_t(R) * e);
      }
    }
  const uint32_t merge_done = counter(Op::kMlaMerge, l);
  auto am = args({parts, weight(WeightKind::kMlaKvB, l), att, gate});
  size_t r = 0;
  for (int b = 0; b < B_; ++b)
    for (int h0 = 0; h0 < H; h0 += per) {
      Instr in = make(Op::kMlaMerge, l, {all_of(range_ctr[r++])}, merge_done);
      in.seq = uint16_t(b);
      in.flags = gated ? kFlagOutputGate : 0;
      in.splits = uint32_t(S);
      in.r0 = uint32_t(h0);
      in.r1 = uint32_t(std::min(H, h0 + per));
      emit(in, am,
           uint64_t(in.r1 - in.r0) *
               (uint64_t(V) * uint64_t(R) * e + uint64_t(S) * uint64_t(R + 2) * 4));
    }
  return {att, merge_done, int64_t(H) * V, L ? &L->mla.o : nullptr};
}

}  // namespace md::plan::detail
