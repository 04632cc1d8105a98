#include "megadecode/model/weights.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sys/mman.h>
#include <unistd.h>

#include <set>

#include "megadecode/base/error.h"
#include "megadecode/model/binder.h"
#include "megadecode/model/safetensors.h"

namespace md {

void release_mapped(const void* p, size_t n) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const auto a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (a + page - 1) / page * page, hi = (a + n) / page * page;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

namespace {

// Block attention residual score weight: *_res_norm.weight [D] times *_res_proj.weight [1, D].
std::vector<float> bind_res(Binder& b, const std::string& stem, int64_t D) {
  std::vector<float> norm = b.vec(stem + "_norm.weight", {D});
  std::vector<float> proj = b.vec(stem + "_proj.weight", {1, D});
  for (size_t i = 0; i < norm.size(); ++i) norm[i] *= proj[i];
  return norm;
}

void bind_kda(Binder& b, const ModelConfig& c, const std::string& a, KdaWeights& k) {
  const int64_t H = c.kda_num_heads, K = c.kda_head_dim, C = H * K, W = c.kda_conv_size,
                D = c.hidden_size;
  const bool k3 = c.variant == ModelVariant::kKimiK3;
  // What make-model writes: the released K3 checkpoint keeps conv taps and o_norm in F32.
  const DType small = k3 ? DType::F32 : DType::BF16;
  k.q = b.linear(a + "q_proj", C, D);
  k.k = b.linear(a + "k_proj", C, D);
  k.v = b.linear(a + "v_proj", C, D);
  k.q_conv = b.vec(a + "q_conv1d.weight", {C, 1, W}, small);
  k.k_conv = b.vec(a + "k_conv1d.weight", {C, 1, W}, small);
  k.v_conv = b.vec(a + "v_conv1d.weight", {C, 1, W}, small);
  k.f_a = b.linear(a + "f_a_proj", K, D);
  k.f_b = b.linear(a + "f_b_proj", C, K);
  k.dt_bias = b.vec(a + "dt_bias", {C}, DType::F32);
  if (!k3) {
    k.A_log = b.vec(a + "A_log", {1, 1, H, 1}, DType::F32);
  } else {
    // K3 stores more entries than heads ([128] for 96 heads); the first H are the heads'. We
    // write the next power of two above H, like the release.
    int64_t n = 1;
    while (n <= H) n *= 2;
    k.A_log = b.vec_prefix(a + "A_log", H, {n}, DType::F32);
  }
  k.b = b.linear(a + "b_proj", H, D);
  if (c.kda_full_rank_gate) {
    k.g = b.linear(a + "g_proj", C, D);
  } else {
    k.g_a = b.linear(a + "g_a_proj", K, D);
    k.g_b = b.linear(a + "g_b_proj", C, K);
  }
  k.o_norm = b.vec(a + "o_norm.weight", {K}, small);
  k.o = b.linear(a + "o_proj", D, C);
}

void bind_mla(Binder& b, const ModelConfig& c, const std::string& a, MlaWeights& m) {
  const int64_t H = c.mla_num_heads, N = c.qk_nope_head_dim, P = c.qk_rope_head_dim,
                V = c.v_head_dim, R = c.kv_lora_rank, D = c.hidden_size, Q = c.q_lora_rank;
  if (Q > 0) {
    m.q_a = b.linear(a + "q_a_proj", Q, D);
    m.q_a_norm = b.vec(a + "q_a_layernorm.weight", {Q});
    m.q_b = b.linear(a + "q_b_proj", H * (N + P), Q);
  } else {
    m.q = b.linear(a + "q_proj", H * (N + P), D);
  }
  m.kv_a = b.linear(a + "kv_a_proj_with_mqa", R + P, D);
  m.kv_a_norm = b.vec(a + "kv_a_layernorm.weight", {R});
  m.kv_b = b.bf16_linear(a + "kv_b_proj", H * (N + V), R, "the absorbed attention reads its rows");
  if (c.mla_output_gate) m.g = b.linear(a + "g_proj", H * V, D);
  m.o = b.linear(a + "o_proj", D, H * V);
}

void bind_moe(Binder& b, const ModelConfig& c, const std::string& m, MoeWeights& e) {
  const int64_t D = c.hidden_size, X = c.expert_dim(), I = c.moe_intermediate_size;
  // Kimi Linear's release stores the router in F32, K3's in BF16; both are accepted.
  e.router = b.bf16_linear(m + "gate", c.num_experts, D, "the router's top-k decides the routing",
                           /*allow_f32=*/true, c.released_router_dtype());
  e.router_bias = b.vec(m + "gate.e_score_correction_bias", {c.num_experts}, DType::F32);
  if (c.latent_size > 0) {
    e.latent_down = b.linear(m + "routed_expert_down_proj", X, D);
    if (c.latent_norm) e.latent_norm = b.vec(m + "routed_expert_norm.weight", {X});
    e.latent_up = b.linear(m + "routed_expert_up_proj", D, X);
  }
  e.experts.resize(c.num_experts);
  for (int x = 0; x < c.num_experts; ++x)
    e.experts[x] =
        bind_ffn(b, fmt::format("{}experts.{}.", m, x), "w1", "w3", "w2", X, I, c.experts_mxfp4);
  e.has_shared = c.num_shared_experts > 0;
  if (e.has_shared)
    e.shared = bind_ffn(b, m + "shared_experts.", "gate_proj", "up_proj", "down_proj", D,
                        I * c.num_shared_experts);
}

ModelWeights walk(const ModelConfig& c, Binder& b) {
  ModelWeights w;
  const int64_t D = c.hidden_size;
  const std::string model = c.tensor_prefix + "model.";
  const bool res = c.attn_res_block_size > 0;
  w.embed = b.mat(model + "embed_tokens.weight", c.vocab_size, D);
  w.final_norm = b.vec(model + "norm.weight", {D});
  if (res) w.output_res_w = bind_res(b, model + "output_attn_res", D);
  w.lm_head =
      c.tie_word_embeddings ? w.embed : b.linear(c.tensor_prefix + "lm_head", c.vocab_size, D);
  w.layers.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& L = w.layers[l];
    const std::string p = fmt::format("{}layers.{}.", model, l);
    L.input_norm = b.vec(p + "input_layernorm.weight", {D});
    L.post_attn_norm = b.vec(p + "post_attention_layernorm.weight", {D});
    if (res) {
      L.attn_res_w = bind_res(b, p + "self_attention_res", D);
      L.mlp_res_w = bind_res(b, p + "mlp_res", D);
    }
    if (c.attn_kind[l] == AttnKind::KDA)
      bind_kda(b, c, p + "self_attn.", L.kda);
    else
      bind_mla(b, c, p + "self_attn.", L.mla);
    if (c.ffn_kind[l] == FfnKind::Dense)
      L.dense =
          bind_ffn(b, p + "mlp.", "gate_proj", "up_proj", "down_proj", D, c.intermediate_size);
    else
      bind_moe(b, c, p + "block_sparse_moe.", L.moe);
  }
  return w;
}

}  // namespace

