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
  return {"tiny", "small", "kl48-e32", "kl48", "k3-tiny", "k3-small", "k3-slice"};
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

// How a tensor is initialised: uniform with a given mean and standard deviation, optionally
// passed through a transform (A_log = log U(1, 4)).
struct Init {
  double mean = 0, std = 1;
  bool log_uniform_1_4 = false;
  double log_uniform_hi = 4.0;  // A_log = log U(1, hi)
  // MXFP4 tensors (U8): 1 = weight_packed, uniformly random codes; 2 = weight_scale, E8M0 bytes
  // uniform in scale_byte - 1 .. scale_byte + 1.
  int mxfp4 = 0;
  int scale_byte = 127;
};

Init init_for(const TensorSpec& t, const ModelConfig& c) {
  const std::string& n = t.name;
  auto ends = [&](const char* s) {
    std::string suf(s);
    return n.size() >= suf.size() && n.compare(n.size() - suf.size(), suf.size(), suf) == 0;
  };
  // softplus(N(0, 0.5^2) + dt_bias) * exp(A_log) with dt_bias ~ -2.5 gives decays exp(g) mostly
  // in 0.2 .. 0.95. K3's bounded gate -5 * sigmoid(exp(A_log) * (f + dt_bias)) is steeper in
  // A: exp(A_log) in 1..2, f = f_b(f_a x) ~ N(0, 0.3^2) and dt_bias ~ N(-1.5, 0.3^2) put about 98%
  // of the decays in 0.2 .. 0.95.
  if (ends("A_log")) return Init{0, 0, true, c.kda_bounded_decay ? 2.0 : 4.0};
  if (ends("dt_bias")) return c.kda_bounded_decay ? Init{-1.5, 0.3} : Init{-2.5, 0.3};
  if (ends("e_score_correction_bias")) return {0, 0.05};
  if (ends("norm.weight") || ends("layernorm.weight")) return {1.0, 0.1};
  if (ends("conv1d.weight")) return {0, 0.5};
  if (ends("embed_tokens.weight")) return {0, 1.0};
  if (ends("weight_packed")) return Init{.mxfp4 = 1};
  if (ends("weight_scale")) {
    // Uniform codes have an rms magnitude of sqrt(68.5 / 8) = 2.93 and the scale spread (x0.5,
    // x1, x2) adds a factor sqrt(1.75) = 1.32: aim at an rms weight of 1/sqrt(in).
    const double in = double(t.shape.back()) * 32;
    const double target = 1.0 / (2.926 * 1.323 * std::sqrt(in));
    return Init{.mxfp4 = 2, .scale_byte = 127 + int(std::lround(std::log2(target)))};
  }
  const double in = double(t.shape.back());
  if (ends("lm_head.weight")) return {0, 3.0 / std::sqrt(in)};
  if (ends("f_b_proj.weight")) return {0, (c.kda_bounded_decay ? 0.3 : 0.5) / std::sqrt(in)};
  // K3: a wider router (gain 1.7) spreads the sigmoid scores over (0, 1), so top-k gaps are
  // comfortable more often.
  if (c.has_k3_extensions() && ends("block_sparse_moe.gate.weight"))
    return {0, 1.7 / std::sqrt(in)};
  return {0, 1.0 / std::sqrt(in)};
}

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull + (a << 6) + (a >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  return z ^ (z >> 31);
}

}  // namespace

void make_random_checkpoint(const ModelConfig& cfg, const std::string& dir, uint64_t seed,
                            int shards, ThreadPool& pool, bool progress) {
  namespace fs = std::filesystem;
  MD_CHECK(shards >= 1 && shards <= 999, "--shards must be in 1..999, got {}", shards);
  std::error_code ec;
  fs::create_directories(dir, ec);
  MD_CHECK(!ec, "cannot create directory {}: {}", dir, ec.message());
  std::vector<TensorSpec> specs = expected_tensors(cfg);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < specs.size(); ++i) index[specs[i].name] = i;
  double total = 0, done = 0;
  for (auto& s : specs) total += double(s.nbytes());

  const size_t chunk = size_t(1) << 20;
  auto fill = [&](const TensorSpec& t, uint8_t* out) {
    const Init in = init_for(t, cfg);
    const size_t n = t.nbytes() / dtype_size(t.dtype);
    const uint64_t tseed = mix(seed, index.at(t.name));
    const double half = in.std * std::sqrt(3.0);
    const size_t chunks = (n + chunk - 1) / chunk;
    pool.parallel_for(chunks, [&](size_t c0, size_t c1) {
      for (size_t ci = c0; ci < c1; ++ci) {
        Rng rng(mix(tseed, ci));
        if (in.mxfp4) {
          for (size_t i = ci * chunk; i < std::min(n, (ci + 1) * chunk); ++i) {
            const uint64_t r = rng.next();
            out[i] = in.mxfp4 == 1 ? uint8_t(r >> 56) : uint8_t(in.scale_byte - 1 + (r >> 32) % 3);
          }
          continue;
        }
        for (size_t i = ci * chunk; i < std::min(n, (ci + 1) * chunk); ++i) {
          double v = in.log_uniform_1_4 ? std::log(rng.uniform(1.0, in.log_uniform_hi))
                                        : in.mean + rng.uniform(-half, half);
          // Every value is bf16-representable, also in F32 tensors, so bf16 and fp32 runs of
          // the reference see identical weights.
          float f = round_bf16(float(v));
          if (t.dtype == DType::F32)
            std::memcpy(out + 4 * i, &f, 4);
          else {
            bf16 b = f32_to_bf16(f);
            std::memcpy(out + 2 * i, &b, 2);
          }
        }
      }
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
