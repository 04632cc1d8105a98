#include "megadecode/model/presets.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/base/threads.h"
#include "megadecode/base/util.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/model/random_init.h"
#include "megadecode/model/weights.h"

namespace md {

namespace {

ModelConfig kimi_linear_base() {
  ModelConfig c;
  c.variant = ModelVariant::kKimiLinear;
  c.rms_norm_eps = 1e-5;
  c.activation = Activation::kSilu;
  c.kda_conv_size = 4;
  c.latent_norm_eps = 1e-6;
  c.num_shared_experts = 1;
  c.moe_renormalize = true;
  c.routed_scaling_factor = 2.446;
  return c;
}

// Every 4th layer (1-indexed) and the last are MLA, as in the released model; first layer dense.
void set_layers(ModelConfig& c, int layers, std::vector<int> mla_1indexed) {
  c.num_layers = layers;
  c.attn_kind.assign(layers, AttnKind::KDA);
  for (int l : mla_1indexed) c.attn_kind[l - 1] = AttnKind::MLA;
  c.ffn_kind.assign(layers, FfnKind::MoE);
  c.ffn_kind[0] = FfnKind::Dense;
}

void set_special_ids(ModelConfig& c) {
  // The released vocabulary ends with 256 special ids: bos = vocab - 256, eos = +2 (<|im_end|> in
  // Kimi Linear's table, <|end_of_msg|> in Kimi K3's: both at offset 2).
  c.bos_token_id = c.vocab_size - 256;
  c.eos_token_ids = {c.vocab_size - 254};
  c.pad_token_id = c.vocab_size - 1;
}

// Kimi K3: a kimi_linear text model with every extension on (the released values).
ModelConfig kimi_k3_base() {
  ModelConfig c = kimi_linear_base();
  c.variant = ModelVariant::kKimiK3;
  c.tensor_prefix = "language_model.";
  c.activation = Activation::kSitu;
  c.situ_beta = 4.0;
  c.situ_linear_beta = 25.0;
  c.kda_full_rank_gate = true;
  c.kda_bounded_decay = true;
  c.kda_gate_lower_bound = -5.0;
  c.mla_output_gate = true;
  c.latent_norm = true;
  c.num_shared_experts = 2;
  c.routed_scaling_factor = 1.0;
  c.experts_mxfp4 = true;
  return c;
}

}  // namespace

std::vector<std::string> preset_names() {
  return {"tiny", "small", "kl48-e32", "kl48", "k3-tiny", "k3-small", "k3-slice", "k3-shard16"};
}

ModelConfig preset_config(const std::string& name) {
  if (name.rfind("k3-", 0) == 0) {
    ModelConfig c = kimi_k3_base();
    if (name == "k3-tiny") {  // the geometry of tests/data/golden/k3-tiny
      c.vocab_size = 1024;
      c.hidden_size = 64;
      set_layers(c, 6, {4, 6});
      c.intermediate_size = 128;
      c.kda_num_heads = 2;
      c.kda_head_dim = 32;
      c.mla_num_heads = 2;
      c.q_lora_rank = 48;
      c.kv_lora_rank = 32;
      c.qk_nope_head_dim = 16;
      c.qk_rope_head_dim = 8;
      c.v_head_dim = 16;
      c.num_experts = 8;
      c.num_experts_per_token = 2;
      c.latent_size = 64;  // 2 MXFP4 scale groups per expert row
      c.moe_intermediate_size = 64;
      c.attn_res_block_size = 2;
    } else if (name == "k3-small") {
      c.vocab_size = 2048;
      c.hidden_size = 128;
      set_layers(c, 8, {4, 8});
      c.intermediate_size = 256;
      c.kda_num_heads = 4;
      c.kda_head_dim = 32;
      c.mla_num_heads = 4;
      c.q_lora_rank = 64;
      c.kv_lora_rank = 64;
      c.qk_nope_head_dim = 32;
      c.qk_rope_head_dim = 16;
      c.v_head_dim = 32;
      c.num_experts = 16;
      c.num_experts_per_token = 4;
      c.latent_size = 64;
      c.moe_intermediate_size = 64;
      c.attn_res_block_size = 3;
    } else if (name == "k3-slice") {
      // K3's first four layers at full width (dense KDA, two KDA MoE, one MLA MoE; the released
      // model's layers 0-3), with 64 routed experts per layer instead of 896.
      c.vocab_size = 163840;
      c.hidden_size = 7168;
      set_layers(c, 4, {4});
      c.intermediate_size = 33792;
      c.kda_num_heads = 96;
      c.kda_head_dim = 128;
      c.mla_num_heads = 96;
      c.q_lora_rank = 1536;
      c.kv_lora_rank = 512;
      c.qk_nope_head_dim = 128;
      c.qk_rope_head_dim = 64;
      c.v_head_dim = 128;
      c.num_experts = 64;
      c.num_experts_per_token = 16;
      c.latent_size = 3584;
      c.moe_intermediate_size = 3072;
      c.attn_res_block_size = 12;
    } else if (name == "k3-shard16") {
      // One GPU's share of K3 served by 16 (the seed's 16 chips; BENCHMARKS.md): all 93 layers,
      // the residual stream whole, 1/16 of everything else: 6 of the 96 KDA and MLA heads, 1/16
      // of the dense layer, the embedding and lm_head split by vocabulary (10240 of 163840
      // rows), the shared experts' 6144 channels / 16 = 384. A standalone model has no latent
      // all-gather, so the routed experts work in the hidden space: each of 896 experts
      // (3584 -> 3072 -> 3584) is cut into 8 sub-experts of 192 channels on the hidden 7168,
      // which have exactly the elements of one eighth of an expert, and this GPU holds 448 of
      // them (1/16) and serves 8 routes a token: the one full expert of the 16 routes a GPU
      // serves on average. The q LoRA down-projection (q_a) and kv_a stay whole, as they are
      // replicated. Collectives are not modelled.
      c.vocab_size = 10240;
      c.hidden_size = 7168;
      set_layers(c, 93, {});
      for (int l = 3; l < 92; l += 4) c.attn_kind[size_t(l)] = AttnKind::MLA;
      c.attn_kind[92] = AttnKind::MLA;
      c.intermediate_size = 2112;
      c.kda_num_heads = 6;
      c.kda_head_dim = 128;
      c.mla_num_heads = 6;
      c.q_lora_rank = 1536;
      c.kv_lora_rank = 512;
      c.qk_nope_head_dim = 128;
      c.qk_rope_head_dim = 64;
      c.v_head_dim = 128;
      c.num_experts = 448;
      c.num_experts_per_token = 8;
      c.num_shared_experts = 2;
      c.latent_size = 0;
      c.latent_norm = false;
      c.moe_intermediate_size = 192;
      c.attn_res_block_size = 12;
    } else {
      std::string all;
      for (auto& n : preset_names()) all += (all.empty() ? "" : ", ") + n;
      fail("unknown preset '{}' (available: {})", name, all);
    }
    set_special_ids(c);
    return c;
  }
  ModelConfig c = kimi_linear_base();
  if (name == "tiny") {
    c.vocab_size = 1024;
    c.hidden_size = 64;
    set_layers(c, 4, {2, 4});
    c.intermediate_size = 128;
    c.kda_num_heads = 2;
    c.kda_head_dim = 32;
    c.mla_num_heads = 2;
    c.kv_lora_rank = 32;
    c.qk_nope_head_dim = 16;
    c.qk_rope_head_dim = 8;
    c.v_head_dim = 16;
    c.num_experts = 8;
    c.num_experts_per_token = 2;
    c.moe_intermediate_size = 32;
  } else if (name == "small") {
    c.vocab_size = 2048;
    c.hidden_size = 128;
    set_layers(c, 8, {4, 8});
    c.intermediate_size = 256;
    c.kda_num_heads = 4;
    c.kda_head_dim = 32;
    c.mla_num_heads = 4;
    c.kv_lora_rank = 64;
    c.qk_nope_head_dim = 32;
    c.qk_rope_head_dim = 16;
    c.v_head_dim = 32;
    c.num_experts = 16;
    c.num_experts_per_token = 4;
    c.moe_intermediate_size = 64;
  } else if (name == "kl48-e32" || name == "kl48") {
    c.vocab_size = 163840;
    c.hidden_size = 2304;
    set_layers(c, 27, {4, 8, 12, 16, 20, 24, 27});
    c.intermediate_size = 9216;
    c.kda_num_heads = 32;
    c.kda_head_dim = 128;
    c.mla_num_heads = 32;
    c.kv_lora_rank = 512;
    c.qk_nope_head_dim = 128;
    c.qk_rope_head_dim = 64;
    c.v_head_dim = 128;
    c.num_experts = name == "kl48" ? 256 : 32;
    c.num_experts_per_token = 8;
    c.moe_intermediate_size = 1024;
  } else {
    std::string all;
    for (auto& n : preset_names()) all += (all.empty() ? "" : ", ") + n;
    fail("unknown preset '{}' (available: {})", name, all);
  }
  set_special_ids(c);
  return c;
}

namespace {

// The E8M0 scale byte of random MXFP4 codes whose weights should have an rms of `rms`: uniform
// codes have an rms magnitude of sqrt(68.5 / 8) = 2.93 and the scale spread (x0.5, x1, x2) adds
// a factor sqrt(1.75) = 1.32.
int mxfp4_scale_byte_for_rms(double rms) {
  return 127 + int(std::lround(std::log2(rms / (2.926 * 1.323))));
}

// How a tensor is initialised (model/random_init.h): uniform with a given mean and standard
// deviation, log-uniform for A_log, random MXFP4 codes and scales.
RandomInit init_for(const TensorSpec& t, const ModelConfig& c) {
  using K = RandomInit::Kind;
  const std::string& n = t.name;
  auto ends = [&](const char* s) {
    std::string suf(s);
    return n.size() >= suf.size() && n.compare(n.size() - suf.size(), suf.size(), suf) == 0;
  };
  auto uniform = [](double mean, double std) {
    RandomInit r;
    r.mean = mean;
    r.half = std * std::sqrt(3.0);
    return r;
  };
  // softplus(N(0, 0.5^2) + dt_bias) * exp(A_log) with dt_bias ~ -2.5 gives decays exp(g) mostly
  // in 0.2 .. 0.95. K3's bounded gate -5 * sigmoid(exp(A_log) * (f + dt_bias)) is steeper in
  // A: exp(A_log) in 1..2, f = f_b(f_a x) ~ N(0, 0.3^2) and dt_bias ~ N(-1.5, 0.3^2) put about 98%
  // of the decays in 0.2 .. 0.95.
  if (ends("A_log")) {
    RandomInit r;
    r.kind = K::kLogUniform;
    r.hi = c.kda_bounded_decay ? 2.0 : 4.0;
    return r;
  }
  if (ends("dt_bias")) return c.kda_bounded_decay ? uniform(-1.5, 0.3) : uniform(-2.5, 0.3);
  if (ends("e_score_correction_bias")) return uniform(0, 0.05);
  if (ends("norm.weight") || ends("layernorm.weight")) return uniform(1.0, 0.1);
  if (ends("conv1d.weight")) return uniform(0, 0.5);
  if (ends("embed_tokens.weight")) return uniform(0, 1.0);
  if (ends("weight_packed")) {
    RandomInit r;
    r.kind = K::kMxfp4Codes;
    return r;
  }
  if (ends("weight_scale")) {  // an rms weight of 1/sqrt(in)
    RandomInit r;
    r.kind = K::kMxfp4Scales;
    r.scale_byte = mxfp4_scale_byte_for_rms(1.0 / std::sqrt(double(t.shape.back()) * 32));
    return r;
  }
  const double in = double(t.shape.back());
  if (ends("lm_head.weight")) return uniform(0, 3.0 / std::sqrt(in));
  if (ends("f_b_proj.weight")) return uniform(0, (c.kda_bounded_decay ? 0.3 : 0.5) / std::sqrt(in));
  // K3: a wider router (gain 1.7) spreads the sigmoid scores over (0, 1), so top-k gaps are
  // comfortable more often.
  if (c.has_k3_extensions() && ends("block_sparse_moe.gate.weight"))
    return uniform(0, 1.7 / std::sqrt(in));
  return uniform(0, 1.0 / std::sqrt(in));
}

}  // namespace

QuantRecipes random_quantized_init(WeightQuant format, int64_t rows, int64_t cols, int group,
                                   double rms, uint64_t seed) {
  using K = RandomInit::Kind;
  MD_CHECK(format == WeightQuant::kInt4 || format == WeightQuant::kInt8 ||
               format == WeightQuant::kMxfp4,
           "random weights: no random recipe for this quantized format");
  MD_CHECK(group > 0 && cols % group == 0, "random weights: group {} does not divide {} columns",
           group, cols);
  QuantRecipes q;
  q.codes.kind = K::kMxfp4Codes;
  q.codes.numel = uint64_t(rows) * uint64_t(format == WeightQuant::kInt8 ? cols : cols / 2);
  q.codes.seed = random_chunk_seed(seed, 1);
  q.scales.seed = random_chunk_seed(seed, 2);
  q.scales.numel = uint64_t(rows) * uint64_t(cols / group);
  if (format == WeightQuant::kMxfp4) {
    q.scales.kind = K::kMxfp4Scales;
    q.scales.scale_byte = mxfp4_scale_byte_for_rms(rms);
    return q;
  }
  // Uniform codes q = c - 8 in [-8, 7] have an rms of sqrt(21.5) = 4.637, q = c - 128 one of
  // sqrt(5461.5) = 73.90; scales spread +-25% around their mean add a factor 1.0104.
  const double code_rms = format == WeightQuant::kInt4 ? 4.637 : 73.90;
  q.scales.kind = K::kUniform;
  q.scales.mean = rms / (code_rms * 1.0104);
  q.scales.half = 0.25 * q.scales.mean;
  return q;
}

double random_init_rms(const RandomInit& r) {
  return std::sqrt(r.mean * r.mean + r.half * r.half / 3.0);
}

RandomInit random_init(const TensorSpec& t, const ModelConfig& cfg, uint64_t seed, size_t index) {
  RandomInit r = init_for(t, cfg);
  r.f32 = t.dtype == DType::F32;
  r.seed = random_chunk_seed(seed, index);
  r.numel = t.nbytes() / dtype_size(t.dtype);
  return r;
}

void make_random_checkpoint(const ModelConfig& cfg, const std::string& dir, uint64_t seed,
                            int shards, ThreadPool& pool, bool progress) {
  namespace fs = std::filesystem;
  MD_CHECK(shards >= 1 && shards <= 999, "--shards must be in 1..999, got {}", shards);
  std::error_code ec;
  fs::create_directories(dir, ec);
  MD_CHECK(!ec, "cannot create directory {}: {}", dir, ec.message());
  std::vector<TensorSpec> specs = expected_tensors(cfg);
  // Random values are drawn for bf16 / fp32 tensors and MXFP4 codes; a config whose
  // quantization_config stores linears otherwise (pack-quantized, FP8) cannot be made this way.
  for (const TensorSpec& t : specs)
    MD_CHECK(t.dtype == DType::BF16 || t.dtype == DType::F32 || t.dtype == DType::U8,
             "make-model: the config's quantization_config stores {} as {}; make-model writes bf16 "
             "checkpoints (with K3's MXFP4 experts): remove the quantization_config, and quantize "
             "with `megadecode quantize` or --quantize",
             t.name, dtype_name(t.dtype));
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < specs.size(); ++i) index[specs[i].name] = i;
  double total = 0, done = 0;
  for (auto& s : specs) total += double(s.nbytes());

  auto fill = [&](const TensorSpec& t, uint8_t* out) {
    const RandomInit in = random_init(t, cfg, seed, index.at(t.name));
    pool.parallel_for(in.chunks(), [&](size_t c0, size_t c1) {
      for (size_t c = c0; c < c1; ++c) fill_random_chunk(in, c, out);
    });
    done += double(t.nbytes());
    if (progress)
      std::fprintf(stderr, "\rwriting %s: %5.1f%% (%s)   ", dir.c_str(), 100.0 * done / total,
                   human_bytes(done).c_str());
  };
  write_checkpoint(dir, specs, fill, shards);
  if (progress) std::fprintf(stderr, "\n");
  std::ofstream f(fs::path(dir) / "config.json");
  f << config_to_json(cfg).dump(2) << "\n";
  MD_CHECK(f.good(), "cannot write {}/config.json", dir);
}

}  // namespace md
