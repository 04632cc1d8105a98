// The decode plan's FFN ops (builder.h): the dense gated MLP and the sigmoid-routed MoE with
// expert slots, Kimi Linear's (experts on h, routed sum rounded per product and add) and Kimi K3's
// latent MoE (experts on routed_expert_down_proj h, MXFP4 weights, fp32 routed sum, its RMSNorm
// and routed_expert_up_proj).
#include <algorithm>

#include "builder.h"

namespace md::plan::detail {

void Builder::combine_tiles(int l, const FfnIo& io, std::vector<BufferDesc> base, uint32_t flags,
                            std::initializer_list<Wait> waits) {
  const int64_t D = c_.hidden_size;
  const bool mix = io.next_res.kind != BufKind::kNull;
  if (mix) {
    append_mix(base, io.next_res, io.x_next);
    flags = uint32_t(flags | kFlagAttnRes);
  }
  const uint64_t srcs = mix ? blocks_.size() + 1 : 0;
  if (l + 1 == c_.num_layers) flags |= kFlagLogitRows;  // h_next: the lm_head's input rows
  const bool moe = flags & kFlagMoeCombine, latent = flags & kFlagLatentMoe;
  const uint64_t reads = moe && !latent ? uint64_t(c_.num_experts_per_token) + 4 : 5;
  auto a = args(base);
  for (auto r : row_ranges()) {
    Instr in = make(Op::kCombine, l, waits, io.combined);
    set_rows(in, r);
    in.flags = flags;
    emit(in, a, uint64_t(r.second - r.first) * (reads + srcs * 2) * uint64_t(D) * 4);
  }
}

void Builder::dense_ffn(int l, const FfnIo& io) {
  const int64_t D = c_.hidden_size, I = c_.intermediate_size;
  const LayerWeights* L = lw(l);
  BufferDesc act = arena(I), out = arena(D);
  const uint32_t gu = counter(Op::kDenseGateUp, l), dn = counter(Op::kDenseDown, l);
  gate_up_tiles(Op::kDenseGateUp, l, weight(WeightKind::kDenseGate, l),
                weight(WeightKind::kDenseUp, l), I, elt(L ? &L->dense.gate : nullptr), io.h2, act,
                all_of(io.norm_done), gu);
  gemv_tiles(Op::kDenseDown, l, weight(WeightKind::kDenseDown, l), D, I,
             elt(L ? &L->dense.down : nullptr), act, out, all_of(gu), dn, 0,
             distributed() ? kFlagPartial : 0);
  // Distributed: each rank's channels gave a partial sum of the output.
  const uint32_t done = distributed() ? all_reduce(l, out, null(), nullptr, {all_of(dn)}) : dn;
  combine_tiles(l, io, {io.x_mid, null(), out, null(), io.x_next, io.next_norm, io.h_next}, 0,
                {all_of(done)});
}

void Builder::gate_up_tiles(Op op, int l, const BufferDesc& g, const BufferDesc& u, int64_t I,
                            double e, const BufferDesc& x, const BufferDesc& act, Wait wt,
                            uint32_t sig) {
  const int64_t D = c_.hidden_size;
  const int64_t rb = tile_rows(I, 2.0 * double(D) * double(e), p_.options, W_);
  auto a = args({g, u, x, act});
  for (int64_t r = 0; r < I; r += rb) {
    Instr in = make(op, l, {wt}, sig);
    in.r0 = uint32_t(r);
    in.r1 = uint32_t(std::min(I, r + rb));
    emit(in, a, 2ull * (in.r1 - in.r0) * uint64_t(D) * e + uint64_t(N_) * uint64_t(D) * 4);
  }
}

void Builder::moe_ffn(int l, const FfnIo& io) {
  const ModelConfig& c = c_;
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size, X = c.expert_dim();
  const int E = c.num_experts, k = c.num_experts_per_token;
  const LayerWeights* L = lw(l);
  const bool shared = c.num_shared_experts > 0;
  const bool latent = c.latent_size > 0;
  const int64_t IS = c.shared_intermediate();
  BufferDesc ids = arena(k, 4), wts = arena(k), logits = arena(E), act = arena(int64_t(k) * I),
             dn = arena(int64_t(k) * X);
  BufferDesc sact = shared ? arena(IS) : null(), sout = shared ? arena(D) : null();
  const Wait normed = all_of(io.norm_done);

  // Router (on the hidden state, latent MoE or not): the logits in row blocks over the workers
  // (one worker reading the whole gate matrix held a GPU step up: 70% of a kl48 step on an H200,
  // bench/RESULTS.md), then the top-k per sequence.
  const uint32_t routed = counter(Op::kRouter, l);
  {
    // Without weights: the released dtype (what make-model writes).
    const double re = elt(L ? &L->moe.router : nullptr, c.released_router_dtype());
    const uint32_t scored = counter(Op::kRouterLogits, l);
    gemv_tiles(Op::kRouterLogits, l, weight(WeightKind::kRouter, l), E, D, re, io.h2, logits,
               normed, scored);
    auto a = args({logits, weight(WeightKind::kRouterBias, l), ids, wts});
    p_.router_ids_buffer[size_t(l)] = a.first + 2;
    for (auto r : row_ranges()) {
      Instr in = make(Op::kRouter, l, {all_of(scored)}, routed);
      set_rows(in, r);
      emit(in, a, uint64_t(r.second - r.first) * uint64_t(E) * 64);
    }
  }

  // K3: the routed experts' input z = round(routed_expert_down_proj h2), overlapping the routing.
  // A distributed rank computes its block of z's rows, and an all-gather gives every rank all of
  // z: the same values as one process's, since each row is one rank's whole dot product.
  BufferDesc xin = io.h2;
  Wait z_ready{};
  if (latent) {
    xin = arena(X);
    uint32_t z_done = counter(Op::kLatentDown, l);
    const auto block = distributed() ? rank_block(X) : std::pair<int64_t, int64_t>{0, X};
    gemv_block(Op::kLatentDown, l, weight(WeightKind::kLatentDown, l), block, D,
               elt(L ? &L->moe.latent_down : nullptr), io.h2, xin, normed, z_done);
    if (distributed())
      z_done = all_gather(l, xin, {block.second > block.first ? all_of(z_done) : Wait{}, normed});
    z_ready = all_of(z_done);
  }

  // Shared expert gate/up: needs only the normed input, so it overlaps the routing.
  uint32_t sgu = kNone, sdn = kNone;
  const double se = elt(L && shared ? &L->moe.shared.gate : nullptr);
  if (shared) {
    sgu = counter(Op::kSharedGateUp, l);
    gate_up_tiles(Op::kSharedGateUp, l, weight(WeightKind::kSharedGate, l),
                  weight(WeightKind::kSharedUp, l), IS, se, io.h2, sact, normed, sgu);
  }

  // Routed experts by slot: slot u runs the u-th distinct expert the step's rows selected (in
  // ascending id) for every row that selected it, so each selected expert is read once
  // per step. Slots beyond the number of distinct experts are empty at run time. MXFP4 experts
  // count 4.25 bits per weight.
  const int U = std::min(N_ * k, E);
  const double ee = expert_elt(L ? &L->moe.experts[0].gate : nullptr);
  const int64_t rb_gu = tile_rows(I, 2.0 * double(X) * ee, p_.options, W_, U);
  const int64_t rb_dn = tile_rows(X, double(I) * ee, p_.options, W_, U);
  std::vector<uint32_t> slot_gu(static_cast<size_t>(U));
  {
    auto a = args({ids, xin, expert_weights(WeightKind::kExpertGate, l),
                   expert_weights(WeightKind::kExpertUp, l), act});
    for (int u = 0; u < U; ++u) {
      slot_gu[size_t(u)] = counter(Op::kExpertGateUp, l, uint32_t(u));
      for (int64_t r = 0; r < I; r += rb_gu) {
        Instr in = make(Op::kExpertGateUp, l, {all_of(routed), z_ready}, slot_gu[size_t(u)]);
        in.slot = uint16_t(u);
        in.r0 = uint32_t(r);
        in.r1 = uint32_t(std::min(I, r + rb_gu));
        emit(in, a, uint64_t(2.0 * double(in.r1 - in.r0) * double(X) * ee));
      }
    }
  }
  if (shared) {
    sdn = counter(Op::kSharedDown, l);
    gemv_tiles(Op::kSharedDown, l, weight(WeightKind::kSharedDown, l), D, IS, se, sact, sout,
               all_of(sgu), sdn, 0, distributed() ? kFlagPartial : 0);
  }
  const uint32_t expert_done = counter(Op::kExpertDown, l);
  {
    auto a = args({ids, act, expert_weights(WeightKind::kExpertDown, l), dn});
    for (int u = 0; u < U; ++u)
      for (int64_t r = 0; r < X; r += rb_dn) {
        Instr in = make(Op::kExpertDown, l, {all_of(slot_gu[size_t(u)])}, expert_done);
        in.slot = uint16_t(u);
        in.flags = distributed() ? kFlagPartial : 0;
        in.r0 = uint32_t(r);
        in.r1 = uint32_t(std::min(X, r + rb_dn));
        emit(in, a, uint64_t(double(in.r1 - in.r0) * double(I) * ee));
      }
  }
  Wait shared_done = shared ? all_of(sdn) : Wait{};
  // Distributed: each rank wrote its experts' outputs (zeros for the others') and, inside an
  // expert split by channel, partial sums; with the shared expert's partial sums, one
  // all-reduce completes both.
  Wait experts_in = all_of(expert_done);
  if (distributed()) {
    experts_in = all_of(all_reduce(l, dn, sout, nullptr, {experts_in, shared_done}));
    shared_done = Wait{};
  }

  if (!latent) {
    // Weighted sum in ascending expert id, shared expert, residual, next norm.
    combine_tiles(l, io, {io.x_mid, wts, dn, sout, io.x_next, io.next_norm, io.h_next},
                  uint32_t(kFlagMoeCombine | (shared ? kFlagSharedExpert : 0)),
                  {experts_in, shared_done});
    return;
  }

  // K3: per sequence the fp32 weighted sum of its experts' outputs (ascending id), rounded
  // once, and its RMSNorm; then routed_expert_up_proj row blocks back to the hidden size.
  BufferDesc r_lat = arena(X), up = arena(D);
  const uint32_t lnorm = counter(Op::kLatentNorm, l);
  {
    auto a = args({wts, dn, c.latent_norm ? weight(WeightKind::kLatentNorm, l) : null(), r_lat});
    for (auto r : row_ranges()) {
      Instr in = make(Op::kLatentNorm, l, {experts_in}, lnorm);
      set_rows(in, r);
      emit(in, a, uint64_t(r.second - r.first) * uint64_t(k + 3) * uint64_t(X) * 4);
    }
  }
  // Distributed: this rank's block of the output rows, then all of them gathered (as z above).
  uint32_t lup = counter(Op::kLatentUp, l);
  const auto block = distributed() ? rank_block(D) : std::pair<int64_t, int64_t>{0, D};
  gemv_block(Op::kLatentUp, l, weight(WeightKind::kLatentUp, l), block, X,
             elt(L ? &L->moe.latent_up : nullptr), r_lat, up, all_of(lnorm), lup);
  if (distributed())
    lup = all_gather(l, up, {block.second > block.first ? all_of(lup) : Wait{}, all_of(lnorm)});
  // The routed output is `up` (one vector), no weights.
  combine_tiles(l, io, {io.x_mid, null(), up, sout, io.x_next, io.next_norm, io.h_next},
                uint32_t(kFlagMoeCombine | kFlagLatentMoe | (shared ? kFlagSharedExpert : 0)),
                {all_of(lup), shared_done});
}

}  // namespace md::plan::detail
