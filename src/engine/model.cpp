// The reference forward path of the Kimi hybrid family (Kimi Linear, Kimi K3) on CPU threads. Each
// op is one fork-join region over the thread pool; independent matmuls that read the same input
// run in one region. The layer ops are in forward_attention.cpp and forward_ffn.cpp; this file
// holds the residual stream (plain, or K3's block attention residuals) and the logits. The decode
// plan / megakernel (plan/, exec/) reproduces this arithmetic (Kimi Linear and K3) tile by tile.
#include "megadecode/engine/model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "forward.h"
#include "megadecode/base/error.h"
#include "megadecode/dist/communicator.h"
#include "megadecode/kernels/cpu/attn_res.h"
#include "megadecode/kernels/cpu/linear.h"
#include "megadecode/kernels/cpu/matmul.h"
#include "megadecode/kernels/cpu/mxfp4.h"
#include "megadecode/kernels/cpu/ops.h"

namespace md {

namespace fwd {

void run_matmuls(ThreadPool& pool, std::span<const MatJob> jobs, bool x_bf16) {
  int64_t total = 0;
  for (const MatJob& j : jobs) total += j.w->rows;
  pool.parallel_for(
      static_cast<size_t>(total),
      [&](size_t b, size_t e) {
        int64_t base = 0;
        for (const MatJob& j : jobs) {
          int64_t r0 = std::max<int64_t>(int64_t(b) - base, 0);
          int64_t r1 = std::min<int64_t>(int64_t(e) - base, j.w->rows);
          if (r0 < r1) {
            const Mat& m = *j.w;
            const cpu::LinearWeights lw{m.data,  m.scales,       m.dtype,       m.quant,   m.cols,
                                        m.group, m.int_act_bits, m.zero_points, m.col_perm};
            cpu::linear_rows(lw, r0, r1, j.x, j.B, j.ldx, j.y, j.ldy, x_bf16);
          }
          base += j.w->rows;
        }
      },
      16);
}

}  // namespace fwd

struct Model::Impl {
  Model& m;
  fwd::Forward f;
  explicit Impl(Model& model) : m(model), f{model.cfg_, model.w_, model.num_, *model.pool_} {}

  // The residual stream of T tokens. Kimi Linear: x += attn(norm(x)); x += ffn(norm(x)). K3's
  // block attention residuals keep the current block's partial sum `prefix` and the completed
  // block summaries `blocks` (the first is the embedding), and feed each attention, each FFN and
  // the final norm with a softmax mix of them (kernels/cpu/attn_res.h):
  //   h = blocks empty ? prefix : mix(blocks + [prefix], attn_res)
  //   at layers 0, B, 2B, ...: blocks.push(prefix), prefix = none
  //   prefix = prefix + attn(norm(h))      (= attn(...) when none)
  //   h = mix(blocks + [prefix], mlp_res); prefix += ffn(norm(h))
  //   final: h = mix(blocks + [prefix], output_res), logits = lm_head(norm(h)).
  struct Stream {
    int T;
    int64_t D;
    std::vector<float> prefix;
    bool has_prefix = true;
    std::vector<std::vector<float>> blocks;
  };

  void mix(const Stream& st, const std::vector<float>& w, float* out) const {
    const ModelConfig& c = m.cfg_;
    std::vector<const float*> src(st.blocks.size() + 1);
    for (int t = 0; t < st.T; ++t) {
      for (size_t j = 0; j < st.blocks.size(); ++j) src[j] = st.blocks[j].data() + t * st.D;
      src.back() = st.prefix.data() + t * st.D;
      cpu::attn_res_mix(src.data(), int(src.size()), w.data(), st.D, float(c.rms_norm_eps),
                        out + t * st.D, f.rnd());
    }
  }

  void accumulate(Stream& st, const float* y) const {
    if (st.has_prefix) {
      add_inplace(st.prefix.data(), y, st.T * st.D, f.rnd());
    } else {
      std::copy(y, y + st.T * st.D, st.prefix.begin());
      st.has_prefix = true;
    }
  }

