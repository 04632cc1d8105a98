// Kimi K3 configs: the released kimi_k3 schema (a kimi_linear text_config with extensions), its
// validation, and serialisation back for make-model.
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

TEST(ConfigK3, ParsesTheReleasedConfig) {
  ModelConfig c = parse_config(released_k3());
  EXPECT_EQ(c.variant, ModelVariant::kKimiK3);
  EXPECT_EQ(c.tensor_prefix, "language_model.");
  EXPECT_EQ(c.num_layers, 93);
  EXPECT_EQ(c.num_mla_layers(), 24);
  EXPECT_EQ(c.num_kda_layers(), 69);
  for (int l : {3, 7, 87, 91, 92}) EXPECT_EQ(c.attn_kind[l], AttnKind::MLA) << l;
  EXPECT_EQ(c.ffn_kind[0], FfnKind::Dense);
  EXPECT_EQ(c.ffn_kind[92], FfnKind::MoE);
  EXPECT_TRUE(c.kda_full_rank_gate);
  EXPECT_TRUE(c.kda_bounded_decay);
  EXPECT_DOUBLE_EQ(c.kda_gate_lower_bound, -5.0);
  EXPECT_TRUE(c.mla_output_gate);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.latent_size, 3584);
  EXPECT_EQ(c.expert_dim(), 3584);
  EXPECT_TRUE(c.latent_norm);
  EXPECT_TRUE(c.uses_situ());
  EXPECT_DOUBLE_EQ(c.situ_beta, 4.0);
  EXPECT_DOUBLE_EQ(c.situ_linear_beta, 25.0);
  EXPECT_EQ(c.attn_res_block_size, 12);
  EXPECT_TRUE(c.experts_mxfp4);
  EXPECT_EQ(c.num_experts, 896);
  EXPECT_EQ(c.num_experts_per_token, 16);
  EXPECT_EQ(c.num_shared_experts, 2);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{163586});
  EXPECT_TRUE(c.has_k3_extensions());
}

TEST(ConfigK3, KimiLinearHasNoExtensions) {
  ModelConfig c = preset_config("kl48");
  EXPECT_FALSE(c.has_k3_extensions());
  EXPECT_EQ(c.expert_dim(), c.hidden_size);
  // A Kimi Linear config serialises without any K3 field (what make-model wrote before).
  json j = config_to_json(c);
  for (const char* k : {"attn_res_block_size", "routed_expert_hidden_size", "quantization_config",
                        "mla_use_output_gate", "activation_situ_beta", "text_config"})
    EXPECT_FALSE(j.contains(k)) << k;
  EXPECT_FALSE(j["linear_attn_config"].contains("gate_lower_bound"));
}

TEST(ConfigK3, RoundTripsThroughJson) {
  for (const char* name : {"k3-tiny", "k3-small", "k3-slice"}) {
    ModelConfig a = preset_config(name);
    json j = config_to_json(a);
    EXPECT_EQ(j["model_type"], "kimi_k3") << name;
    EXPECT_EQ(j["text_config"]["model_type"], "kimi_linear") << name;
    ModelConfig b = parse_config(j);
    EXPECT_EQ(config_to_json(b), j) << name;
    EXPECT_EQ(a.attn_kind, b.attn_kind) << name;
    EXPECT_EQ(a.ffn_kind, b.ffn_kind) << name;
    EXPECT_EQ(a.tensor_prefix, b.tensor_prefix) << name;
    EXPECT_EQ(a.latent_size, b.latent_size) << name;
    EXPECT_EQ(a.attn_res_block_size, b.attn_res_block_size) << name;
    EXPECT_EQ(a.experts_mxfp4, b.experts_mxfp4) << name;
    EXPECT_EQ(a.q_lora_rank, b.q_lora_rank) << name;
    EXPECT_DOUBLE_EQ(a.kda_gate_lower_bound, b.kda_gate_lower_bound) << name;
    EXPECT_DOUBLE_EQ(a.situ_linear_beta, b.situ_linear_beta) << name;
  }
  // The released file parses to the same description after a round trip.
  ModelConfig c = parse_config(released_k3());
  ModelConfig d = parse_config(config_to_json(c));
  EXPECT_EQ(config_to_json(c), config_to_json(d));
}

TEST(ConfigK3, TinyPresetIsTheGoldenGeometry) {
  ModelConfig c = preset_config("k3-tiny");
  EXPECT_EQ(c.vocab_size, 1024);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_layers, 6);
  EXPECT_EQ(c.ffn_kind[0], FfnKind::Dense);
  EXPECT_EQ(c.intermediate_size, 128);
  std::vector<AttnKind> attn(6, AttnKind::KDA);
  attn[3] = attn[5] = AttnKind::MLA;  // 1-indexed [4, 6]
  EXPECT_EQ(c.attn_kind, attn);
  EXPECT_EQ(c.kda_num_heads, 2);
  EXPECT_EQ(c.kda_head_dim, 32);
  EXPECT_EQ(c.kda_conv_size, 4);
  EXPECT_EQ(c.mla_num_heads, 2);
  EXPECT_EQ(c.q_lora_rank, 48);
  EXPECT_EQ(c.kv_lora_rank, 32);
  EXPECT_EQ(c.qk_nope_head_dim, 16);
  EXPECT_EQ(c.qk_rope_head_dim, 8);
  EXPECT_EQ(c.v_head_dim, 16);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_token, 2);
  EXPECT_EQ(c.latent_size, 64);  // every MXFP4 expert row holds 2 scale groups
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_EQ(c.num_shared_experts, 2);
  EXPECT_EQ(c.attn_res_block_size, 2);
  EXPECT_DOUBLE_EQ(c.kda_gate_lower_bound, -5.0);
  EXPECT_DOUBLE_EQ(c.situ_beta, 4.0);
  EXPECT_DOUBLE_EQ(c.situ_linear_beta, 25.0);
  ModelConfig s = preset_config("k3-small");
  EXPECT_LT(s.attn_res_block_size, s.num_layers);
}

TEST(ConfigK3, ErrorsNameTheField) {
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
  EXPECT_THAT(with([](json& j) { j["text_config"].erase("hidden_size"); }),
              HasSubstr("missing field 'text_config.hidden_size'"));
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
  EXPECT_THAT(with([](json& j) { j["text_config"]["q_lora_rank"] = -3; }),
              HasSubstr("'text_config.q_lora_rank' must be null or positive"));
  EXPECT_THAT(with([](json& j) { j["text_config"]["routed_expert_hidden_size"] = 0; }),
              HasSubstr("'text_config.routed_expert_hidden_size' must be in [1,"));
  EXPECT_THAT(with([](json& j) {
                j["text_config"]["routed_expert_hidden_size"] = nullptr;
                j["text_config"].erase("quantization_config");
              }),
              HasSubstr("text_config.latent_moe_use_norm is true but routed_expert_hidden_size"));
  EXPECT_THAT(with([](json& j) { j["text_config"]["hidden_act"] = "gelu"; }),
              HasSubstr("unsupported text_config.hidden_act 'gelu'"));
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
  EXPECT_THAT(with([](json& q) { q["ignore"] = {"re:.*self_attn.*"}; }),
              HasSubstr(q + "ignore does not exclude 'language_model.model.layers.1."
                            "block_sparse_moe.shared_experts.gate_proj'"));
  EXPECT_THAT(with([](json& q) { q["ignore"].push_back("re:.*experts.*"); }),
              HasSubstr(q + "ignore excludes the routed experts"));
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
