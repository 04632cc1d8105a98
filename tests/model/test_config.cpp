// config.json parsing, validation and serialisation, one suite for Kimi Linear (the released
// kimi_linear schema) and Kimi K3 (kimi_k3: the same schema under `text_config`, with extensions):
// the released configs, round trips, the golden presets' geometry, and errors naming the field.
// Below the shared suite: the checks that only one variant has (K3's wrapper, its extension fields
// and its quantization_config).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <ostream>

#include "megadecode/base/error.h"
#include "megadecode/model/config.h"
#include "megadecode/model/presets.h"
#include "test_util.h"

namespace md {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

// A config shaped like the released Kimi-Linear-48B-A3B one.
json released_kimi_linear() {
  return json::parse(R"({
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
      "kda_layers": [1,2,3,5,6,7,9,10,11,13,14,15,17,18,19,21,22,23,25,26],
      "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    "q_lora_rank": null, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": true,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "moe_intermediate_size": 1024, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": true, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "use_grouped_topk": true, "num_expert_group": 1, "topk_group": 1,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "rope_theta": 10000.0, "model_max_length": 1048576})");
}

// The released moonshotai/Kimi-K3 config.json (the fields a text engine reads, and a few it
// ignores), with the layer lists built rather than spelled out.
json released_k3() {
  json j = json::parse(R"({
    "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "media_placeholder_token_id": 163605, "tie_word_embeddings": false, "dtype": "bfloat16",
    "text_config": {
      "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
      "architectures": ["KimiLinearForCausalLM"], "attn_res_block_size": 12,
      "bos_token_id": 163584, "eos_token_id": 163586, "first_k_dense_replace": 1,
      "hidden_act": "situ", "hidden_size": 7168, "intermediate_size": 33792,
      "kv_lora_rank": 512, "latent_moe_use_norm": true,
      "linear_attn_config": {"gate_lower_bound": -5.0, "head_dim": 128, "num_heads": 96,
        "short_conv_kernel_size": 4, "use_full_rank_gate": true},
      "max_position_embeddings": 1048576, "mla_use_nope": true, "mla_use_output_gate": true,
      "model_type": "kimi_linear", "moe_intermediate_size": 3072, "moe_layer_freq": 1,
      "moe_renormalize": true, "moe_router_activation_func": "sigmoid",
      "num_attention_heads": 96, "num_expert_group": 1, "num_experts": 896,
      "num_experts_per_token": 16, "num_hidden_layers": 93, "num_key_value_heads": 96,
      "num_nextn_predict_layers": 0, "num_shared_experts": 2, "pad_token_id": 163839,
      "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
      "quantization_config": {
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized",
          "input_activations": null, "output_activations": null, "targets": ["Linear"],
          "weights": {"actorder": null, "block_structure": null, "dynamic": false,
            "group_size": 32, "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
            "scale_dtype": "torch.uint8", "strategy": "group", "symmetric": true,
            "type": "float", "zp_dtype": null}}},
        "format": "mxfp4-pack-quantized", "global_compression_ratio": null,
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
          "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*", "re:.*vision_tower.*",
          "re:.*mm_projector.*"],
        "kv_cache_scheme": null, "quant_method": "compressed-tensors",
        "quantization_status": "compressed"},
      "rms_norm_eps": 1e-05, "routed_expert_hidden_size": 3584, "routed_scaling_factor": 1.0,
      "tie_word_embeddings": false, "topk_group": 1, "topk_method": "noaux_tc",
      "use_grouped_topk": true, "v_head_dim": 128, "vocab_size": 163840},
    "vision_config": {"vt_hidden_size": 1024, "vt_num_hidden_layers": 27}})");
  json full = json::array(), kda = json::array();
  for (int l = 1; l <= 93; ++l) (l % 4 == 0 || l == 93 ? full : kda).push_back(l);
  j["text_config"]["linear_attn_config"]["full_attn_layers"] = full;
  j["text_config"]["linear_attn_config"]["kda_layers"] = kda;
  return j;
}

