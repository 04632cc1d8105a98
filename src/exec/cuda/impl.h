// The CUDA executors' host side, shared by its files: the device allocations, a plan in device
// memory, the state pool's device memory, the weights shared by a model's executors, and the
// executor's state (CudaExecutor::Impl). executor.cpp runs decode steps and commits; draft.cpp
// runs the draft plans (Executor::draft_step) and owns their rings.
#pragma once
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "../../kernels/cuda/device.h"
#include "../../kernels/cuda/step.h"
#include "../cpu/tiles.h"
#include "../step_layout.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/dist/communicator.h"
#include "megadecode/dist/shard.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cpu/int4.h"

namespace md {

namespace cuda_exec {

using cuda::DevStep;
using plan::kNone;

// A device allocation owned by the executor.
struct DevBuf {
  cuda::Device* dev = nullptr;
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (dev) dev->free(p);
  }
  void reset(cuda::Device* d, size_t n) {
    if (dev) dev->free(p);
    dev = d;
    p = d->alloc(n);
    bytes = n;
  }
  // Grows to at least n bytes (contents dropped).
  void reserve(cuda::Device* d, size_t n) {
    if (!p || bytes < n) reset(d, std::max(n, size_t(256)));
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <class T>
void upload(cuda::Device& d, DevBuf& b, const std::vector<T>& v) {
  b.reset(&d, std::max<size_t>(v.size() * sizeof(T), 16));
  d.copy(b.p, v.data(), v.size() * sizeof(T));
}

// A plan in device memory.
struct DevPlan {
  plan::Plan plan;
  DevBuf instrs, buffers, weights, per_step, queue_ids, queue_off, counters, status;
  uint32_t epoch = 0;
  int graph = -1;  // cuda-opbyop on a GPU: the CUDA graph of the step's launches (-1: none yet)
  // A distributed plan's collectives (collectives.cpp): per phase its kAllReduce, kLogitsGather
  // and kAllGather instructions, exchanged by the host before the phase runs; the megakernel's
  // segments (the launches between them): segment k starts at phase seg_phase[k], and block b runs
  // queue_ids[seg_begin[k * W + b] .. seg_end[k * W + b]) in it.
  bool has_collectives = false;
  std::vector<std::vector<uint32_t>> phase_collectives;
  std::vector<uint32_t> seg_phase;
  DevBuf seg_begin, seg_end;
};

// The state pool's memory on the device (the simulation's is host memory, which keeps the tests'
// direct reads of the executor's states possible; the code path is the GPU's).
class DevicePoolMemory final : public PoolMemory {
 public:
  explicit DevicePoolMemory(cuda::Device& d) : d_(d) {}
  void* alloc_zeroed(size_t bytes) override { return d_.alloc(bytes); }
  void free(void* p) override { d_.free(p); }
  void zero(void* p, size_t bytes) override {
    d_.zero(p, bytes);
    d_.sync();
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    d_.copy(dst, src, bytes);
    d_.sync();
  }
  bool host_accessible() const override { return d_.backend() == cuda::Backend::kSim; }

 private:
  cuda::Device& d_;
};

// A model's weights on a device, shared by every CUDA executor of that model on that target (the
// bench runs a megakernel and an op-by-op executor side by side: two copies of a 98 GB model
// would not fit one GPU). Its own Device allocates them and runs the uploads and the generator;
// the executors' kernels read them from their own streams after place() has synchronised.
struct DeviceWeights {
  std::unique_ptr<cuda::Device> dev;
  std::mutex mu;
  std::unordered_map<const void*, std::unique_ptr<DevBuf>> buffers;  // by host address
  // Asymmetric int4 matrices as int8 codes (the CUDA tiles have no zero-point terms), by the
  // host address of their int4 codes; the upload's source.
  std::unordered_map<const void*, std::vector<uint8_t>> int8_codes;
};

// The weights of model m on target t, shared by its executors (created on first use).
std::shared_ptr<DeviceWeights> device_weights_of(const Model& m, CudaTarget t);
// A megakernel block's state (DevStatus::state) in words.
const char* status_name(uint32_t s);

}  // namespace cuda_exec

using cuda_exec::DevBuf;
using cuda_exec::device_weights_of;
using cuda_exec::DevicePoolMemory;
using cuda_exec::DeviceWeights;
using cuda_exec::DevPlan;
using cuda_exec::DevStep;
using cuda_exec::kNone;
using cuda_exec::status_name;
using cuda_exec::upload;

struct CudaExecutor::Impl {
  Model& model;
  int max_batch;
  ExecutorKind kind;
  CudaTarget target;
  ExecutorOptions opt;
  std::unique_ptr<cuda::Device> dev;
  int W = 0;
  std::unique_ptr<DevicePoolMemory> pool_memory;
  std::unique_ptr<StatePool> states;
  std::shared_ptr<DeviceWeights> weights;  // shared with the model's other executors
  std::map<std::pair<int, int>, std::unique_ptr<DevPlan>> plans;
  int next_graph = 0;
  DevBuf arena, tokens, pos, row0, seq_of_row, logit_of_row, logits, abort, page_tables;
  DevBuf sample_rows, penalties, sample_work;
  DevBuf commit_layers, commit_desc;  // commit(): the KDA layers' pointers, the DevCommit
  // A distributed rank's communicator (null: a whole model): on the simulation the model's (MPI:
  // its device memory is host memory), on a GPU an NCCL one bootstrapped over it (nccl).
  dist::Communicator* comm = nullptr;
  std::unique_ptr<dist::Communicator> nccl;
  DevBuf coll_send, coll_recv;  // the collectives' messages
  DevBuf greedy_pairs;          // a greedy exchange's (max, id) pairs (DevStep::greedy_pairs)
  std::vector<float> host_logits;
  StepStats stats;

