#include "megadecode/model/weights.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <set>

#include "megadecode/base/error.h"
#include "megadecode/model/safetensors.h"

namespace md {

namespace {

// Walks the architecture's tensors once. With a checkpoint it binds and validates them; without
// one it only records the expected specs (so make-model and the loader cannot disagree).
class Binder {
 public:
  Binder(const Checkpoint* ck, std::vector<TensorSpec>* specs) : ck_(ck), specs_(specs) {}

  Mat mat(const std::string& name, int64_t rows, int64_t cols, bool allow_f32 = false,
          DType write_dtype = DType::BF16) {
    const TensorInfo* t = lookup(name, {rows, cols}, write_dtype);
    Mat m;
    m.rows = rows;
    m.cols = cols;
    if (!t) return m;
    MD_CHECK(t->dtype == DType::BF16 || (allow_f32 && t->dtype == DType::F32),
             "tensor {} in {}: dtype {} is not supported for this weight (expected BF16{})", name,
             t->file, dtype_name(t->dtype), allow_f32 ? " or F32" : "");
    m.data = t->data;
    m.dtype = t->dtype;
    return m;
  }

  // A small tensor read into fp32 (any float dtype); `shape` is the exact expected shape.
  std::vector<float> vec(const std::string& name, std::vector<int64_t> shape,
                         DType write_dtype = DType::BF16) {
    const TensorInfo* t = lookup(name, shape, write_dtype);
    if (!t) return {};
    std::vector<float> out(static_cast<size_t>(t->numel()));
    switch (t->dtype) {
      case DType::F32: {
        auto* p = static_cast<const float*>(t->data);
        out.assign(p, p + out.size());
        break;
      }
      case DType::BF16: {
        auto* p = static_cast<const bf16*>(t->data);
        for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_f32(p[i]);
        break;
      }
      case DType::F16: {
        auto* p = static_cast<const uint16_t*>(t->data);
        for (size_t i = 0; i < out.size(); ++i) out[i] = f16_to_f32(p[i]);
        break;
      }
      default:
        fail("tensor {} in {}: dtype {} is not a floating-point type", name, t->file,
             dtype_name(t->dtype));
    }
    return out;
  }

  void check_no_extra() const {
    if (!ck_) return;
    std::vector<std::string> extra;
    for (const auto& [name, t] : ck_->tensors())
      if (!used_.count(name)) extra.push_back(name);
    if (!extra.empty()) {
      if (extra.size() > 5) extra.resize(5), extra.push_back("...");
      fail("checkpoint {}: unexpected tensor(s) not used by the architecture: {}", ck_->dir(),
           fmt::join(extra, ", "));
    }
  }

 private:
  const TensorInfo* lookup(const std::string& name, const std::vector<int64_t>& shape,
                           DType write_dtype) {
    if (!ck_) {
      specs_->push_back(TensorSpec{name, write_dtype, shape});
      return nullptr;
    }
    const TensorInfo* t = ck_->find(name);
    MD_CHECK(t, "checkpoint {}: missing tensor {} (expected shape [{}])", ck_->dir(), name,
             fmt::join(shape, ", "));
    MD_CHECK(t->shape == shape, "tensor {} in {}: shape {} does not match the config (expected [{}])",
             name, t->file, t->shape_str(), fmt::join(shape, ", "));
    used_.insert(name);
    return t;
  }