std::string error_of(const json& j) {
  try {
    parse_config(j);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The K3 extension fields of a parsed config (all off for Kimi Linear).
struct Extensions {
  bool any = false;  // has_k3_extensions()
  bool full_rank_gate = false, bounded_decay = false;
  double gate_lower_bound = 0;
  bool output_gate = false;
  int64_t latent_size = 0;
  bool latent_norm = false, situ = false;
  double situ_beta = 1.0, situ_linear_beta = 0;
  int attn_res_block_size = 0;
  bool experts_mxfp4 = false;
};

// A tiny preset's geometry (the golden model's, tests/data/golden/<preset>).
struct Geometry {
  int64_t vocab, hidden;
  int layers;
  int64_t intermediate;
  std::vector<int> mla_1indexed;
  int kda_heads, kda_head_dim, conv, mla_heads, q_lora, kv_lora, nope, rope, v_head;
  int experts, experts_per_token;
  int64_t latent, moe_intermediate;
  int shared, attn_res_block_size;
  double gate_lower_bound, situ_beta, situ_linear_beta;
};

struct ConfigCase {
  const char* name;  // the instantiation's name
  json (*released)();
  ModelVariant variant;
  const char* model_type;  // top level
  bool nested;             // the text model's fields are under text_config (K3)
  const char* tensor_prefix;
  // The released config.
  int layers, mla_layers, kda_layers;
  std::vector<int> mla_at, kda_at;  // some 0-indexed layers of each kind
  int64_t kda_dim, mla_cache_width, expert_dim;
  int q_lora_rank, experts, experts_per_token, shared_experts;
  double routed_scaling_factor;
  Extensions ext;
  int too_many_experts_per_token;  // > experts
  // Presets: a large one (serialisation) and the tiny golden one.
  const char* large_preset;
  const char* tiny_preset;
  Geometry tiny;

  // The JSON path of the text model's fields in messages, and the object that holds them.
  std::string path() const { return nested ? "text_config." : ""; }
  json& text(json& j) const { return nested ? j["text_config"] : j; }
};
void PrintTo(const ConfigCase& c, std::ostream* os) {
  *os << c.name;
}

const ConfigCase kKimiLinear{
    .name = "KimiLinear",
    .released = released_kimi_linear,
    .variant = ModelVariant::kKimiLinear,
    .model_type = "kimi_linear",
    .nested = false,
    .tensor_prefix = "",
    .layers = 27,
    .mla_layers = 7,
    .kda_layers = 20,
    // 1-indexed lists: 0-indexed MLA layers are 3, 7, ..., 23, 26.
    .mla_at = {3, 7, 11, 15, 19, 23, 26},
    .kda_at = {0, 1, 2, 4, 25},
    .kda_dim = 4096,
    .mla_cache_width = 576,
    .expert_dim = 2304,
    .q_lora_rank = 0,
    .experts = 256,
    .experts_per_token = 8,
    .shared_experts = 1,
    .routed_scaling_factor = 2.446,
    .ext = {},
    .too_many_experts_per_token = 300,
    .large_preset = "kl48",
    .tiny_preset = "tiny",
    .tiny = {.vocab = 1024,
             .hidden = 64,
             .layers = 4,
             .intermediate = 128,
             .mla_1indexed = {2, 4},
             .kda_heads = 2,
             .kda_head_dim = 32,
             .conv = 4,
             .mla_heads = 2,
             .q_lora = 0,
             .kv_lora = 32,
             .nope = 16,
             .rope = 8,
             .v_head = 16,
             .experts = 8,
             .experts_per_token = 2,
             .latent = 0,
             .moe_intermediate = 32,
             .shared = 1,
             .attn_res_block_size = 0,
             .gate_lower_bound = 0,
             .situ_beta = 1.0,
             .situ_linear_beta = 0},
};

const ConfigCase kK3{
    .name = "K3",
    .released = released_k3,
    .variant = ModelVariant::kKimiK3,
    .model_type = "kimi_k3",
    .nested = true,
    .tensor_prefix = "language_model.",
    .layers = 93,
    .mla_layers = 24,
    .kda_layers = 69,
    .mla_at = {3, 7, 87, 91, 92},
    .kda_at = {0, 1, 2, 4, 90},
    .kda_dim = 12288,
    .mla_cache_width = 576,
    .expert_dim = 3584,
    .q_lora_rank = 1536,
    .experts = 896,
    .experts_per_token = 16,
    .shared_experts = 2,
    .routed_scaling_factor = 1.0,
    .ext = {.any = true,
            .full_rank_gate = true,
            .bounded_decay = true,
            .gate_lower_bound = -5.0,
            .output_gate = true,
            .latent_size = 3584,
            .latent_norm = true,
            .situ = true,
            .situ_beta = 4.0,
            .situ_linear_beta = 25.0,
            .attn_res_block_size = 12,
            .experts_mxfp4 = true},
    .too_many_experts_per_token = 1000,
    .large_preset = "k3-slice",
    .tiny_preset = "k3-tiny",
    .tiny = {.vocab = 1024,
             .hidden = 64,
             .layers = 6,
             .intermediate = 128,
             .mla_1indexed = {4, 6},
             .kda_heads = 2,
             .kda_head_dim = 32,
             .conv = 4,
             .mla_heads = 2,
             .q_lora = 48,
             .kv_lora = 32,
             .nope = 16,
             .rope = 8,
             .v_head = 16,
             .experts = 8,
             .experts_per_token = 2,
             .latent = 64,  // every MXFP4 expert row holds 2 scale groups
             .moe_intermediate = 64,
             .shared = 2,
             .attn_res_block_size = 2,
             .gate_lower_bound = -5.0,
             .situ_beta = 4.0,
             .situ_linear_beta = 25.0},
};

class ConfigTest : public ::testing::TestWithParam<ConfigCase> {};

// ---- Both variants ----

TEST_P(ConfigTest, ParsesTheReleasedConfig) {
  const ConfigCase& P = GetParam();
  ModelConfig c = parse_config(P.released());
  EXPECT_EQ(c.variant, P.variant);
  EXPECT_EQ(c.tensor_prefix, P.tensor_prefix);
  EXPECT_EQ(c.num_layers, P.layers);
  EXPECT_EQ(c.num_mla_layers(), P.mla_layers);
  EXPECT_EQ(c.num_kda_layers(), P.kda_layers);
  ASSERT_EQ(int(c.attn_kind.size()), P.layers);
  ASSERT_EQ(int(c.ffn_kind.size()), P.layers);
  for (int l : P.mla_at) EXPECT_EQ(c.attn_kind[l], AttnKind::MLA) << l;
  for (int l : P.kda_at) EXPECT_EQ(c.attn_kind[l], AttnKind::KDA) << l;
  EXPECT_EQ(c.ffn_kind[0], FfnKind::Dense);
  for (int l = 1; l < P.layers; ++l) EXPECT_EQ(c.ffn_kind[l], FfnKind::MoE) << l;
  EXPECT_EQ(c.kda_dim(), P.kda_dim);
  EXPECT_EQ(c.mla_cache_width(), P.mla_cache_width);
  EXPECT_EQ(c.expert_dim(), P.expert_dim);
  EXPECT_EQ(c.q_lora_rank, P.q_lora_rank);
  EXPECT_EQ(c.num_experts, P.experts);
  EXPECT_EQ(c.num_experts_per_token, P.experts_per_token);
  EXPECT_EQ(c.num_shared_experts, P.shared_experts);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, P.routed_scaling_factor);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{163586});
  EXPECT_DOUBLE_EQ(c.latent_norm_eps, 1e-6);
  // The K3 extensions: the released values for K3, all off for Kimi Linear.
  const Extensions& x = P.ext;
  EXPECT_EQ(c.has_k3_extensions(), x.any);
  EXPECT_EQ(c.kda_full_rank_gate, x.full_rank_gate);
  EXPECT_EQ(c.kda_bounded_decay, x.bounded_decay);
  EXPECT_DOUBLE_EQ(c.kda_gate_lower_bound, x.gate_lower_bound);
  EXPECT_EQ(c.mla_output_gate, x.output_gate);
  EXPECT_EQ(c.latent_size, x.latent_size);
  EXPECT_EQ(c.latent_norm, x.latent_norm);
  EXPECT_EQ(c.uses_situ(), x.situ);
  EXPECT_DOUBLE_EQ(c.situ_beta, x.situ_beta);
  EXPECT_DOUBLE_EQ(c.situ_linear_beta, x.situ_linear_beta);
  EXPECT_EQ(c.attn_res_block_size, x.attn_res_block_size);
  EXPECT_EQ(c.experts_mxfp4, x.experts_mxfp4);
}