  Impl(Model& m, int mb, ExecutorKind k, CudaTarget t, const ExecutorOptions& o)
      : model(m), max_batch(mb), kind(k), target(t), opt(o) {
    MD_CHECK(mb >= 1 && mb <= 1024, "executor: max_batch {} is outside 1..1024", mb);
    MD_CHECK(o.watchdog_seconds > 0, "executor: the watchdog timeout must be positive");
    dev = t == CudaTarget::kGpu ? cuda::make_gpu_device() : cuda::make_sim_device();
    W = o.workers > 0 ? std::min(o.workers, dev->info().sm_count) : dev->info().sm_count;
    PoolOptions po = o.states;
    po.max_sequences = std::max(po.max_sequences, mb);
    // The state pool in device memory; its page tables stay on the host and go up with each step.
    pool_memory = std::make_unique<DevicePoolMemory>(*dev);
    states =
        std::make_unique<StatePool>(m.config(), m.numerics().round_bf16, po, pool_memory.get());
    abort.reset(dev.get(), 16);
    // The step's table lives at one device address for the executor's lifetime: CUDA graphs
    // capture the launches with this pointer and replay them on each step's new contents.
    step_store.reset(dev.get(), sizeof(DevStep));
    if (m.shard().sharded()) {
      MD_CHECK(m.communicator(), "cuda executor: {} has no communicator",
               dist::describe_shard(m.shard()));
      if (t == CudaTarget::kGpu) {
        // Each rank drives its first visible GPU (CUDA_VISIBLE_DEVICES per rank:
        // docs/distributed.md "CUDA ranks").
        nccl = dist::nccl_communicator(*m.communicator(), 0);
        comm = nccl.get();
      } else {
        comm = m.communicator();
      }
    }
    weights = device_weights_of(m, t);
    upload_weights();
  }

  // The plan options of this executor's plans (a distributed rank's: its place in the world).
  plan::PlanOptions plan_options(int batch) const {
    plan::PlanOptions po = opt.plan;
    po.batch = batch;
    po.workers = W;
    po.world = model.shard().world();
    po.rank = model.shard().rank;
    return po;
  }
  // A weight the plan names and the model does not hold: a distributed rank's other ranks'
  // routed experts (the tiles skip them).
  bool may_be_absent(const plan::WeightRef& r) const {
    return model.shard().sharded() &&
           (r.kind == plan::WeightKind::kExpertGate || r.kind == plan::WeightKind::kExpertUp ||
            r.kind == plan::WeightKind::kExpertDown);
  }

