#include "megadecode/model/presets.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstring>
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
  c.model_type = "kimi_linear";
  c.rms_norm_eps = 1e-5;
  c.hidden_act = "silu";
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
  // The released vocabulary ends with 256 special ids: bos = vocab - 256, eos (<|im_end|>) = +2.
  c.bos_token_id = c.vocab_size - 256;
  c.eos_token_ids = {c.vocab_size - 254};
  c.pad_token_id = c.vocab_size - 1;
}

}  // namespace

std::vector<std::string> preset_names() { return {"tiny", "small", "kl48-e32", "kl48"}; }

ModelConfig preset_config(const std::string& name) {
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
};

Init init_for(const TensorSpec& t, const ModelConfig& c) {
  const std::string& n = t.name;
  auto ends = [&](const char* s) {
    std::string suf(s);
    return n.size() >= suf.size() && n.compare(n.size() - suf.size(), suf.size(), suf) == 0;
  };
  if (ends("A_log")) return {0, 0, true};
  // softplus(N(0, 0.5^2) + dt_bias) * exp(A_log) with dt_bias ~ -2.5 gives decays exp(g) mostly
  // in 0.2 .. 0.95.
  if (ends("dt_bias")) return {-2.5, 0.3};
  if (ends("e_score_correction_bias")) return {0, 0.05};
  if (ends("norm.weight") || ends("layernorm.weight")) return {1.0, 0.1};
  if (ends("conv1d.weight")) return {0, 0.5};
  if (n == "model.embed_tokens.weight") return {0, 1.0};
  const double in = double(t.shape.back());
  if (n == "lm_head.weight") return {0, 3.0 / std::sqrt(in)};
  if (ends("f_b_proj.weight")) return {0, 0.5 / std::sqrt(in)};
  (void)c;
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
        for (size_t i = ci * chunk; i < std::min(n, (ci + 1) * chunk); ++i) {
          double v = in.log_uniform_1_4 ? std::log(rng.uniform(1.0, 4.0))
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