TEST_P(ConfigTest, RoundTripsThroughJson) {
  const ConfigCase& P = GetParam();
  int presets = 0;
  for (const std::string& name : preset_names()) {
    ModelConfig a = preset_config(name);
    if (a.variant != P.variant) continue;
    ++presets;
    json j = config_to_json(a);
    EXPECT_EQ(j["model_type"], P.model_type) << name;
    EXPECT_EQ(j.contains("text_config"), P.nested) << name;
    EXPECT_EQ(P.text(j)["model_type"], "kimi_linear") << name;
    ModelConfig b = parse_config(j);
    EXPECT_EQ(config_to_json(b), j) << name;
    EXPECT_EQ(a.variant, b.variant) << name;
    EXPECT_EQ(a.attn_kind, b.attn_kind) << name;
    EXPECT_EQ(a.ffn_kind, b.ffn_kind) << name;
    EXPECT_EQ(a.hidden_size, b.hidden_size) << name;
    EXPECT_EQ(a.num_experts, b.num_experts) << name;
    EXPECT_EQ(a.eos_token_ids, b.eos_token_ids) << name;
    EXPECT_EQ(a.tensor_prefix, b.tensor_prefix) << name;
    EXPECT_EQ(a.latent_size, b.latent_size) << name;
    EXPECT_EQ(a.attn_res_block_size, b.attn_res_block_size) << name;
    EXPECT_EQ(a.experts_mxfp4, b.experts_mxfp4) << name;
    EXPECT_EQ(a.q_lora_rank, b.q_lora_rank) << name;
    EXPECT_DOUBLE_EQ(a.kda_gate_lower_bound, b.kda_gate_lower_bound) << name;
    EXPECT_DOUBLE_EQ(a.situ_linear_beta, b.situ_linear_beta) << name;
  }
  EXPECT_GE(presets, 3);  // tiny, small, kl48(-e32) / k3-tiny, k3-small, k3-slice
  // The released file parses to the same description after a round trip.
  ModelConfig c = parse_config(P.released());
  ModelConfig d = parse_config(config_to_json(c));
  EXPECT_EQ(config_to_json(c), config_to_json(d));
}