  // Every tensor a plan can name, once (bf16 / fp32 as stored; MXFP4 codes then scales): copied
  // from the host, or, for a model of random weights generated on the device (Checkpoint::
  // random), generated here by make-model's generator.
  void upload_weights() {
    const plan::Plan p =
        plan::compile_decode_plan(model.config(), &model.weights(), plan_options(1));
    double total = 0, done = 0;
    std::vector<exec::WeightView> views;
    for (const plan::WeightRef& r : p.weights)
      views.push_back(exec::bind_weight(model.weights(), r));
    for (const auto& v : views) total += double(weight_bytes(v) + scale_bytes(v));
    const bool bar = total > double(size_t(1) << 30);
    std::lock_guard<std::mutex> lock(weights->mu);
    std::vector<cuda::RandomJob> jobs;
    for (const auto& v : views) {
      place(v, jobs);
      done += double(weight_bytes(v) + scale_bytes(v));
      if (bar)
        fmt::print(stderr, "\r{} weights on {}: {} of {}", jobs.empty() ? "uploading" : "placing",
                   dev->info().name, human_bytes(done), human_bytes(total));
    }
    if (bar) fmt::print(stderr, "\n");
    const double t0 = now_seconds();
    finish_placing(jobs);
    if (bar && !jobs.empty())
      fmt::print(stderr, "generated {} random-weight chunks on {} in {:.1f} s\n", jobs.size(),
                 dev->info().name, now_seconds() - t0);
  }

  // Runs the generator's jobs and waits for every upload (the executors' streams read them).
  void finish_placing(const std::vector<cuda::RandomJob>& jobs) {
    if (!jobs.empty()) weights->dev->fill_random(jobs.data(), jobs.size());
    weights->dev->sync();
  }

  // Bytes of a weight's codes (or values) and of its scales, as model/weights.h Mat lays them out
  // (asymmetric int4 goes up as int8 codes: place()).
  static Mat as_mat(const exec::WeightView& v) {
    Mat m;
    m.dtype = v.dtype;
    m.rows = v.rows;
    m.cols = v.cols;
    m.quant = v.zero_points ? WeightQuant::kInt8 : v.quant;
    m.group = v.group;
    return m;
  }
  static size_t weight_bytes(const exec::WeightView& v) {
    return size_t(v.rows) * as_mat(v).code_row_bytes();
  }
  static size_t scale_bytes(const exec::WeightView& v) {
    return v.scales ? size_t(v.rows) * as_mat(v).scale_row_bytes() : 0;
  }

  // A weight's codes (or values) and MXFP4 scales on the device (once; weights->mu held).
  void place(const exec::WeightView& v, std::vector<cuda::RandomJob>& jobs) {
    MD_CHECK(!v.col_perm,
             "cuda executor: a [{}, {}] weight with activation-ordered groups (actorder group, "
             "weight_g_idx): the CUDA tiles read groups of consecutive columns; run it on the CPU "
             "executors",
             v.rows, v.cols);
    if (v.zero_points && !weights->buffers.count(v.data)) {
      // Asymmetric int4: int8 codes (c - zc + 128) with the same scales, exactly the same weights.
      std::vector<uint8_t>& c = weights->int8_codes[v.data];
      c.resize(weight_bytes(v));
      cpu::int4_zero_points_to_int8_codes(static_cast<const uint8_t*>(v.data), v.zero_points,
                                          v.rows, v.cols, v.group, c.data());
      upload_one(v.data, c.size(), jobs, c.data());
    }
    upload_one(v.data, weight_bytes(v), jobs);
    if (v.scales) upload_one(v.scales, scale_bytes(v), jobs);
  }

  // One tensor's device copy, keyed by its host address: a copy of the host bytes (or of
  // `source`'s, a converted copy), or the generator's jobs for a tensor whose bytes exist only as
  // a recipe.
  void upload_one(const void* host, size_t bytes, std::vector<cuda::RandomJob>& jobs,
                  const void* source = nullptr) {
    if (!host || weights->buffers.count(host)) return;
    cuda::Device& wd = *weights->dev;
    auto b = std::make_unique<DevBuf>();
    b->reset(&wd, bytes);
    if (source) {
      wd.copy(b->p, source, bytes);
    } else if (const RandomInit* r = model.checkpoint().device_only(host)) {
      MD_CHECK(r->kind != RandomInit::Kind::kLogUniform && r->numel * r->element_bytes() == bytes,
               "cuda executor: a random weight's recipe does not match its {} bytes", bytes);
      for (uint64_t c = 0; c < r->chunks(); ++c) jobs.push_back({*r, b->p, c});
    } else {
      wd.copy(b->p, host, bytes);
    }
    weights->buffers[host] = std::move(b);
  }

