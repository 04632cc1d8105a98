// The decode-plan compiler: walks the layers in the reference path's op order (engine/model.cpp),
// tiles every op, wires the counters, lays out the activation arena and schedules the tiles onto
// W workers. See docs/architecture.md "The decode plan" for the format and the deadlock argument.
// This file holds the layer loop and the residual stream (plain, or Kimi K3's block attention
// residuals) and the schedulers; the attention and FFN ops are in plan_attention.cpp and
// plan_ffn.cpp (builder.h).
#include "megadecode/plan/plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "builder.h"
#include "megadecode/dist/shard.h"

namespace md::plan {

namespace detail {

void Builder::build() {
  const ModelConfig& c = c_;
  const int L = c.num_layers;
  const int64_t D = c.hidden_size;
  const int bs = c.attn_res_block_size;  // K3's block attention residuals (0: off)
  p_.router_ids_buffer.assign(size_t(L), kNone);
  p_.residual_buffer.assign(size_t(L), kNone);

  // Residual stream and normed input of layer 0. With block attention residuals `x` is the
  // current block's partial sum (the reference's `prefix`) and blocks_ the completed block
  // summaries; layer 0's input is the embedding itself (no summaries yet), as without them.
  BufferDesc x = arena(D), h = arena(D);
  uint32_t ready = embed_tiles(x, h);  // h (and x) of the current layer input complete

  for (int l = 0; l < L; ++l) {
    // The stream entering layer l, named for the executors' aux capture (an entry no instruction
    // reads: the capture is a copy out of the arena after the step, see Plan::residual_buffer).
    p_.residual_buffer[size_t(l)] = args({x}).first;
    // K3: every bs layers the partial sum becomes a block summary and a new partial sum starts
    // with this layer's attention output (the summary is the buffer itself: no copy).
    const bool new_block = bs > 0 && l % bs == 0;
    if (new_block) blocks_.push_back(x);

    BufferDesc att;  // attention output before o_proj, [B][C]
    uint32_t core_done;
    int64_t att_w;
    const Mat* o_mat = nullptr;
    if (c.attn_kind[l] == AttnKind::KDA)
      std::tie(att, core_done, att_w, o_mat) = kda_layer(l, h, ready);
    else
      std::tie(att, core_done, att_w, o_mat) = mla_layer(l, h, ready);

    // o_proj + residual (a new block's partial sum: o_proj alone).
    BufferDesc x_mid = arena(D);
    uint32_t attn_done = counter(Op::kAttnOut, l);
    const BufferDesc o_w =
        weight(c.attn_kind[l] == AttnKind::KDA ? WeightKind::kKdaO : WeightKind::kMlaO, l);
    if (distributed()) {
      // This rank's heads' share of o_proj (its columns), summed over the ranks, then the
      // residual (docs/distributed.md "Collectives").
      const uint32_t partial = attn_done;
      gemv_tiles(Op::kAttnOut, l, o_w, D, att_w, elt(o_mat), att, x_mid, all_of(core_done),
                 partial, 0, kFlagPartial);
      attn_done = all_reduce(l, x_mid, null(), new_block ? nullptr : &x, {all_of(partial)});
    } else if (new_block) {
      gemv_tiles(Op::kAttnOut, l, o_w, D, att_w, elt(o_mat), att, x_mid, all_of(core_done),
                 attn_done);
    } else {
      gemv_tiles(Op::kAttnOut, l, o_w, D, att_w, elt(o_mat), att, x_mid, all_of(core_done),
                 attn_done, 0, kFlagResidual, &x, &x_mid);
    }

    // FFN input norm (K3: of the mix over the block summaries and x_mid).
    BufferDesc h2 = arena(D);
    uint32_t norm_done = counter(Op::kFfnNorm, l);
    {
      std::vector<BufferDesc> ops = {x_mid, weight(WeightKind::kPostAttnNorm, l), h2};
      if (bs > 0) append_mix(ops, weight(WeightKind::kMlpResW, l), x_mid);
      const uint64_t mix_bytes = bs > 0 ? 8 * (blocks_.size() + 1) : 0;
      row_tiles(Op::kFfnNorm, l, args(ops), {all_of(attn_done)}, norm_done,
                uint64_t(D) * (12 + mix_bytes), bs > 0 ? kFlagAttnRes : 0);
    }

    // Next layer's input (or the final norm's output).
    FfnIo io = ffn_io(l, x_mid, h2, norm_done);
    if (bs > 0)
      io.next_res =
          l + 1 < L ? weight(WeightKind::kAttnResW, l + 1) : weight(WeightKind::kOutputResW);
    if (c.ffn_kind[l] == FfnKind::Dense)
      dense_ffn(l, io);
    else
      moe_ffn(l, io);
    x = io.x_next;
    h = io.h_next;
    ready = io.combined;
  }

  // lm_head over the final normed hidden states of the logit rows (compacted by the last
  // combine), straight into the caller's logits.
  const Mat* lm = w_ ? &w_->lm_head : nullptr;
  uint32_t logits_done = counter(Op::kLmHead, -1);
  if (!distributed()) {
    gemv_tiles(Op::kLmHead, -1, weight(WeightKind::kLmHead), c.vocab_size, D, elt(lm), h,
               io(BufKind::kLogits), all_of(ready), logits_done);
  } else {
    // This rank's vocabulary block, then every rank's block gathered into the logits.
    const auto [v0, v1] = dist::vocab_block(c.vocab_size, p_.options.world, p_.options.rank);
    const int64_t rb = tile_rows(std::max<int64_t>(v1 - v0, 1), double(D) * double(elt(lm)),
                                 p_.options, W_);
    auto a = args({weight(WeightKind::kLmHead), h, io(BufKind::kLogits)});
    for (int64_t r = v0; r < v1; r += rb) {
      Instr in = make(Op::kLmHead, -1, {all_of(ready)}, logits_done);
      in.r0 = uint32_t(r);
      in.r1 = uint32_t(std::min(v1, r + rb));
      emit(in, a,
           uint64_t(in.r1 - in.r0) * uint64_t(D) * elt(lm) + uint64_t(N_) * uint64_t(D) * 4);
    }
    const uint32_t block = logits_done;
    logits_done = counter(Op::kLogitsGather, -1);
    Instr in = make(Op::kLogitsGather, -1, {v1 > v0 ? all_of(block) : Wait{}, all_of(ready)},
                    logits_done);
    in.r0 = 0;
    in.r1 = uint32_t(N_);
    emit(in, args({io(BufKind::kLogits)}), uint64_t(N_) * uint64_t(c.vocab_size) * 4);
  }

  // Sampling, per range of logit rows: every vocabulary block must be in.
  BufferDesc next = arena(1, 4);
  auto a = args({io(BufKind::kLogits), next});
  p_.next_ids_buffer = a.first + 1;
  const uint32_t sampled = counter(Op::kSample, -1);
  for (auto r : row_ranges()) {
    Instr in = make(Op::kSample, -1, {all_of(logits_done)}, sampled);
    set_rows(in, r);
    emit(in, a, uint64_t(r.second - r.first) * uint64_t(c.vocab_size) * 4);
  }
}

}  // namespace detail

// ---- scheduling -----------------------------------------------------------------------------

// The cost model of both schedulers, in bytes-equivalent: bytes moved, scaled for tiles whose
// arithmetic outweighs their bytes (OpDesc::cost_factor), plus a fixed overhead per instruction.
double tile_cost(const Instr& in, const PlanOptions& o) {
  return double(in.est_bytes) * op_desc(in.op).cost_factor + double(o.instr_overhead_bytes);
}

std::vector<std::vector<uint32_t>> split_phase(const std::vector<double>& cost, int workers) {
  const size_t W = size_t(std::max(workers, 1)), n = cost.size();
  const double total = std::accumulate(cost.begin(), cost.end(), 0.0);

  // Longest processing time first, each share then put back in global order.
  std::vector<std::vector<uint32_t>> lpt(W), runs(W);
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return cost[a] > cost[b]; });
  std::vector<double> load(W, 0.0);
  for (uint32_t i : order) {
    const size_t w = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    load[w] += cost[i];
    lpt[w].push_back(i);
  }
  for (auto& s : lpt) std::sort(s.begin(), s.end());
  const double lpt_longest = *std::max_element(load.begin(), load.end());

  // Runs: worker w's run ends where the cost so far is nearest (w + 1) / W of the total.
  double so_far = 0, run = 0, run_longest = 0;
  size_t w = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const double end = total * double(w + 1) / double(W);
    if (w + 1 < W && !runs[w].empty() && so_far + cost[i] - end > end - so_far) {
      run_longest = std::max(run_longest, run);
      run = 0;
      ++w;
    }
    runs[w].push_back(i);
    run += cost[i];
    so_far += cost[i];
  }
  run_longest = std::max(run_longest, run);
  return run_longest <= 1.02 * lpt_longest ? runs : lpt;
}