TEST_P(ConfigTest, SerialisesTheK3FieldsOnlyForK3) {
  // A Kimi Linear config serialises without any K3 field (what make-model wrote before); a K3
  // one writes them under text_config.
  const ConfigCase& P = GetParam();
  ModelConfig c = preset_config(P.large_preset);
  EXPECT_EQ(c.has_k3_extensions(), P.ext.any);
  EXPECT_EQ(c.expert_dim(), P.ext.any ? c.latent_size : c.hidden_size);
  json j = config_to_json(c);
  EXPECT_EQ(j.contains("text_config"), P.nested);
  json& t = P.text(j);
  for (const char* k : {"attn_res_block_size", "routed_expert_hidden_size", "quantization_config",
                        "mla_use_output_gate", "activation_situ_beta"})
    EXPECT_EQ(t.contains(k), P.ext.any) << k;
  EXPECT_FALSE(t.contains("text_config"));
  EXPECT_EQ(t["linear_attn_config"].contains("gate_lower_bound"), P.ext.any);
}

TEST_P(ConfigTest, TinyPresetIsTheGoldenGeometry) {
  const ConfigCase& P = GetParam();
  const Geometry& g = P.tiny;
  ModelConfig c = preset_config(P.tiny_preset);
  EXPECT_EQ(c.variant, P.variant);
  EXPECT_EQ(c.vocab_size, g.vocab);
  EXPECT_EQ(c.hidden_size, g.hidden);
  EXPECT_EQ(c.num_layers, g.layers);
  std::vector<FfnKind> ffn(size_t(g.layers), FfnKind::MoE);
  ffn[0] = FfnKind::Dense;
  EXPECT_EQ(c.ffn_kind, ffn);
  EXPECT_EQ(c.intermediate_size, g.intermediate);
  std::vector<AttnKind> attn(size_t(g.layers), AttnKind::KDA);
  for (int l : g.mla_1indexed) attn[size_t(l - 1)] = AttnKind::MLA;
  EXPECT_EQ(c.attn_kind, attn);
  EXPECT_EQ(c.kda_num_heads, g.kda_heads);
  EXPECT_EQ(c.kda_head_dim, g.kda_head_dim);
  EXPECT_EQ(c.kda_conv_size, g.conv);
  EXPECT_EQ(c.mla_num_heads, g.mla_heads);
  EXPECT_EQ(c.q_lora_rank, g.q_lora);
  EXPECT_EQ(c.kv_lora_rank, g.kv_lora);
  EXPECT_EQ(c.qk_nope_head_dim, g.nope);
  EXPECT_EQ(c.qk_rope_head_dim, g.rope);
  EXPECT_EQ(c.v_head_dim, g.v_head);
  EXPECT_EQ(c.num_experts, g.experts);
  EXPECT_EQ(c.num_experts_per_token, g.experts_per_token);
  EXPECT_EQ(c.latent_size, g.latent);
  EXPECT_EQ(c.moe_intermediate_size, g.moe_intermediate);
  EXPECT_EQ(c.num_shared_experts, g.shared);
  EXPECT_EQ(c.attn_res_block_size, g.attn_res_block_size);
  EXPECT_DOUBLE_EQ(c.kda_gate_lower_bound, g.gate_lower_bound);
  EXPECT_DOUBLE_EQ(c.situ_beta, g.situ_beta);
  EXPECT_DOUBLE_EQ(c.situ_linear_beta, g.situ_linear_beta);
  // ... and the committed golden model's config.json describes the same model.
  ModelConfig golden =
      load_config_file(test::data_dir() + "/data/golden/" + P.tiny_preset + "/config.json");
  EXPECT_EQ(config_to_json(golden), config_to_json(c));
}