  cuda::DevWeight dev_weight(const exec::WeightView& v) const {
    return dev_weight_in(v, weights->buffers);
  }
  // v's entry of the weight table, its device copies found in `buffers` (by host address).
  static cuda::DevWeight dev_weight_in(
      const exec::WeightView& v,
      const std::unordered_map<const void*, std::unique_ptr<DevBuf>>& buffers) {
    cuda::DevWeight d;
    if (!v.data) return d;  // a distributed rank's other ranks' expert (may_be_absent)
    d.data = buffers.at(v.data)->p;
    d.scales = v.scales ? static_cast<const uint8_t*>(buffers.at(v.scales)->p) : nullptr;
    d.rows = v.rows;
    d.cols = v.cols;
    switch (v.quant) {
      case WeightQuant::kNone:
        MD_CHECK(v.dtype == DType::BF16 || v.dtype == DType::F32,
                 "cuda executor: a {} weight [{}, {}]: the tiles read bf16 or fp32 values",
                 dtype_name(v.dtype), v.rows, v.cols);
        d.dtype = v.dtype == DType::F32 ? cuda::WDType::kF32 : cuda::WDType::kBF16;
        return d;
      case WeightQuant::kMxfp4:
        d.dtype = cuda::WDType::kMXFP4;
        break;
      case WeightQuant::kInt4:  // (with zero points: uploaded as int8 codes, place())
        d.dtype = v.zero_points ? cuda::WDType::kInt8 : cuda::WDType::kInt4;
        break;
      case WeightQuant::kInt8:
        d.dtype = cuda::WDType::kInt8;
        break;
      case WeightQuant::kFp8:
        d.dtype = cuda::WDType::kFp8;
        break;
    }
    // A quantized row is whole 16-byte units of whole groups (gemv.cuh); the loaders and the
    // quantizer only make such matrices, so this guards the format's assumptions.
    d.group = v.quant == WeightQuant::kMxfp4 ? 32 : v.group;
    MD_CHECK(d.group > 0 && d.group % 32 == 0 && v.cols % d.group == 0 && v.scales,
             "cuda executor: a quantized weight [{}, {}] with group {}: the tiles need scales per "
             "group of a multiple of 32 columns dividing the row",
             v.rows, v.cols, d.group);
    d.row_groups = int32_t(v.cols / d.group);
    const auto g = uint32_t(d.group);
    d.group_shift = std::has_single_bit(g) ? int8_t(std::countr_zero(g)) : int8_t(-1);
    return d;
  }

  DevPlan& runtime(int batch, int rows) {
    auto it = plans.find({batch, rows});
    if (it != plans.end()) return *it->second;
    auto dp = std::make_unique<DevPlan>();
    plan::PlanOptions po = plan_options(batch);
    po.rows = rows;
    dp->plan = plan::compile_decode_plan(model.config(), &model.weights(), po);
    sync_plan(*dp);
    if (dp->plan.arena_bytes > arena.bytes) arena.reset(dev.get(), dp->plan.arena_bytes);
    return *plans.emplace(std::make_pair(batch, rows), std::move(dp)).first->second;
  }

  // The plan's tables into device memory (again after a test edit).
  void sync_plan(DevPlan& dp) {
    const plan::Plan& p = dp.plan;
    std::vector<cuda::DevWeight> w;
    std::vector<cuda::RandomJob> jobs;
    {
      std::lock_guard<std::mutex> lock(weights->mu);
      for (const plan::WeightRef& r : p.weights) {
        const exec::WeightView v = exec::bind_weight(model.weights(), r);
        MD_CHECK(v.data != nullptr || may_be_absent(r),
                 "decode plan: weight {} of layer {} is absent", plan::weight_kind_name(r.kind),
                 r.layer);
        place(v, jobs);
        w.push_back(dev_weight(v));
      }
      finish_placing(jobs);
    }
    sync_tables(dp, w);
  }

  // The plan's instructions, buffers, weight table w, counters and queues into device memory.
  void sync_tables(DevPlan& dp, const std::vector<cuda::DevWeight>& w) {
    const plan::Plan& p = dp.plan;
    upload(*dev, dp.instrs, p.instrs);
    upload(*dev, dp.buffers, p.buffers);
    upload(*dev, dp.weights, w);
    std::vector<uint32_t> per_step, qids, qoff{0};
    for (const plan::CounterDesc& c : p.counters) per_step.push_back(c.per_step);
    for (const auto& q : p.queue_ids) {
      qids.insert(qids.end(), q.begin(), q.end());
      qoff.push_back(uint32_t(qids.size()));
    }
    upload(*dev, dp.per_step, per_step);
    upload(*dev, dp.queue_ids, qids);
    upload(*dev, dp.queue_off, qoff);
    dp.counters.reset(dev.get(), std::max<size_t>(p.counters.size(), 1) * 4);
    dp.status.reset(dev.get(), size_t(W) * sizeof(cuda::DevStatus));
    dp.epoch = 0;
    plan_collectives(dp);
  }
  void plan_collectives(DevPlan& dp);  // collectives.cpp
  // Phase `phase`'s collectives, by the host, once the launches before it are done.
  void exchange(const DevPlan& dp, const DevStep& h, size_t phase);
  // The greedy exchange after the step (h.greedy_pairs set): every rank's pairs to every rank,
  // then each row's id (collectives.cpp).
  void exchange_greedy_ids(const DevStep& h, int32_t* next_ids);