namespace {

// List scheduling in the global order: each instruction goes to the worker on which it would
// start earliest under the cost model (estimated bytes + a fixed overhead per instruction, all
// workers equal), its ready time being the latest simulated finish among the producers it waits
// for, plus a synchronisation cost when a producer ran on another worker (the counter and the
// data cross cores). Ties go to the less loaded worker. Queues are therefore subsequences of the
// global order (see the deadlock argument in executor.cpp).
void schedule_megakernel(Plan& p) {
  const int W = p.workers;
  const double sync = double(p.options.sync_cost_bytes);
  std::vector<double> free_at(static_cast<size_t>(W), 0.0), load(static_cast<size_t>(W), 0.0);
  std::vector<double> done_at(p.counters.size(), 0.0);
  std::vector<int> owner(p.counters.size(), -1);  // the one worker signalling it, or -2: several
  p.queue_ids.assign(size_t(W), {});
  for (const Instr& in : p.instrs) {
    int best = 0;
    double best_start = 0;
    for (int w = 0; w < W; ++w) {
      double ready = 0;
      for (const Wait& wt : in.wait)
        if (wt.counter != kNone)
          ready = std::max(ready, done_at[wt.counter] + (owner[wt.counter] == w ? 0.0 : sync));
      const double start = std::max(free_at[size_t(w)], ready);
      if (w == 0 || start < best_start ||
          (start == best_start && load[size_t(w)] < load[size_t(best)])) {
        best = w;
        best_start = start;
      }
    }
    const double cost = tile_cost(in, p.options);
    free_at[size_t(best)] = best_start + cost;
    load[size_t(best)] += cost;
    if (in.signal != kNone) {
      done_at[in.signal] = std::max(done_at[in.signal], free_at[size_t(best)]);
      int& o = owner[in.signal];
      o = o == -1 || o == best ? best : -2;
    }
    p.queue_ids[size_t(best)].push_back(in.id);
  }
  p.queues.assign(size_t(W), {});
  for (int w = 0; w < W; ++w)
    for (uint32_t id : p.queue_ids[size_t(w)]) p.queues[size_t(w)].push_back(p.instrs[id]);
}

// Barrier phases for the op-by-op executor: consecutive stages are merged while none of them
// waits on a counter signalled in the phase (independent ops share one barrier, as a good
// launch-per-op baseline fuses them). Within a phase, instructions go to workers by split_phase.
void schedule_opbyop(Plan& p) {
  const int W = p.workers;
  std::vector<char> in_phase(p.counters.size(), 0);
  std::vector<uint32_t> touched;
  size_t first = 0;
  auto close_phase = [&](size_t end) {
    p.phases.emplace_back(uint32_t(first), uint32_t(end));
    std::vector<uint32_t> ids;
    for (size_t s = first; s < end; ++s)
      for (uint32_t i = p.stages[s].begin; i < p.stages[s].end; ++i) ids.push_back(i);
    std::vector<double> cost(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) cost[i] = tile_cost(p.instrs[ids[i]], p.options);
    auto shares = split_phase(cost, W);
    for (auto& s : shares)
      for (uint32_t& i : s) i = ids[i];
    p.phase_instrs.push_back(std::move(shares));
    for (uint32_t c : touched) in_phase[c] = 0;
    touched.clear();
    first = end;
  };
  for (size_t s = 0; s < p.stages.size(); ++s) {
    bool depends = false;
    for (uint32_t i = p.stages[s].begin; i < p.stages[s].end && !depends; ++i)
      for (const Wait& w : p.instrs[i].wait)
        if (w.counter != kNone && in_phase[w.counter]) depends = true;
    if (depends) close_phase(s);
    for (uint32_t i = p.stages[s].begin; i < p.stages[s].end; ++i) {
      const uint32_t c = p.instrs[i].signal;
      if (c != kNone && !in_phase[c]) {
        in_phase[c] = 1;
        touched.push_back(c);
      }
    }
  }
  if (first < p.stages.size()) close_phase(p.stages.size());
}

}  // namespace

