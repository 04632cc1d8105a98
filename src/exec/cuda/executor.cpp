// The CUDA executors' host side: weights uploaded once, plans and their tables in device memory,
// the per-step tables, the launches (one per phase, or the megakernel), the watchdog's report,
// the logits and sampled ids back. One code for the GPU and the simulation (kernels/cuda/device.h).
#include "impl.h"

namespace md::cuda_exec {

std::shared_ptr<DeviceWeights> device_weights_of(const Model& m, CudaTarget t) {
  static std::mutex mu;
  static std::map<std::pair<const Model*, int>, std::weak_ptr<DeviceWeights>> live;
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<DeviceWeights>& w = live[{&m, int(t)}];
  if (std::shared_ptr<DeviceWeights> p = w.lock()) return p;
  auto p = std::make_shared<DeviceWeights>();
  p->dev = t == CudaTarget::kGpu ? cuda::make_gpu_device() : cuda::make_sim_device();
  w = p;
  return p;
}

const char* status_name(uint32_t s) {
  switch (s) {
    case 1:
      return "is running";
    case 2:
      return "waits";
    case 3:
      return "is stalled (test hook)";
    case 4:
      return "has finished its queue";
    default:
      return "has not started";
  }
}


}  // namespace md::cuda_exec

namespace md {

CudaExecutor::CudaExecutor(Model& model, int max_batch, ExecutorKind kind, CudaTarget target,
                           const ExecutorOptions& opt)
    : impl_([&] {
        // int4 / int8 / FP8 / MXFP4 weights run through the GEMV's quantized units (gemv.cuh);
        // W4A8 / W8A8 integer dot products are CPU kernels only.
        MD_CHECK(model.quantize_report().int_activation_matrices == 0,
                 "the CUDA executors have no integer dot-product kernels yet; --act-quant "
                 "int8 / int16 runs with --device cpu");
        return std::make_unique<Impl>(model, max_batch, kind, target, opt);
      }()) {}
CudaExecutor::~CudaExecutor() = default;

void CudaExecutor::run_step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids,
                            std::span<const SampleRow> sampling, const StepOptions& options) {
  impl_->step(seqs, logits, next_ids, sampling, options);
}

const plan::Plan& CudaExecutor::plan(int batch, int rows) {
  MD_CHECK(batch >= 1 && batch <= impl_->max_batch, "batch {} is outside 1..{}", batch,
           impl_->max_batch);
  MD_CHECK(rows >= 1 && rows <= plan::kMaxRows, "rows {} is outside 1..{}", rows, plan::kMaxRows);
  return impl_->runtime(batch, rows).plan;
}

void CudaExecutor::commit(SequenceState& seq, int k) {
  MD_CHECK(seq.pool() == impl_->states.get(),
           "commit: the sequence is not a state of this executor's pool");
  // The KDA replay runs on the device (commit_kernel: one block per layer and head, the step's
  // own delta-rule arithmetic); the MLA caches are cut back on the host, whose page tables they
  // are. Nothing to replay (or a bad call): exec::commit_rows, which then touches no device data.
  const ModelConfig& c = impl_->model.config();
  if (c.num_kda_layers() == 0 || seq.rowlog.rows == 0 || k < 0 || k >= seq.rowlog.rows ||
      seq.pos != seq.rowlog.pos0 + seq.rowlog.rows) {
    ThreadPool one(1, false);
    return exec::commit_rows(c, seq, k, one);
  }
  std::vector<cuda::DevCommitLayer> layers;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.attn_kind[size_t(l)] != AttnKind::KDA) continue;
    layers.push_back({seq.kda_state(l), seq.conv_cache(l), seq.kda_state0(l), seq.conv0(l),
                      seq.row_inputs(l)});
  }
  Impl& I = *impl_;
  upload(*I.dev, I.commit_layers, layers);
  cuda::DevCommit cm;
  cm.layers = I.commit_layers.as<cuda::DevCommitLayer>();
  cm.n_layers = int(layers.size());
  cm.rows = k;
  cm.heads = c.kda_num_heads;
  cm.head_dim = c.kda_head_dim;
  cm.conv = c.kda_conv_size;
  I.commit_desc.reserve(I.dev.get(), sizeof cm);
  I.dev->copy(I.commit_desc.p, &cm, sizeof cm);
  I.dev->run_commit(I.commit_desc.as<cuda::DevCommit>(), uint32_t(layers.size()) * uint32_t(cm.heads));
  I.dev->sync();
  seq.truncate(seq.rowlog.pos0 + k);
  seq.pos = seq.rowlog.pos0 + k;
  seq.rowlog.rows = 0;
}

StatePool& CudaExecutor::states() {
  return *impl_->states;
}
std::string_view CudaExecutor::name() const {
  return Impl::name_of(impl_->kind);
}
const Model& CudaExecutor::model() const {
  return impl_->model;
}
int CudaExecutor::workers() const {
  return impl_->W;
}
int CudaExecutor::max_batch() const {
  return impl_->max_batch;
}
const StepStats& CudaExecutor::last_step_stats() const {
  impl_->finish_stats();
  return impl_->stats;
}
void CudaExecutor::set_watchdog_seconds(double s) {
  MD_CHECK(s > 0, "executor: the watchdog timeout must be positive");
  impl_->opt.watchdog_seconds = s;
}
ExecutorKind CudaExecutor::kind() const {
  return impl_->kind;
}
CudaTarget CudaExecutor::target() const {
  return impl_->target;
}
std::string CudaExecutor::device_name() const {
  return impl_->dev->info().name;
}
double CudaExecutor::measure_read_bandwidth_gbps(size_t bytes) {
  return impl_->dev->read_bandwidth_gbps(bytes);
}

void CudaExecutor::edit_instr_for_testing(int batch, uint32_t id,
                                          const std::function<void(plan::Instr&)>& f) {
  DevPlan& dp = impl_->runtime(batch, 1);
  MD_CHECK(id < dp.plan.instrs.size(), "no instruction {}", id);
  f(dp.plan.instrs[id]);
  for (auto& q : dp.plan.queues)
    for (plan::Instr& in : q)
      if (in.id == id) in = dp.plan.instrs[id];
  impl_->sync_plan(dp);
  dp.graph = -1;  // (a new graph id: the old one is replaced on capture)
}

}  // namespace md