  cuda::DevCfg dev_cfg() const { return dev_cfg_of(model.config()); }
  static cuda::DevCfg dev_cfg_of(const ModelConfig& c) {
    cuda::DevCfg d;
    d.hidden = c.hidden_size;
    d.vocab = c.vocab_size;
    d.kda_heads = c.kda_num_heads;
    d.kda_head_dim = c.kda_head_dim;
    d.kda_conv = c.kda_conv_size;
    d.kda_gate_lower_bound = float(c.kda_gate_lower_bound);
    d.mla_heads = c.mla_num_heads;
    d.nope = c.qk_nope_head_dim;
    d.rope = c.qk_rope_head_dim;
    d.v_head = c.v_head_dim;
    d.kv_lora = c.kv_lora_rank;
    d.q_lora = c.q_lora_rank;
    d.num_layers = c.num_layers;
    d.num_experts = c.num_experts;
    d.top_k = c.num_experts_per_token;
    d.moe_inter = c.moe_intermediate_size;
    d.expert_dim = c.expert_dim();
    return d;
  }

  template <class T>
  T* put(DevBuf& b, const std::vector<T>& v) {
    b.reserve(dev.get(), std::max<size_t>(v.size() * sizeof(T), 16));
    dev->copy(b.p, v.data(), v.size() * sizeof(T));
    return b.as<T>();
  }

