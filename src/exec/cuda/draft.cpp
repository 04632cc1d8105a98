// The draft plans on the CUDA executors (Executor::draft_step; docs/speculative.md "The draft
// plan"): the draft's weights on the device, its plans' tables, the rings in device memory
// (new_draft_ring), and a draft step: the context rows' aux values and positions up, the plan
// run by the megakernel or phase by phase (the decode step's run_plan), the drafts and the
// optional hidden / logit rows back. The checks and the tables are the CPU executors'
// (exec/draft_layout.h); the tiles are kernels/cuda/tiles_draft.cuh and the decode tiles.
#include "../draft_layout.h"
#include "impl.h"

namespace md {

namespace {

// A sequence's draft ring in the executor's device memory: keys and values [layers][window][kv
// width], slot positions [window].
class DeviceDraftRing final : public DraftRingMemory {
 public:
  DeviceDraftRing(cuda::Device& d, const DraftConfig& c)
      : dev_(d),
        floats_(size_t(c.num_layers) * size_t(c.window) * size_t(c.kv_width())),
        window_(size_t(c.window)) {
    keys_.reset(&d, floats_ * 4);
    values_.reset(&d, floats_ * 4);
    positions_.reset(&d, window_ * 4);
    clear();
  }
  DraftRing ring() const override {
    return {keys_.as<float>(), values_.as<float>(), positions_.as<int32_t>()};
  }
  void clear() override {
    const std::vector<int32_t> empty(window_, -1);
    dev_.zero(keys_.p, floats_ * 4);
    dev_.zero(values_.p, floats_ * 4);
    dev_.copy(positions_.p, empty.data(), window_ * 4);
    dev_.sync();
  }
  void read(std::vector<float>& k, std::vector<float>& v, std::vector<int32_t>& p) const override {
    k.resize(floats_);
    v.resize(floats_);
    p.resize(window_);
    dev_.copy(k.data(), keys_.p, floats_ * 4);
    dev_.copy(v.data(), values_.p, floats_ * 4);
    dev_.copy(p.data(), positions_.p, window_ * 4);
    dev_.sync();
  }