bool quantized_outside_experts(const ModelWeights& w) {
  auto ffn = [](const FfnWeights& f) {
    return f.gate.quantized() || f.up.quantized() || f.down.quantized();
  };
  if (w.embed.quantized() || w.lm_head.quantized()) return true;
  for (const LayerWeights& L : w.layers) {
    const KdaWeights& k = L.kda;
    const MlaWeights& a = L.mla;
    for (const Mat* m : {&k.q, &k.k, &k.v, &k.f_a, &k.f_b, &k.b, &k.g_a, &k.g_b, &k.g, &k.o, &a.q,
                         &a.q_a, &a.q_b, &a.g, &a.kv_a, &a.kv_b, &a.o, &L.moe.router,
                         &L.moe.latent_down, &L.moe.latent_up})
      if (m->quantized()) return true;
    if (ffn(L.dense) || ffn(L.moe.shared)) return true;
  }
  return false;
}

ModelWeights bind_weights(const ModelConfig& cfg, const Checkpoint& ckpt) {
  Binder b(&ckpt, nullptr, cfg.tensor_prefix);
  b.set_quant(cfg);
  ModelWeights w = walk(cfg, b);
  for (auto& o : b.take_owned()) w.owned.push_back(std::move(o));
  w.ignored_tensors = b.check_no_extra();
  if (w.ignored_tensors > 0)
    w.note = fmt::format("note: ignored {} tensor(s) outside the language model ({}*), e.g. {}",
                         w.ignored_tensors, cfg.tensor_prefix, b.first_skipped());
  return w;
}