  void step(std::span<const StepSeq> seqs, float* out_logits, int32_t* next_ids,
            std::span<const SampleRow> sampling, const StepOptions& so) {
    exec::StepLayout lay = exec::layout_step(model, *states, max_batch, seqs, out_logits, sampling,
                                             so, next_ids != nullptr);
    stats_pending.dp = nullptr;  // the last step's router ids are about to be overwritten
    stats = {};
    const ModelConfig& c = model.config();
    const int B = lay.B, L = c.num_layers, N = lay.N;
    DevPlan& dp = runtime(B, lay.R);
    const plan::Plan& p = dp.plan;

    std::vector<cuda::DevSeq> views(size_t(B) * size_t(L));
    // The batch's page tables, concatenated (after the reservations below); the views point into
    // their device copy.
    std::vector<int32_t> tables;
    std::vector<size_t> table_at(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) {
      SequenceState& s = *seqs[size_t(b)].seq;
      const int Rb = lay.rows[size_t(b)];
      s.reserve(s.pos + Rb);
      s.rowlog = {};
      if (so.keep_for_commit) s.rowlog = {s.pos, Rb};
      for (int l = 0; l < L; ++l) {
        cuda::DevSeq& v = views[size_t(b) * size_t(L) + size_t(l)];
        if (c.attn_kind[size_t(l)] == AttnKind::KDA) {
          v.kda_state = s.kda_state(l);
          v.conv_cache = s.conv_cache(l);
          if (so.keep_for_commit) {
            v.kda_state0 = s.kda_state0(l);
            v.conv0 = s.conv0(l);
            v.rowlog = s.row_inputs(l);
          }
        } else {
          v.mla = s.latent(l);
        }
      }
      table_at[size_t(b)] = tables.size();
      tables.insert(tables.end(), s.pages().begin(), s.pages().end());
    }
    const int32_t* dtables = put(page_tables, tables);
    for (int b = 0; b < B; ++b)
      for (int l = 0; l < L; ++l) {
        cuda::DevSeq& v = views[size_t(b) * size_t(L) + size_t(l)];
        if (v.mla.base) v.mla.pages = dtables + table_at[size_t(b)];
      }
    DevStep h;
    h.instrs = dp.instrs.as<plan::Instr>();
    h.buffers = dp.buffers.as<plan::BufferDesc>();
    h.weights = dp.weights.as<cuda::DevWeight>();
    h.arena = arena.as<uint8_t>();
    h.num = model.numerics();
    h.cfg = dev_cfg();
    h.batch = B;
    h.rows = lay.R;
    h.n = N;
    h.tokens = put(tokens, lay.tokens);
    h.n_logits = lay.n_logits;
    logits.reserve(dev.get(),
                   std::max<size_t>(size_t(lay.n_logits) * size_t(c.vocab_size) * 4, 16));
    h.logits = logits.as<float>();
    h.logit_of_row = put(logit_of_row, lay.logit_of_row);
    h.seqs = put(seqs_buf(), views);
    h.pos = put(pos, lay.pos);
    h.row0 = put(row0, lay.row0);
    h.seq_of_row = put(seq_of_row, lay.seq_of_row);
    // Sampling rows as plain device data (their penalty pairs gathered into one array).
    if (!sampling.empty()) {
      std::vector<cuda::DevSample> rows;
      std::vector<PenaltyCount> pens;
      for (const SampleRow& r : sampling) {
        cuda::DevSample d;
        d.temperature = r.temperature;
        d.top_k = r.top_k;
        d.top_p = r.top_p;
        d.min_p = r.min_p;
        d.repetition_penalty = r.repetition_penalty;
        d.presence_penalty = r.presence_penalty;
        d.frequency_penalty = r.frequency_penalty;
        d.uniform = r.uniform;
        d.pen0 = uint32_t(pens.size());
        d.npen = r.num_penalties;
        pens.insert(pens.end(), r.penalties, r.penalties + r.num_penalties);
        rows.push_back(d);
      }
      h.sampling = put(sample_rows, rows);
      h.penalties = put(penalties, pens);
      sample_work.reserve(dev.get(),
                          std::max<size_t>(size_t(lay.n_logits) * size_t(c.vocab_size) * 4, 16));
      h.sample_work = sample_work.as<float>();
    }
    // A rank whose step wants only greedy ids trades (max, id) pairs, not its logits block (as the
    // CPU executor: the same decision on every rank, whose inputs are the same).
    const bool greedy_exchange =
        comm && comm->size() > 1 && next_ids && !out_logits && lay.n_logits > 0 &&
        std::all_of(sampling.begin(), sampling.end(), [](const SampleRow& r) {
          return r.greedy() && !(r.has_penalties() && r.num_penalties > 0);
        });
    if (greedy_exchange) {
      greedy_pairs.reserve(dev.get(), size_t(lay.n_logits) * 8);
      h.greedy_pairs = greedy_pairs.as<float>();
      const auto [v0, v1] = dist::vocab_block(c.vocab_size, comm->size(), comm->rank());
      h.vocab_lo = v0;
      h.vocab_hi = v1;
    }
    const double t_run = run_plan(dp, h, [&] {
      for (const StepSeq& q : seqs) q.seq->rowlog.rows = 0;
    });
    if (greedy_exchange) exchange_greedy_ids(h, next_ids);
    // Outputs: the logits (when asked for) and the tokens drawn on the device, each in one copy.
    if (out_logits && lay.n_logits > 0)
      dev->copy(out_logits, h.logits, size_t(lay.n_logits) * size_t(c.vocab_size) * 4);
    std::vector<int32_t> ids;
    const bool want_ids = next_ids && lay.n_logits > 0 && !greedy_exchange;
    const size_t id_stride = want_ids ? p.buffers[p.next_ids_buffer].stride / 4 : 0;
    if (want_ids) {
      const plan::BufferDesc& d = p.buffers[p.next_ids_buffer];
      ids.resize(size_t(lay.n_logits) * id_stride);
      dev->copy(ids.data(), arena.as<uint8_t>() + d.offset, size_t(lay.n_logits) * d.stride);
    }
    // The aux capture: each listed layer's residual-stream buffer (its N rows are contiguous in
    // the device arena, written once by the step) in one copy, laid out on the host below.
    std::map<uint32_t, std::vector<uint8_t>> aux_rows;  // by buffer-table index
    for (int l : so.aux.layers) {
      const uint32_t bi = p.residual_buffer[size_t(l)];
      std::vector<uint8_t>& v = aux_rows[bi];
      if (!v.empty()) continue;  // (a layer listed twice)
      const plan::BufferDesc& d = p.buffers[bi];
      v.resize(size_t(N) * d.stride);
      dev->copy(v.data(), arena.as<uint8_t>() + d.offset, v.size());
    }
    dev->sync();  // all the copies
    if (want_ids)
      for (int j = 0; j < lay.n_logits; ++j) next_ids[j] = ids[size_t(j) * id_stride];
    if (!so.aux.layers.empty())
      exec::copy_aux_rows(p, so.aux, N,
                          [&](uint32_t bi) -> const uint8_t* { return aux_rows.at(bi).data(); });
    for (int b = 0; b < B; ++b) seqs[size_t(b)].seq->pos += lay.rows[size_t(b)];
    // The step's bytes need the experts its rows chose: read from the device only when
    // last_step_stats() is called, before the next step (one copy per MoE layer, kept out of the
    // step's time).
    stats_pending = {&dp, N, lay.pos, lay.rows};
    stats.seconds = t_run;  // (reset when the step began)
  }