  void forward(SequenceState& s, std::span<const int32_t> ids, float* logits, bool all,
               const AuxCapture* aux) {
    const ModelConfig& c = m.cfg_;
    const int T = int(ids.size());
    const int64_t D = c.hidden_size;
    MD_CHECK(T >= 1, "forward: no tokens given");
    for (int32_t id : ids)
      MD_CHECK(id >= 0 && id < c.vocab_size, "token id {} is outside the vocabulary [0, {})", id,
               c.vocab_size);
    MD_CHECK(s.valid() && s.pool()->compatible(*m.states_),
             "forward: the sequence is not a state of this model (a pool of another model or "
             "cache type)");
    if (aux) {
      MD_CHECK(aux->out || aux->layers.empty(), "forward: aux capture without an output buffer");
      for (int L : aux->layers)
        MD_CHECK(L >= 1 && L <= c.num_layers - 1,
                 "forward: aux layer id {} is out of range 1 .. {} (id L captures the residual "
                 "stream entering layer L)",
                 L, c.num_layers - 1);
    }
    s.reserve(s.pos + T);  // the latent-cache rows this call writes (an error changes nothing)
    s.rowlog = {};
    const bool res = c.attn_res_block_size > 0;
    Stream st{T, D, std::vector<float>(T * D), true, {}};
    std::vector<float>& x = st.prefix;
    std::vector<float> h(T * D), o(T * D), in(res ? T * D : 0);
    for (int t = 0; t < T; ++t) {
      const bf16* row = static_cast<const bf16*>(m.w_.embed.row(ids[t]));
      for (int64_t j = 0; j < D; ++j) x[t * D + j] = bf16_to_f32(row[j]);
    }
    const float eps = float(c.rms_norm_eps);
    auto norm = [&](const float* src, const std::vector<float>& wt) {
      for (int t = 0; t < T; ++t)
        cpu::rmsnorm(src + t * D, wt.data(), D, eps, h.data() + t * D, f.rnd());
    };
    const int64_t aux_width = aux ? int64_t(aux->layers.size()) * D : 0;
    for (int l = 0; l < c.num_layers; ++l) {
      const LayerWeights& L = m.w_.layers[l];
      // The stream entering layer l: x after layer l - 1 (K3: the block's partial sum, before
      // this layer's block bookkeeping).
      for (size_t a = 0; aux && a < aux->layers.size(); ++a)
        if (aux->layers[a] == l)
          for (int t = 0; t < T; ++t)
            std::copy_n(x.data() + t * D, D, aux->out + t * aux_width + int64_t(a) * D);
      if (res) {
        if (st.blocks.empty())
          std::copy(x.begin(), x.end(), in.begin());
        else
          mix(st, L.attn_res_w, in.data());
        if (l % c.attn_res_block_size == 0) {
          st.blocks.push_back(x);
          st.has_prefix = false;
        }
        norm(in.data(), L.input_norm);
      } else {
        norm(x.data(), L.input_norm);
      }
      if (c.attn_kind[l] == AttnKind::KDA)
        f.kda(l, s, h.data(), T, o.data());
      else
        f.mla(l, s, h.data(), T, o.data());
      accumulate(st, o.data());
      if (res) {
        mix(st, L.mlp_res_w, in.data());
        norm(in.data(), L.post_attn_norm);
      } else {
        norm(x.data(), L.post_attn_norm);
      }
      if (c.ffn_kind[l] == FfnKind::Dense)
        f.dense_ffn(L.dense, h.data(), T, o.data());
      else
        f.moe(l, h.data(), T, o.data());
      accumulate(st, o.data());
    }
    s.pos += T;
    if (!logits) return;
    const int first = all ? 0 : T - 1, n = T - first;
    const float* fin = x.data();
    if (res) {
      mix(st, m.w_.output_res_w, in.data());
      fin = in.data();
    }
    for (int t = first; t < T; ++t)
      cpu::rmsnorm(fin + t * D, m.w_.final_norm.data(), D, eps, h.data() + (t - first) * D,
                   f.rnd());
    f.matmuls({{&m.w_.lm_head, h.data(), D, logits, c.vocab_size, n}});
    // The official bf16 model's logits are bf16 (lm_head output); so are ours in that mode, so
    // that greedy ties break the same way (lowest id among equal values).
    f.round(logits, n * c.vocab_size);
  }
};

Model::Model(const std::string& dir, const ModelOptions& opt) : opt_(opt) {
  namespace fs = std::filesystem;
  MD_CHECK(fs::is_directory(dir), "model directory {} does not exist or is not a directory", dir);
  cfg_ = load_config_file((fs::path(dir) / "config.json").string());
  ckpt_ = std::make_unique<Checkpoint>(dir, opt.load);
  opt_.load.progress = nullptr;  // (the caller's callback is not kept beyond the load)
  init();
}

Model::Model(const ModelConfig& cfg, uint64_t seed, const ModelOptions& opt)
    : cfg_(cfg), opt_(opt), ckpt_(Checkpoint::random(cfg, seed)) {
  init();
}

Model::Model(const std::string& dir, const ModelOptions& opt, const dist::Shard& shard,
             dist::Communicator* comm)
    : opt_(opt), shard_(shard), comm_(comm) {
  namespace fs = std::filesystem;
  MD_CHECK(fs::is_directory(dir), "model directory {} does not exist or is not a directory", dir);
  cfg_ = load_config_file((fs::path(dir) / "config.json").string());
  if (shard_.sharded()) {
    MD_CHECK(cfg_.linear_quant != WeightQuant::kInt4 && cfg_.linear_quant != WeightQuant::kInt8 &&
                 cfg_.linear_quant != WeightQuant::kFp8,
             "{}: a pack-quantized (int4 / int8) or FP8 checkpoint does not run distributed yet; "
             "load the bf16 one and quantize at load instead (--quantize slices each rank's "
             "matrices first)",
             describe_shard(shard_));
    MD_CHECK(comm_ && comm_->size() == shard_.world() && comm_->rank() == shard_.rank,
             "{}: the layout needs {} ranks and this is rank {}; the communicator has {} ranks "
             "and this is its rank {} (run under mpirun -np {})",
             describe_shard(shard_), shard_.world(), shard_.rank, comm_ ? comm_->size() : 0,
             comm_ ? comm_->rank() : -1, shard_.world());
    dist::check_layout(cfg_, shard_);
    // A rank reads only its slices of a shared mapping; a private copy of every file per rank
    // would hold the whole model once per rank.
    MD_CHECK(opt.load.mode == WeightLoad::kMap,
             "{}: --no-mmap is for single-process runs (a distributed rank maps the checkpoint "
             "and reads only its slices)",
             describe_shard(shard_));
  }
  ckpt_ = std::make_unique<Checkpoint>(dir, opt.load);
  opt_.load.progress = nullptr;  // (the caller's callback is not kept beyond the load)
  init();
}

void Model::init() {
  const ModelOptions& opt = opt_;
  w_ = bind_weights(cfg_, *ckpt_);
  if (shard_.sharded()) {
    MD_CHECK(!quantized_outside_experts(w_),
             "{}: a checkpoint with quantized linears (pack-quantized int4 / int8, or MXFP4 beyond "
             "the routed experts) does not run distributed yet; load the bf16 one and quantize at "
             "load instead (--quantize slices each rank's matrices first)",
             describe_shard(shard_));
    full_cfg_ = cfg_;
    // (The checkpoint is a read-only file mapping: the copies' sources can be let go.)
    w_ = dist::shard_weights(full_cfg_, w_, shard_, &shard_bytes_, /*release_sources=*/true);
    cfg_ = dist::shard_config(full_cfg_, shard_);
  }
  if (opt.quantize.scheme != QuantScheme::kNone) {
    // (Random weights generated on a CUDA device are drawn in the format: QuantizeReport::drawn.)
    ThreadPool qpool(opt.threads, opt.pin_threads);
    quant_ = quantize_weights(cfg_, w_, opt.quantize, qpool, ckpt_.get());
  }
  if (opt.quantize.int_act_bits) {
    require_host_weights("--act-quant");
    quant_.int_activation_matrices = use_int_activations(w_, opt.quantize.int_act_bits);
  }
  num_ = numerics_of(cfg_, opt);
  if (num_.round_a_log) {  // Numerics::round_a_log
    for (LayerWeights& L : w_.layers)
      for (float& a : L.kda.A_log) a = round_bf16(a);
  }
  pool_ = std::make_unique<ThreadPool>(opt.threads, opt.pin_threads);
  states_ = std::make_unique<StatePool>(cfg_, num_.round_bf16, opt.states);
  impl_ = std::make_unique<Impl>(*this);
}

Model::~Model() = default;

void Model::require_host_weights(const char* who) const {
  MD_CHECK(weights_on_host(),
           "{}: this model's weights ({}) are generated on a CUDA device and are not in host "
           "memory; run it with a CUDA executor (--device cuda or cuda-sim), or write the "
           "checkpoint with make-model",
           who, ckpt_->dir());
}

void Model::touch_weights(const std::function<void(double, double)>& progress) const {
  const double total = double(ckpt_->total_bytes());
  double done = 0, reported = 0;
  volatile uint8_t sink = 0;
  for (const auto& [name, t] : ckpt_->tensors()) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    uint8_t acc = 0;
    const size_t n = ckpt_->device_only(p) ? 0 : t.nbytes;  // (not in host memory: skipped)
    for (size_t i = 0; i < n; i += 4096) acc ^= p[i];
    sink = sink ^ acc;
    done += double(t.nbytes);
    if (progress && (done - reported > total / 200 || done == total)) {
      progress(done, total);
      reported = done;
    }
  }
}

SequenceState Model::new_sequence() const {
  return states_->acquire();
}

void Model::forward(SequenceState& seq, std::span<const int32_t> ids, float* logits,
                    bool all_positions, const AuxCapture* aux) {
  require_host_weights("the reference path");
  MD_CHECK(!shard_.sharded(),
           "the reference path runs whole models only; this is {} (use a plan executor: --executor "
           "megakernel or opbyop)",
           describe_shard(shard_));
  impl_->forward(seq, ids, logits, all_positions, aux);
}

}  // namespace md