std::vector<TensorSpec> expected_tensors(const ModelConfig& cfg) {
  std::vector<TensorSpec> specs;
  Binder b(nullptr, &specs);
  b.set_quant(cfg);
  walk(cfg, b);
  return specs;
}

ModelSizes model_sizes(const ModelConfig& c) {
  ModelSizes s;
  const double expert_params = 3.0 * double(c.expert_dim()) * double(c.moe_intermediate_size);
  const std::string embed_name = c.tensor_prefix + "model.embed_tokens.weight";
  auto ends_with = [](const std::string& n, const char* suf) {
    const size_t k = std::char_traits<char>::length(suf);
    return n.size() >= k && n.compare(n.size() - k, k, suf) == 0;
  };
  for (const TensorSpec& t : expected_tensors(c)) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    // Codes: MXFP4's weight_packed holds two weights a byte, int4's eight an int32, int8's four;
    // weight_scale and weight_shape hold no weights (their bytes count: an MXFP4 weight costs
    // 4 + 8/32 = 4.25 bits).
    if (ends_with(t.name, ".weight_packed"))
      n *= t.dtype != DType::I32 ? 2 : c.linear_quant == WeightQuant::kInt8 ? 4 : 8;
    if (ends_with(t.name, ".weight_scale") || ends_with(t.name, ".weight_shape") ||
        ends_with(t.name, ".weight_zero_point"))
      n = 0;
    s.total_params += n;
    s.total_bytes += double(t.nbytes());
    bool routed = t.name.find(".experts.") != std::string::npos;
    bool embed = t.name == embed_name;
    // Asymmetric int4's zero points are read unpacked, a byte a group (model/binder.h): twice
    // their packed bytes.
    const double read =
        ends_with(t.name, ".weight_zero_point") ? 2.0 * double(t.nbytes()) : double(t.nbytes());
    if (!routed) {
      s.active_params += embed ? c.hidden_size : n;
      // An embedding lookup reads one row, not the table.
      s.active_bytes += embed ? double(c.hidden_size) * 2 : read;
    }
  }
  int moe_layers = 0;
  for (FfnKind f : c.ffn_kind) moe_layers += f == FfnKind::MoE;
  // The routed experts' bytes per weight: MXFP4 4.25 bits; a pack-quantized checkpoint's int4 /
  // int8 (unless its ignore list names the experts) 4 / 8 bits + a bf16 scale per group; else
  // bf16.
  const bool int_experts =
      (c.linear_quant == WeightQuant::kInt4 || c.linear_quant == WeightQuant::kInt8) &&
      !quant_ignored(c.quant_ignore, c.tensor_prefix + "model.layers.1.block_sparse_moe.experts.0.w1");
  const double per_group = (c.quant_asymmetric ? 3.0 : 2.0);  // a bf16 scale (+ a zero point byte)
  const double int_bpw = (c.linear_quant == WeightQuant::kInt8 ? 1.0 : 0.5) +
                         per_group / double(c.quant_group > 0 ? c.quant_group : c.expert_dim());
  const bool fp8_experts =
      c.linear_quant == WeightQuant::kFp8 &&
      !quant_ignored(c.quant_ignore, c.tensor_prefix + "model.layers.1.block_sparse_moe.experts.0.w1");
  s.expert_bytes = c.experts_mxfp4 ? expert_params * 4.25 / 8
                   : int_experts   ? expert_params * int_bpw
                   : fp8_experts   ? expert_params
                                   : expert_params * 2;
  s.active_params += int64_t(expert_params) * c.num_experts_per_token * moe_layers;
  s.active_bytes += s.expert_bytes * c.num_experts_per_token * moe_layers;
  s.kda_state_bytes =
      double(c.num_kda_layers()) * c.kda_num_heads * c.kda_head_dim * c.kda_head_dim * 4.0;
  s.mla_cache_bytes_per_token = double(c.num_mla_layers()) * double(c.mla_cache_width()) * 2.0;
  return s;
}

}  // namespace md