  // Runs plan dp with the step's table h (its plan and run fields are set here): the megakernel,
  // or one launch per barrier phase. Returns the run's seconds; a failure (the watchdog, a fault)
  // calls on_failure, resets the plan's counters and throws the report.
  double run_plan(DevPlan& dp, DevStep& h, const std::function<void()>& on_failure) {
    const plan::Plan& p = dp.plan;
    h.queue_ids = dp.queue_ids.as<uint32_t>();
    h.queue_off = dp.queue_off.as<uint32_t>();
    h.per_step = dp.per_step.as<uint32_t>();
    h.counters = dp.counters.as<uint32_t>();
    h.epoch = dp.epoch;
    h.abort = abort.as<uint32_t>();
    h.status = dp.status.as<cuda::DevStatus>();
    h.watchdog_ns = uint64_t(opt.watchdog_seconds * 1e9);
    dev->copy(step_buf().p, &h, sizeof(DevStep));
    dev->zero(abort.p, 16);
    dev->zero(dp.status.p, size_t(W) * sizeof(cuda::DevStatus));
    const auto* ds = step_buf().as<const DevStep>();

    const double t0 = now_seconds();
    std::string sim_error;
    try {
      if (kind == ExecutorKind::kMegakernel && !dp.has_collectives) {
        dev->run_megakernel(ds, uint32_t(W));
      } else if (kind == ExecutorKind::kMegakernel) {
        // Segments between the collectives (collectives.cpp); a segment that aborts ends the run.
        for (size_t k = 0; k < dp.seg_phase.size(); ++k) {
          if (!dp.phase_collectives[dp.seg_phase[k]].empty()) exchange(dp, h, dp.seg_phase[k]);
          h.queue_off = dp.seg_begin.as<uint32_t>() + k * size_t(W);
          h.queue_end = dp.seg_end.as<uint32_t>() + k * size_t(W);
          dev->copy(step_buf().p, &h, sizeof(DevStep));
          dev->run_megakernel(ds, uint32_t(W));
          uint32_t stop = 0;
          dev->copy(&stop, abort.p, 4);
          dev->sync();
          if (stop) break;
        }
      } else if (dp.has_collectives) {
        // Phase by phase, each phase's collectives first (no graph: the host exchanges).
        for (size_t ph = 0; ph < p.phases.size(); ++ph) {
          if (!dp.phase_collectives[ph].empty()) exchange(dp, h, ph);
          const uint32_t first = p.stages[p.phases[ph].first].begin;
          const uint32_t last = p.stages[p.phases[ph].second - 1].end;
          if (last > first) dev->run_phase(ds, first, last - first);
        }
      } else {
        // One launch per barrier phase; on a GPU captured once per step shape into a CUDA graph
        // (with programmatic dependent launch between the phases) and replayed.
        auto launches = [&] {
          for (const auto& ph : p.phases) {
            const uint32_t first = p.stages[ph.first].begin, last = p.stages[ph.second - 1].end;
            if (last > first) dev->run_phase(ds, first, last - first);
          }
        };
        if (!dev->graphs()) {
          launches();
        } else {
          if (dp.graph < 0) {
            const int id = next_graph++;
            dev->begin_capture();
            try {
              launches();
              dev->end_capture(id);
            } catch (const Error&) {
              dev->abort_capture();
              throw;
            }
            dp.graph = id;  // only a graph that instantiated
          }
          dev->replay(dp.graph);
        }
      }
      dev->sync();
    } catch (const Error& e) {
      sim_error = e.what();
    }
    const double t_run = now_seconds() - t0;
    // A GPU fault (a trap, an illegal address) leaves the context unusable: report it as it is,
    // without the copies below, which would fail with a less telling error.
    if (!sim_error.empty() && dev->backend() == cuda::Backend::kGpu &&
        sim_error.find("context is lost") != std::string::npos) {
      on_failure();
      throw Error(sim_error);
    }
    uint32_t aborted = 0;
    if (kind == ExecutorKind::kMegakernel) {
      dev->copy(&aborted, abort.p, 4);
      dev->sync();
    }
    if (aborted || !sim_error.empty()) {
      std::string m = kind == ExecutorKind::kMegakernel ? stuck_report(dp, sim_error) : sim_error;
      dp.counters.reset(dev.get(), std::max<size_t>(p.counters.size(), 1) * 4);
      dp.epoch = 0;
      on_failure();
      throw Error(m);
    }
    ++dp.epoch;
    return t_run;
  }

