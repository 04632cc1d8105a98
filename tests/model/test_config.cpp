#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "megadecode/base/error.h"
#include "megadecode/model/config.h"
#include "megadecode/model/presets.h"

namespace md {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

// A config shaped like the released Kimi-Linear-48B-A3B one.
json released_config() {
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

std::string error_of(const json& j) {
  try {
    parse_config(j);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Config, ParsesReleasedKimiLinear) {
  ModelConfig c = parse_config(released_config());
  EXPECT_EQ(c.num_layers, 27);
  EXPECT_EQ(c.num_mla_layers(), 7);
  EXPECT_EQ(c.num_kda_layers(), 20);
  // 1-indexed lists: 0-indexed MLA layers are 3, 7, ..., 23, 26.
  for (int l : {3, 7, 11, 15, 19, 23, 26}) EXPECT_EQ(c.attn_kind[l], AttnKind::MLA) << l;
  for (int l : {0, 1, 2, 4, 25}) EXPECT_EQ(c.attn_kind[l], AttnKind::KDA) << l;
  EXPECT_EQ(c.ffn_kind[0], FfnKind::Dense);
  for (int l = 1; l < 27; ++l) EXPECT_EQ(c.ffn_kind[l], FfnKind::MoE);
  EXPECT_EQ(c.kda_dim(), 4096);
  EXPECT_EQ(c.mla_cache_width(), 576);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.446);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{163586});
  EXPECT_DOUBLE_EQ(c.latent_norm_eps, 1e-6);
}

TEST(Config, RoundTripsThroughJson) {
  for (const std::string& name : preset_names()) {
    ModelConfig a = preset_config(name);
    ModelConfig b = parse_config(config_to_json(a));
    EXPECT_EQ(a.attn_kind, b.attn_kind) << name;
    EXPECT_EQ(a.ffn_kind, b.ffn_kind) << name;
    EXPECT_EQ(a.hidden_size, b.hidden_size) << name;
    EXPECT_EQ(a.num_experts, b.num_experts) << name;
    EXPECT_EQ(a.eos_token_ids, b.eos_token_ids) << name;
  }
}

TEST(Config, ParsesTextNamingTheSource) {
  EXPECT_EQ(parse_config_text(released_config().dump()).num_layers, 27);
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
  json j = released_config();
  j["extra"] = json::parse(std::string(100, '[') + std::string(100, ']'));
  EXPECT_THAT(text_error(j.dump()), HasSubstr("nested deeper than 64 levels"));
}

TEST(Config, UnknownArchitectureIsNamed) {
  json j = released_config();
  j["model_type"] = "llama";
  EXPECT_THAT(error_of(j), HasSubstr("unsupported model_type 'llama'"));
}

TEST(Config, MissingFieldIsNamed) {
  for (const char* f : {"hidden_size", "vocab_size", "kv_lora_rank", "num_experts",
                        "linear_attn_config", "rms_norm_eps", "num_hidden_layers"}) {
    json j = released_config();
    j.erase(f);
    EXPECT_THAT(error_of(j), HasSubstr(std::string("missing field '") + f + "'")) << f;
  }
  json j = released_config();
  j["linear_attn_config"].erase("head_dim");
  EXPECT_THAT(error_of(j), HasSubstr("missing field 'linear_attn_config.head_dim'"));
}

TEST(Config, MistypedFieldIsNamed) {
  json j = released_config();
  j["hidden_size"] = "2304";
  EXPECT_THAT(error_of(j), HasSubstr("'hidden_size' must be an integer"));
  j = released_config();
  j["moe_renormalize"] = 1;
  EXPECT_THAT(error_of(j), HasSubstr("'moe_renormalize' must be true or false"));
  j = released_config();
  j["linear_attn_config"]["kda_layers"] = "1,2";
  EXPECT_THAT(error_of(j), HasSubstr("kda_layers' must be a list"));
}

TEST(Config, InconsistentValuesAreNamed) {
  json j = released_config();
  j["linear_attn_config"]["full_attn_layers"].push_back(1);  // also a KDA layer
  EXPECT_THAT(error_of(j), HasSubstr("layer 1 (1-indexed) appears twice"));
  j = released_config();
  j["linear_attn_config"]["full_attn_layers"] = json::array({0, 4});  // 0-indexed by mistake
  EXPECT_THAT(error_of(j), HasSubstr("entry 0 is outside 1..27"));
  j = released_config();
  j["linear_attn_config"]["kda_layers"].erase(0);
  EXPECT_THAT(error_of(j), HasSubstr("layer 1 (1-indexed) is in neither"));
  j = released_config();
  j["num_experts_per_token"] = 300;
  EXPECT_THAT(error_of(j), HasSubstr("num_experts_per_token (300) exceeds num_experts (256)"));
  j = released_config();
  j["hidden_size"] = 0;
  EXPECT_THAT(error_of(j), HasSubstr("'hidden_size' must be in [1,"));
  j = released_config();
  j["rms_norm_eps"] = -1;
  EXPECT_THAT(error_of(j), HasSubstr("rms_norm_eps"));
  j = released_config();
  j["num_key_value_heads"] = 8;
  EXPECT_THAT(error_of(j), HasSubstr("num_key_value_heads (8) must equal"));
  j = released_config();
  j["num_expert_group"] = 3;
  EXPECT_THAT(error_of(j), HasSubstr("not divisible by num_expert_group"));
  j = released_config();
  j["eos_token_id"] = 999999;
  EXPECT_THAT(error_of(j), HasSubstr("eos_token_id 999999 is outside the vocabulary"));
  j = released_config();
  j["mla_use_nope"] = false;
  EXPECT_THAT(error_of(j), HasSubstr("mla_use_nope"));
  j = released_config();
  j["moe_router_activation_func"] = "softmax";
  EXPECT_THAT(error_of(j), HasSubstr("moe_router_activation_func 'softmax'"));
  EXPECT_THAT(error_of(json::array()), HasSubstr("must be a JSON object"));
}

TEST(Config, FirstKDenseAndFrequency) {
  json j = released_config();
  j["first_k_dense_replace"] = 3;
  ModelConfig c = parse_config(j);
  EXPECT_EQ(c.ffn_kind[2], FfnKind::Dense);
  EXPECT_EQ(c.ffn_kind[3], FfnKind::MoE);
  j["first_k_dense_replace"] = 28;
  EXPECT_THAT(error_of(j), HasSubstr("first_k_dense_replace (28)"));
}

TEST(Config, UnknownPresetIsNamed) {
  try {
    preset_config("huge");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("unknown preset 'huge'"));
  }
}

}  // namespace
}  // namespace md