 private:
  cuda::Device& dev_;
  size_t floats_, window_;
  DevBuf keys_, values_, positions_;
};

}  // namespace

void CudaExecutor::Impl::attach_draft(const DraftConfig& c, const DraftWeights& w) {
  exec::check_draft_fits(model.config(), c, w);
  // Every drafter on this executor attaches its model (serve: one per slot): the same one again
  // keeps the plans and the weights.
  if (draft_w == &w) return;
  draft_plans.clear();
  draft_buffers.clear();
  draft_cfg = c;
  draft_w = &w;
}

DevPlan& CudaExecutor::Impl::draft_runtime(int batch, int ctx_rows, int rows) {
  MD_CHECK(draft_w, "draft step: no draft is attached to this executor (attach_draft)");
  const auto key = std::make_tuple(batch, ctx_rows, rows);
  auto it = draft_plans.find(key);
  if (it != draft_plans.end()) return *it->second;
  auto dp = std::make_unique<DevPlan>();
  plan::PlanOptions po = opt.plan;
  po.batch = batch;
  po.rows = rows;
  po.workers = W;
  dp->plan = plan::compile_draft_plan(draft_cfg, po, ctx_rows);
  // The draft's tensors on this device, once each (they are real host memory: a draft is
  // loaded from its files, never generated on the device).
  std::vector<cuda::DevWeight> w;
  for (const plan::WeightRef& r : dp->plan.weights) {
    const exec::WeightView v = exec::bind_draft_weight(*draft_w, r);
    MD_CHECK(v.data != nullptr, "draft plan: weight {} of layer {} is absent",
             plan::weight_kind_name(r.kind), r.layer);
    MD_CHECK(v.dtype == DType::BF16 || v.dtype == DType::F32,
             "draft plan: weight {} is neither bf16 nor fp32", plan::weight_kind_name(r.kind));
    auto& b = draft_buffers[v.data];
    if (!b) {
      b = std::make_unique<DevBuf>();
      const size_t bytes = weight_bytes(v);
      b->reset(dev.get(), bytes);
      dev->copy(b->p, v.data, bytes);
    }
    w.push_back(dev_weight_in(v, draft_buffers));
  }
  dev->sync();
  sync_tables(*dp, w);
  if (dp->plan.arena_bytes > arena.bytes) arena.reset(dev.get(), dp->plan.arena_bytes);
  return *draft_plans.emplace(key, std::move(dp)).first->second;
}

void CudaExecutor::Impl::draft_step(std::span<const DraftStepSeq> seqs) {
  MD_CHECK(draft_w, "draft step: no draft is attached to this executor (attach_draft)");
  const DraftConfig& d = draft_cfg;
  const exec::DraftLayout lay = exec::layout_draft_step(d, max_batch, seqs);
  const int B = lay.B, C = lay.C, G = lay.G, L = d.num_layers;
  if (C == 0 && G == 0) return;
  DevPlan& dp = draft_runtime(B, C, G);
  const plan::Plan& p = dp.plan;
  // The context rows' aux values and positions, laid out on the host, then into the arena.
  std::vector<uint8_t> aux_rows, pos_rows;
  if (C > 0) {
    const plan::BufferDesc& ab = p.buffers[p.draft.aux];
    const plan::BufferDesc& pb = p.buffers[p.draft.ctx_pos];
    aux_rows.resize(size_t(B) * size_t(C) * ab.stride);
    pos_rows.resize(size_t(B) * size_t(C) * pb.stride);
    exec::fill_draft_context(p, lay, seqs, model.numerics().round_bf16, aux_rows.data(),
                             pos_rows.data());
    dev->copy(arena.as<uint8_t>() + ab.offset, aux_rows.data(), aux_rows.size());
    dev->copy(arena.as<uint8_t>() + pb.offset, pos_rows.data(), pos_rows.size());
  }
  const int64_t KV = d.kv_width();
  std::vector<cuda::DevSeq> views(size_t(B) * size_t(L));
  for (int b = 0; b < B; ++b) {
    const DraftStepSeq& q = seqs[size_t(b)];
    for (int l = 0; l < L; ++l) {
      cuda::DevSeq& v = views[size_t(b) * size_t(L) + size_t(l)];
      const size_t off = size_t(l) * size_t(d.window) * size_t(KV);
      v.ring_k = q.ring.keys + off;
      v.ring_v = q.ring.values + off;
      v.ring_pos = q.ring.positions;
    }
  }
  DevStep h;
  h.instrs = dp.instrs.as<plan::Instr>();
  h.buffers = dp.buffers.as<plan::BufferDesc>();
  h.weights = dp.weights.as<cuda::DevWeight>();
  h.arena = arena.as<uint8_t>();
  h.num = exec::draft_numerics(model.numerics(), d);
  h.cfg = dev_cfg_of(p.cfg);
  h.batch = B;
  h.rows = G;
  h.n = lay.N;
  h.n_logits = lay.N;
  h.tokens = put(tokens, lay.tokens);
  h.logit_of_row = put(logit_of_row, lay.logit_of_row);
  h.seqs = put(draft_views, views);
  h.pos = put(pos, lay.pos);
  h.row0 = put(row0, lay.row0);
  h.seq_of_row = put(seq_of_row, lay.seq_of_row);
  h.draft.heads = d.num_heads;
  h.draft.kv_heads = d.num_kv_heads;
  h.draft.head_dim = d.head_dim;
  h.draft.window = d.window;
  h.draft.markov_rank = int(d.markov_rank);
  h.draft.rope_theta = d.rope_theta;
  h.n_ctx = B * C;
  run_plan(dp, h, [] {});
  if (G == 0) return;
  // The drafts, and the buffers of the outputs any sequence asked for, in one copy each.
  std::map<uint32_t, std::vector<uint8_t>> staged;
  auto stage = [&](uint32_t bi, bool wanted) {
    if (!wanted || staged.count(bi)) return;
    const plan::BufferDesc& bd = p.buffers[bi];
    std::vector<uint8_t>& v = staged[bi];
    v.resize(size_t(bi == p.draft.drafts ? B : lay.N) * bd.stride);
    dev->copy(v.data(), arena.as<uint8_t>() + bd.offset, v.size());
  };
  bool hidden = false, base = false, biased = false;
  for (const DraftStepSeq& q : seqs) {
    hidden |= q.hidden != nullptr;
    base |= q.base_logits != nullptr;
    biased |= q.biased_logits != nullptr;
  }
  stage(p.draft.drafts, true);
  stage(p.draft.hidden, hidden);
  stage(p.draft.base, base);
  stage(p.draft.biased, biased);
  dev->sync();
  exec::copy_draft_outputs(p, lay, seqs,
                           [&](uint32_t bi) -> const uint8_t* { return staged.at(bi).data(); });
}

void CudaExecutor::attach_draft(const DraftConfig& c, const DraftWeights& w) {
  impl_->attach_draft(c, w);
}

void CudaExecutor::draft_step(std::span<const DraftStepSeq> seqs) {
  impl_->draft_step(seqs);
}

std::unique_ptr<DraftRingMemory> CudaExecutor::new_draft_ring(const DraftConfig& c) {
  return std::make_unique<DeviceDraftRing>(*impl_->dev, c);
}

const plan::Plan& CudaExecutor::draft_plan(int batch, int ctx_rows, int block_rows) {
  return impl_->draft_runtime(batch, ctx_rows, block_rows).plan;
}

}  // namespace md