namespace {
// Both schedules of a built program (op-by-op phases, megakernel queues).
void schedule(Plan& p) {
  const PlanOptions& opt = p.options;
  MD_CHECK(p.buffers.size() < kNone && p.instrs.size() < kNone, "plan: too many instructions");
  schedule_opbyop(p);
  if (opt.scheduler == Scheduler::kList) {
    schedule_megakernel(p);
  } else {
    // The op-by-op phase shares, concatenated: each queue is increasing in the global order,
    // and every wait is implied by a barrier op by op, so the megakernel only ever waits less.
    p.queue_ids.assign(size_t(p.workers), {});
    for (const auto& shares : p.phase_instrs)
      for (int w = 0; w < p.workers; ++w)
        p.queue_ids[size_t(w)].insert(p.queue_ids[size_t(w)].end(), shares[size_t(w)].begin(),
                                      shares[size_t(w)].end());
    p.queues.assign(size_t(p.workers), {});
    for (int w = 0; w < p.workers; ++w)
      for (uint32_t id : p.queue_ids[size_t(w)]) p.queues[size_t(w)].push_back(p.instrs[id]);
  }
}

void check_common(const PlanOptions& opt) {
  MD_CHECK(opt.batch >= 1 && opt.batch <= 1024, "plan: batch {} is outside 1..1024", opt.batch);
  MD_CHECK(opt.workers >= 1 && opt.workers <= 4096, "plan: workers {} is outside 1..4096",
           opt.workers);
  MD_CHECK(opt.tile_bytes >= 1024 && opt.min_tile_bytes <= opt.tile_bytes,
           "plan: tile_bytes {} / min_tile_bytes {} out of range", opt.tile_bytes,
           opt.min_tile_bytes);
}

}  // namespace