  const Checkpoint* ck_;
  std::vector<TensorSpec>* specs_;
  std::set<std::string> used_;
};

FfnWeights bind_ffn(Binder& b, const std::string& p, const char* g, const char* u, const char* d,
                    int64_t D, int64_t I) {
  FfnWeights f;
  f.gate = b.mat(p + g + ".weight", I, D);
  f.up = b.mat(p + u + ".weight", I, D);
  f.down = b.mat(p + d + ".weight", D, I);
  return f;
}

ModelWeights walk(const ModelConfig& c, Binder& b) {
  ModelWeights w;
  const int64_t D = c.hidden_size;
  w.embed = b.mat("model.embed_tokens.weight", c.vocab_size, D);
  w.final_norm = b.vec("model.norm.weight", {D});
  w.lm_head = c.tie_word_embeddings ? w.embed : b.mat("lm_head.weight", c.vocab_size, D);
  w.layers.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& L = w.layers[l];
    const std::string p = fmt::format("model.layers.{}.", l);
    L.input_norm = b.vec(p + "input_layernorm.weight", {D});
    L.post_attn_norm = b.vec(p + "post_attention_layernorm.weight", {D});
    const std::string a = p + "self_attn.";
    if (c.attn_kind[l] == AttnKind::KDA) {
      const int64_t H = c.kda_num_heads, K = c.kda_head_dim, C = H * K, W = c.kda_conv_size;
      KdaWeights& k = L.kda;
      k.q = b.mat(a + "q_proj.weight", C, D);
      k.k = b.mat(a + "k_proj.weight", C, D);
      k.v = b.mat(a + "v_proj.weight", C, D);
      k.q_conv = b.vec(a + "q_conv1d.weight", {C, 1, W});
      k.k_conv = b.vec(a + "k_conv1d.weight", {C, 1, W});
      k.v_conv = b.vec(a + "v_conv1d.weight", {C, 1, W});
      k.f_a = b.mat(a + "f_a_proj.weight", K, D);
      k.f_b = b.mat(a + "f_b_proj.weight", C, K);
      k.dt_bias = b.vec(a + "dt_bias", {C}, DType::F32);
      k.A_log = b.vec(a + "A_log", {1, 1, H, 1}, DType::F32);
      k.b = b.mat(a + "b_proj.weight", H, D);
      k.g_a = b.mat(a + "g_a_proj.weight", K, D);
      k.g_b = b.mat(a + "g_b_proj.weight", C, K);
      k.o_norm = b.vec(a + "o_norm.weight", {K});
      k.o = b.mat(a + "o_proj.weight", D, C);
    } else {
      const int64_t H = c.mla_num_heads, N = c.qk_nope_head_dim, P = c.qk_rope_head_dim,
                    V = c.v_head_dim, R = c.kv_lora_rank;
      MD_CHECK(c.q_lora_rank == 0,
               "config: q_lora_rank is set but Kimi Linear MLA uses a plain q_proj");
      MlaWeights& m = L.mla;
      m.q = b.mat(a + "q_proj.weight", H * (N + P), D);
      m.kv_a = b.mat(a + "kv_a_proj_with_mqa.weight", R + P, D);
      m.kv_a_norm = b.vec(a + "kv_a_layernorm.weight", {R});
      m.kv_b = b.mat(a + "kv_b_proj.weight", H * (N + V), R);
      m.o = b.mat(a + "o_proj.weight", D, H * V);
    }
    if (c.ffn_kind[l] == FfnKind::Dense) {
      L.dense = bind_ffn(b, p + "mlp.", "gate_proj", "up_proj", "down_proj", D,
                         c.intermediate_size);
    } else {
      const std::string m = p + "block_sparse_moe.";
      MoeWeights& e = L.moe;
      e.router = b.mat(m + "gate.weight", c.num_experts, D, /*allow_f32=*/true, DType::F32);
      e.router_bias = b.vec(m + "gate.e_score_correction_bias", {c.num_experts}, DType::F32);
      e.experts.resize(c.num_experts);
      for (int x = 0; x < c.num_experts; ++x)
        e.experts[x] = bind_ffn(b, fmt::format("{}experts.{}.", m, x), "w1", "w3", "w2", D,
                                c.moe_intermediate_size);
      e.has_shared = c.num_shared_experts > 0;
      if (e.has_shared)
        e.shared = bind_ffn(b, m + "shared_experts.", "gate_proj", "up_proj", "down_proj", D,
                            c.moe_intermediate_size * c.num_shared_experts);
    }
  }
  return w;
}

}  // namespace

ModelWeights bind_weights(const ModelConfig& cfg, const Checkpoint& ckpt) {
  Binder b(&ckpt, nullptr);
  ModelWeights w = walk(cfg, b);
  b.check_no_extra();
  return w;
}

std::vector<TensorSpec> expected_tensors(const ModelConfig& cfg) {
  std::vector<TensorSpec> specs;
  Binder b(nullptr, &specs);
  walk(cfg, b);
  return specs;
}

ModelSizes model_sizes(const ModelConfig& c) {
  ModelSizes s;
  const double expert_params = 3.0 * double(c.hidden_size) * double(c.moe_intermediate_size);
  for (const TensorSpec& t : expected_tensors(c)) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    s.total_params += n;
    s.total_bytes += double(t.nbytes());
    bool routed = t.name.find(".experts.") != std::string::npos;
    bool embed = t.name == "model.embed_tokens.weight";
    if (!routed) {
      s.active_params += embed ? c.hidden_size : n;
      // An embedding lookup reads one row, not the table.
      s.active_bytes += embed ? double(c.hidden_size) * 2 : double(t.nbytes());
    }
  }
  int moe_layers = 0;
  for (FfnKind f : c.ffn_kind) moe_layers += f == FfnKind::MoE;
  s.expert_bytes = expert_params * 2;
  s.active_params += int64_t(expert_params) * c.num_experts_per_token * moe_layers;
  s.active_bytes += s.expert_bytes * c.num_experts_per_token * moe_layers;
  s.kda_state_bytes = double(c.num_kda_layers()) * c.kda_num_heads * c.kda_head_dim *
                      c.kda_head_dim * 4.0;
  s.mla_cache_bytes_per_token = double(c.num_mla_layers()) * double(c.mla_cache_width()) * 4.0;
  return s;
}

}  // namespace md