TEST_P(ConfigTest, ParsesTextNamingTheSource) {
  const ConfigCase& P = GetParam();
  EXPECT_EQ(parse_config_text(P.released().dump()).num_layers, P.layers);
  auto text_error = [](const std::string& text) {
    try {
      parse_config_text(text, "my/config.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_THAT(text_error("{"), HasSubstr("my/config.json: invalid JSON"));
  EXPECT_THAT(text_error("{}"), HasSubstr("my/config.json: config.json: unsupported model_type"));
  // Copying or printing a json value recurses per level: deep documents are refused up front.
  json j = P.released();
  j["extra"] = json::parse(std::string(100, '[') + std::string(100, ']'));
  EXPECT_THAT(text_error(j.dump()), HasSubstr("nested deeper than 64 levels"));
}

TEST_P(ConfigTest, UnknownArchitectureIsNamed) {
  json j = GetParam().released();
  j["model_type"] = "llama";
  EXPECT_THAT(error_of(j), HasSubstr("unsupported model_type 'llama'"));
}

TEST_P(ConfigTest, MissingFieldIsNamed) {
  const ConfigCase& P = GetParam();
  for (const char* f : {"hidden_size", "vocab_size", "kv_lora_rank", "num_experts",
                        "linear_attn_config", "rms_norm_eps", "num_hidden_layers"}) {
    json j = P.released();
    P.text(j).erase(f);
    EXPECT_THAT(error_of(j), HasSubstr("missing field '" + P.path() + f + "'")) << f;
  }
  json j = P.released();
  P.text(j)["linear_attn_config"].erase("head_dim");
  EXPECT_THAT(error_of(j),
              HasSubstr("missing field '" + P.path() + "linear_attn_config.head_dim'"));
}

TEST_P(ConfigTest, MistypedFieldIsNamed) {
  const ConfigCase& P = GetParam();
  const std::string p = P.path();
  json j = P.released();
  P.text(j)["hidden_size"] = "2304";
  EXPECT_THAT(error_of(j), HasSubstr("'" + p + "hidden_size' must be an integer"));
  j = P.released();
  P.text(j)["moe_renormalize"] = 1;
  EXPECT_THAT(error_of(j), HasSubstr("'" + p + "moe_renormalize' must be true or false"));
  j = P.released();
  P.text(j)["linear_attn_config"]["kda_layers"] = "1,2";
  EXPECT_THAT(error_of(j), HasSubstr("kda_layers' must be a list"));
}

TEST_P(ConfigTest, InconsistentValuesAreNamed) {
  const ConfigCase& P = GetParam();
  const std::string p = P.path();
  auto with = [&](const std::function<void(json&)>& edit) {
    json j = P.released();
    edit(P.text(j));
    return error_of(j);
  };
  EXPECT_THAT(with([](json& t) { t["linear_attn_config"]["full_attn_layers"].push_back(1); }),
              HasSubstr("layer 1 (1-indexed) appears twice"));  // also a KDA layer
  // 0-indexed by mistake:
  EXPECT_THAT(with([](json& t) {
                t["linear_attn_config"]["full_attn_layers"] = {0, 4};
              }),
              HasSubstr("entry 0 is outside 1.." + std::to_string(P.layers)));
  EXPECT_THAT(with([](json& t) { t["linear_attn_config"]["kda_layers"].erase(0); }),
              HasSubstr("layer 1 (1-indexed) is in neither"));
  const int k = P.too_many_experts_per_token;
  EXPECT_THAT(with([k](json& t) { t["num_experts_per_token"] = k; }),
              HasSubstr("num_experts_per_token (" + std::to_string(k) + ") exceeds num_experts (" +
                        std::to_string(P.experts) + ")"));
  EXPECT_THAT(with([](json& t) { t["hidden_size"] = 0; }),
              HasSubstr("'" + p + "hidden_size' must be in [1,"));
  EXPECT_THAT(with([](json& t) { t["rms_norm_eps"] = -1; }), HasSubstr("rms_norm_eps"));
  EXPECT_THAT(with([](json& t) { t["num_key_value_heads"] = 8; }),
              HasSubstr("num_key_value_heads (8) must equal"));
  EXPECT_THAT(with([](json& t) { t["num_expert_group"] = 3; }),
              HasSubstr("not divisible by num_expert_group"));
  EXPECT_THAT(with([](json& t) { t["eos_token_id"] = 999999; }),
              HasSubstr("eos_token_id 999999 is outside the vocabulary"));
  EXPECT_THAT(with([](json& t) { t["mla_use_nope"] = false; }), HasSubstr("mla_use_nope"));
  EXPECT_THAT(with([](json& t) { t["moe_router_activation_func"] = "softmax"; }),
              HasSubstr("moe_router_activation_func 'softmax'"));
  EXPECT_THAT(with([](json& t) { t["q_lora_rank"] = -3; }),
              HasSubstr("'" + p + "q_lora_rank' must be null or positive"));
  EXPECT_THAT(with([](json& t) { t["hidden_act"] = "gelu"; }),
              HasSubstr("unsupported " + p + "hidden_act 'gelu'"));
  EXPECT_THAT(error_of(json::array()), HasSubstr("must be a JSON object"));
}

TEST_P(ConfigTest, FirstKDenseAndFrequency) {
  const ConfigCase& P = GetParam();
  json j = P.released();
  P.text(j)["first_k_dense_replace"] = 3;
  ModelConfig c = parse_config(j);
  EXPECT_EQ(c.ffn_kind[2], FfnKind::Dense);
  EXPECT_EQ(c.ffn_kind[3], FfnKind::MoE);
  P.text(j)["first_k_dense_replace"] = P.layers + 1;
  EXPECT_THAT(error_of(j),
              HasSubstr("first_k_dense_replace (" + std::to_string(P.layers + 1) + ")"));
}

INSTANTIATE_TEST_SUITE_P(Variants, ConfigTest, ::testing::Values(kKimiLinear, kK3),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- Either variant: presets ----

TEST(Config, UnknownPresetIsNamed) {
  try {
    preset_config("huge");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("unknown preset 'huge'"));
  }
}

// ---- Kimi K3 only: the kimi_k3 wrapper, its extension fields, its quantization_config ----

TEST(ConfigK3, SmallPresetHasSeveralResidualBlocks) {
  ModelConfig s = preset_config("k3-small");
  EXPECT_LT(s.attn_res_block_size, s.num_layers);
}

TEST(ConfigK3, ErrorsNameTheField) {
  // (The fields K3 shares with Kimi Linear are named with their text_config. path by the shared
  // suite above.)
  auto with = [](const std::function<void(json&)>& edit) {
    json j = released_k3();
    edit(j);
    return error_of(j);
  };
  EXPECT_THAT(with([](json& j) { j.erase("text_config"); }),
              HasSubstr("missing field 'text_config'"));
  EXPECT_THAT(with([](json& j) { j["text_config"] = 3; }),
              HasSubstr("'text_config' must be an object"));
  EXPECT_THAT(with([](json& j) { j["text_config"]["model_type"] = "deepseek_v3"; }),
              HasSubstr("text_config.model_type 'deepseek_v3'"));
  EXPECT_THAT(with([](json& j) { j["text_config"]["linear_attn_config"]["gate_lower_bound"] = 1; }),
              HasSubstr("'text_config.linear_attn_config.gate_lower_bound' must be negative"));
  EXPECT_THAT(
      with([](json& j) { j["text_config"]["linear_attn_config"]["gate_lower_bound"] = "low"; }),
      HasSubstr("'text_config.linear_attn_config.gate_lower_bound' must be a number"));
  EXPECT_THAT(
      with([](json& j) { j["text_config"]["linear_attn_config"]["use_full_rank_gate"] = 1; }),
      HasSubstr("'text_config.linear_attn_config.use_full_rank_gate' must be true or false"));
  EXPECT_THAT(with([](json& j) { j["text_config"]["mla_use_output_gate"] = "yes"; }),
              HasSubstr("'text_config.mla_use_output_gate' must be true or false"));
  EXPECT_THAT(with([](json& j) { j["text_config"]["routed_expert_hidden_size"] = 0; }),
              HasSubstr("'text_config.routed_expert_hidden_size' must be in [1,"));
  EXPECT_THAT(with([](json& j) {
                j["text_config"]["routed_expert_hidden_size"] = nullptr;
                j["text_config"].erase("quantization_config");
              }),
              HasSubstr("text_config.latent_moe_use_norm is true but routed_expert_hidden_size"));
  EXPECT_THAT(with([](json& j) { j["text_config"]["activation_situ_beta"] = -4; }),
              HasSubstr("'text_config.activation_situ_beta' must be a positive number"));
  EXPECT_THAT(with([](json& j) { j["text_config"]["activation_situ_linear_beta"] = "x"; }),
              HasSubstr("'text_config.activation_situ_linear_beta' must be a number"));
  EXPECT_THAT(with([](json& j) { j["text_config"]["attn_res_block_size"] = 0; }),
              HasSubstr("'text_config.attn_res_block_size' must be in [1,"));
  EXPECT_THAT(with([](json& j) { j["text_config"]["attn_res_block_size"] = 1.5; }),
              HasSubstr("'text_config.attn_res_block_size' must be an integer"));
}

TEST(ConfigK3, QuantizationConfigIsValidated) {
  const std::string q = "text_config.quantization_config.";
  auto with = [](const std::function<void(json&)>& edit) {
    json j = released_k3();
    edit(j["text_config"]["quantization_config"]);
    return error_of(j);
  };
  EXPECT_THAT(with([](json& q) { q["quant_method"] = "gptq"; }),
              HasSubstr("unsupported " + q + "quant_method 'gptq'"));
  EXPECT_THAT(with([](json& q) { q["format"] = "nvfp4-pack-quantized"; }),
              HasSubstr(q + "format 'nvfp4-pack-quantized'"));
  EXPECT_THAT(with([](json& q) { q["config_groups"]["group_0"]["weights"]["group_size"] = 16; }),
              HasSubstr("'" + q + "config_groups.group_0.weights.group_size' must be 32"));
  EXPECT_THAT(with([](json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 8; }),
              HasSubstr("'" + q + "config_groups.group_0.weights.num_bits' must be 4"));
  EXPECT_THAT(with([](json& q) { q["config_groups"]["group_0"]["weights"]["type"] = "int"; }),
              HasSubstr("'" + q + "config_groups.group_0.weights.type' must be \"float\""));
  EXPECT_THAT(with([](json& q) { q["config_groups"]["group_0"]["weights"]["dynamic"] = true; }),
              HasSubstr(q + "config_groups.group_0.weights.dynamic' must be false"));
  EXPECT_THAT(with([](json& q) {
                q["config_groups"]["group_0"]["input_activations"] = {{"num_bits", 8}};
              }),
              HasSubstr(q + "config_groups.group_0.input_activations is set"));
  EXPECT_THAT(with([](json& q) { q["config_groups"]["group_0"]["targets"] = {"Embedding"}; }),
              HasSubstr("'" + q + "config_groups.group_0.targets' must be [\"Linear\"]"));
  EXPECT_THAT(with([](json& q) { q.erase("config_groups"); }),
              HasSubstr("missing field '" + q + "config_groups'"));
  // MXFP4 may cover any linear (those the checkpoint packs: model/binder.h): a shorter ignore
  // list is valid, and one naming the experts leaves them bf16.
  {
    json j = released_k3();
    j["text_config"]["quantization_config"]["ignore"] = {"re:.*self_attn.*"};
    const ModelConfig c = parse_config(j);
    EXPECT_EQ(c.linear_quant, WeightQuant::kMxfp4);
    EXPECT_EQ(c.quant_group, 32);
    EXPECT_TRUE(c.experts_mxfp4);
    j["text_config"]["quantization_config"]["ignore"].push_back("re:.*experts.*");
    EXPECT_FALSE(parse_config(j).experts_mxfp4);
  }
  EXPECT_THAT(with([](json& q) { q["ignore"].push_back("re:(unclosed"); }),
              HasSubstr(q + "ignore' holds an invalid regular expression 're:(unclosed'"));
  EXPECT_THAT(with([](json& q) { q["ignore"] = "all"; }),
              HasSubstr("'" + q + "ignore' must be a list of strings"));
  EXPECT_THAT(with([](json& q) { q["quantization_status"] = "frozen"; }),
              HasSubstr(q + "quantization_status 'frozen'"));
  // Without quantization_config the experts are plain bf16.
  json j = released_k3();
  j["text_config"].erase("quantization_config");
  EXPECT_FALSE(parse_config(j).experts_mxfp4);
}

TEST(ConfigK3, TopLevelTokenIdsFillTheTextConfig) {
  json j = released_k3();
  j["text_config"].erase("eos_token_id");
  j["text_config"].erase("bos_token_id");
  j["eos_token_id"] = 163585;
  ModelConfig c = parse_config(j);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{163585});
  EXPECT_EQ(c.bos_token_id, 163584);
}

}  // namespace
}  // namespace md