  // ---- the draft plans (draft.cpp) ----------------------------------------------------------
  // The attached draft, its plans by (batch, context rows, block rows), and its weights on this
  // executor's device by host address (the draft is small beside the target: each executor
  // keeps its own copy, freed when another draft is attached or the executor goes).
  DraftConfig draft_cfg;
  const DraftWeights* draft_w = nullptr;
  std::map<std::tuple<int, int, int>, std::unique_ptr<DevPlan>> draft_plans;
  std::unordered_map<const void*, std::unique_ptr<DevBuf>> draft_buffers;
  DevBuf draft_views;  // the draft step's DevSeq table
  void attach_draft(const DraftConfig& c, const DraftWeights& w);
  DevPlan& draft_runtime(int batch, int ctx_rows, int rows);
  void draft_step(std::span<const DraftStepSeq> seqs);

  // What finish_stats needs of the last step.
  struct PendingStats {
    DevPlan* dp = nullptr;
    int N = 0;
    std::vector<int64_t> pos;
    std::vector<int> rows;
  } stats_pending;

  // last_step_stats(): the distinct experts of the last step's router ids, then its bytes.
  void finish_stats() {
    if (!stats_pending.dp) return;
    const plan::Plan& p = stats_pending.dp->plan;
    const ModelConfig& c = model.config();
    const int L = c.num_layers, N = stats_pending.N;
    std::vector<std::vector<int32_t>> router(static_cast<size_t>(L));
    std::vector<exec::RouterIds> rids(static_cast<size_t>(L));
    for (int l = 0; l < L; ++l) {
      const uint32_t bi = p.router_ids_buffer[size_t(l)];
      if (bi == kNone) continue;
      const plan::BufferDesc& d = p.buffers[bi];
      router[size_t(l)].resize(size_t(N) * d.stride / 4);
      dev->copy(router[size_t(l)].data(), arena.as<uint8_t>() + d.offset, size_t(N) * d.stride);
      rids[size_t(l)] = {router[size_t(l)].data(), d.stride / 4};
    }
    dev->sync();
    const double secs = stats.seconds;
    stats = decode_step_bytes(model, stats_pending.pos, exec::distinct_experts_of_step(c, N, rids),
                              std::span<const int>(stats_pending.rows));
    stats.seconds = secs;
    stats_pending.dp = nullptr;
  }

  DevBuf seqs_store, step_store;
  DevBuf& seqs_buf() { return seqs_store; }
  DevBuf& step_buf() { return step_store; }

  std::string stuck_report(DevPlan& dp, const std::string& sim_error) {
    const plan::Plan& p = dp.plan;
    std::vector<cuda::DevStatus> st(static_cast<size_t>(W));
    std::vector<uint32_t> counters(p.counters.size());
    dev->copy(st.data(), dp.status.p, st.size() * sizeof(cuda::DevStatus));
    if (!counters.empty()) dev->copy(counters.data(), dp.counters.p, counters.size() * 4);
    dev->sync();
    const bool stuck = sim_error.empty() || sim_error.find("deadlock") != std::string::npos;
    std::string m = fmt::format("decode step {} ({}, batch {}, {} blocks)",
                                stuck ? "stuck" : "failed", name_of(kind), p.batch, W);
    for (int b = 0; b < W; ++b) {
      const cuda::DevStatus& s = st[size_t(b)];
      m += fmt::format("; block {} {}", b, status_name(s.state));
      if (s.instr < p.instrs.size())
        m += fmt::format(" in instruction {}", plan::describe_instr(p, p.instrs[s.instr]));
      if (s.state == 2 && s.counter < p.counters.size()) {
        const plan::CounterDesc& cd = p.counters[s.counter];
        m += fmt::format(
            " for counter c{} ({} {} group {}): {} of {}", s.counter, plan::op_name(cd.op),
            cd.layer == plan::kNoLayer ? std::string("--") : fmt::format("L{}", cd.layer), cd.group,
            counters[s.counter], s.target);
      }
    }
    if (!sim_error.empty()) m += fmt::format(" [{}]", sim_error);
    return m;
  }

  static std::string_view name_of(ExecutorKind k) {
    return k == ExecutorKind::kMegakernel ? "cuda-megakernel" : "cuda-opbyop";
  }
};

}  // namespace md