Plan compile_decode_plan(const ModelConfig& cfg, const ModelWeights* w, const PlanOptions& opt) {
  check_common(opt);
  MD_CHECK(opt.rows >= 1 && opt.rows <= kMaxRows, "plan: rows {} is outside 1..{}", opt.rows,
           kMaxRows);
  MD_CHECK(int64_t(opt.batch) * opt.rows <= 4096,
           "plan: {} sequences x {} rows exceed 4096 token rows", opt.batch, opt.rows);
  MD_CHECK(cfg.num_layers >= 1 && cfg.num_layers < int(kNoLayer), "plan: bad layer count {}",
           cfg.num_layers);
  MD_CHECK(opt.mla_kv_splits >= 0 && opt.mla_kv_splits <= 256,
           "plan: mla_kv_splits {} is outside 0..256", opt.mla_kv_splits);
  MD_CHECK(cfg.attn_res_block_size >= 0, "plan: bad attn_res_block_size {}",
           cfg.attn_res_block_size);
  MD_CHECK(opt.world >= 1 && opt.world <= 4096 && opt.rank >= 0 && opt.rank < opt.world,
           "plan: rank {} of a world of {} is not a rank", opt.rank, opt.world);
  Plan p;
  p.batch = opt.batch;
  p.rows = opt.rows;
  p.workers = opt.workers;
  p.cfg = cfg;
  p.options = opt;
  detail::Builder(p, p.cfg, w).build();
  schedule(p);
  return p;
}

Plan compile_draft_plan(const DraftConfig& d, const PlanOptions& opt, int ctx_rows) {
  check_common(opt);
  MD_CHECK(opt.rows >= 0 && opt.rows <= kDraftMaxBlockRows,
           "draft plan: block rows {} are outside 0..{}", opt.rows, kDraftMaxBlockRows);
  MD_CHECK(ctx_rows >= 0 && ctx_rows <= kMaxRows, "draft plan: context rows {} are outside 0..{}",
           ctx_rows, kMaxRows);
  MD_CHECK(ctx_rows <= d.window,
           "draft plan: {} context rows a step exceed the draft's window of {} (two rows of one "
           "step would share a ring slot)",
           ctx_rows, d.window);
  MD_CHECK(opt.rows + ctx_rows > 0, "draft plan: neither context rows nor a block");
  MD_CHECK(d.num_layers >= 1 && d.num_layers < int(kNoLayer) && d.num_kv_heads >= 1 &&
               d.num_heads % d.num_kv_heads == 0,
           "draft plan: bad draft geometry ({} layers, {} heads over {} KV heads)", d.num_layers,
           d.num_heads, d.num_kv_heads);
  Plan p;
  p.batch = opt.batch;
  p.rows = opt.rows;
  p.workers = opt.workers;
  p.cfg = draft_model_config(d);
  p.options = opt;
  p.draft.on = true;
  p.draft.cfg = d;
  p.draft.ctx_rows = ctx_rows;
  detail::Builder(p, p.cfg, nullptr).build_draft();
  schedule(p);
  return p;
}

}  // namespace md::plan
