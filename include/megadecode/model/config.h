// The typed model description: everything in config.json that changes the math.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include "megadecode/base/dtype.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace md {

enum class AttnKind : uint8_t { KDA, MLA };
enum class FfnKind : uint8_t { Dense, MoE };
// Which official model a config describes (config.json's model_type). Everything that differs
// between the variants keys off this or off the extension fields below, never off strings
// (engine/numerics.h derives the numeric policy from it).
enum class ModelVariant : uint8_t { kKimiLinear, kKimiK3 };
std::string_view model_type_name(ModelVariant v);  // "kimi_linear" | "kimi_k3"
// The gated MLP's activation (hidden_act).
enum class Activation : uint8_t { kSilu, kSitu };

// Kimi Linear and Kimi K3 are one family: K3 is a kimi_linear config (its `text_config`) with the
// extensions below switched on. Every extension is off (0 / false / empty) for Kimi Linear, so the
// same description, loader and forward path serve both.
struct ModelConfig {
  ModelVariant variant = ModelVariant::kKimiLinear;  // the top-level model_type of the file
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int num_layers = 0;
  double rms_norm_eps = 0;
  bool tie_word_embeddings = false;
  Activation activation = Activation::kSilu;  // hidden_act: "silu", or "situ" (K3)
  std::vector<AttnKind> attn_kind;            // per layer, 0-indexed
  std::vector<FfnKind> ffn_kind;              // per layer

  // Kimi Delta Attention (linear_attn_config).
  int kda_num_heads = 0;
  int kda_head_dim = 0;
  int kda_conv_size = 0;  // short_conv_kernel_size

  // Multi-head latent attention (NoPE).
  int mla_num_heads = 0;
  int q_lora_rank = 0;  // 0: plain q_proj
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  // kv_a_layernorm (and q_a_layernorm) epsilon. The reference (transformers kimi_linear) builds
  // these norms with its default eps 1e-6, not rms_norm_eps; see docs/architecture.md "Numerics".
  double latent_norm_eps = 1e-6;

  // FFN.
  int64_t intermediate_size = 0;      // dense layers
  int64_t moe_intermediate_size = 0;  // each routed expert
  int num_experts = 0;
  int num_experts_per_token = 0;
  int num_shared_experts = 0;
  // The shared experts' channels (0: moe_intermediate_size x num_shared_experts, as in every
  // config.json; a distributed rank's config holds its slice, dist/shard.h).
  int64_t shared_intermediate_size = 0;
  int num_expert_group = 1;
  int topk_group = 1;
  bool moe_renormalize = true;
  double routed_scaling_factor = 1.0;
  // The original remote code took the expert weights from the bias-corrected scores; every other
  // implementation uses the unbiased sigmoid scores. false = unbiased (default).
  bool router_biased_weights = false;

  // ---- Kimi K3 extensions ----
  // Tensor names: "" (model.*, lm_head.weight) or "language_model." (K3: language_model.model.*,
  // language_model.lm_head.weight; other top-level modules such as vision_tower are ignored).
  std::string tensor_prefix;
  bool kda_full_rank_gate = false;  // linear_attn_config.use_full_rank_gate: g_proj [C, D]
  bool kda_bounded_decay = false;   // linear_attn_config.gate_lower_bound is set:
  double kda_gate_lower_bound = 0;  //   g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)), lb < 0
  bool mla_output_gate = false;     // mla_use_output_gate: o *= sigmoid(g_proj x) before o_proj
  int64_t latent_size = 0;          // routed_expert_hidden_size: routed experts run in this latent
  bool latent_norm = false;         // latent_moe_use_norm: RMSNorm of the routed sum (latent)
  double situ_beta = 1.0;           // hidden_act "situ": b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2)
  double situ_linear_beta = 0;      //   (0: no soft cap on u)
  int attn_res_block_size = 0;      // block attention residuals (0: the plain residual stream)
  bool experts_mxfp4 = false;       // routed experts MXFP4 (compressed-tensors, group 32)
  // A compressed-tensors checkpoint's quantized linear layers (model/binder.h decides per module,
  // by `quant_ignore`). kNone: none. kInt4 / kInt8: pack-quantized (W4A16 / W8A16, symmetric;
  // weight_packed / weight_scale / weight_shape), `quant_group` columns per scale (0: one per
  // row, the "channel" strategy), every linear not ignored must be packed. kMxfp4:
  // mxfp4-pack-quantized (weight_packed / weight_scale U8, group 32): the linears not ignored
  // whose weight_packed the checkpoint holds (K3's release: the routed experts, experts_mxfp4).
  WeightQuant linear_quant = WeightQuant::kNone;
  int quant_group = 0;
  // pack-quantized int4 with zero points (`symmetric: false`, the AWQ layout): weight_zero_point
  // per row and group (model/binder.h).
  bool quant_asymmetric = false;
  // pack-quantized with activation-ordered groups (`actorder: "group"`, GPTQ's desc_act):
  // weight_g_idx [cols] names each column's group (model/binder.h).
  bool quant_actorder = false;
  // kFp8 (quant_method "fp8", DeepSeek-style, or compressed-tensors float-quantized): the linears
  // whose `.weight` is F8_E4M3 (and `quant_ignore` does not name), with their scale tensor
  // `quant_scale_name` ("weight_scale_inv" / "weight_scale") per block of quant_block_rows rows
  // (1: per row; 0: all rows) by quant_group columns (0: the whole row).
  int quant_block_rows = 0;
  std::string quant_scale_name;
  std::vector<std::string> quant_ignore;  // quantization_config.ignore (names, "re:" patterns)

  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;
  int64_t pad_token_id = -1;

  int num_kda_layers() const;
  int num_mla_layers() const;
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t kda_dim() const { return int64_t(kda_num_heads) * kda_head_dim; }
  int64_t mla_cache_width() const {
    return kv_lora_rank + qk_rope_head_dim;
  }  // per token per layer
  // The width routed experts read and write: the latent for K3, else the hidden size.
  int64_t expert_dim() const { return latent_size > 0 ? latent_size : hidden_size; }
  int64_t shared_intermediate() const {
    return shared_intermediate_size > 0 ? shared_intermediate_size
                                        : moe_intermediate_size * num_shared_experts;
  }
  bool uses_situ() const { return activation == Activation::kSitu; }
  // The router's stored dtype in the official releases (Kimi Linear F32, K3 BF16): what
  // make-model writes and what a plan without weights assumes (both are accepted at load).
  DType released_router_dtype() const {
    return variant == ModelVariant::kKimiK3 ? DType::BF16 : DType::F32;
  }
  // True when any K3 extension is on (consumers that support only Kimi Linear reject these).
  bool has_k3_extensions() const;
};

// Parses a config.json document (model_type kimi_linear, or kimi_k3 with the language model under
// `text_config`). Throws md::Error naming the field on a missing, mistyped,
// unknown or inconsistent value.
ModelConfig parse_config(const nlohmann::json& j);
// The text of a config.json (JSON, then parse_config); errors start with `source` (a path or a
// description). load_config_file reads the file and calls this.
ModelConfig parse_config_text(std::string_view text, const std::string& source = "config.json");
ModelConfig load_config_file(const std::string& path);

// Whether a quantization_config `ignore` list excludes `module` (a name, "Linear", or a
// "re:" pattern matched from the start as Python's re.match does).
bool quant_ignored(const std::vector<std::string>& ignore, const std::string& module);

// Serialises to the official config.json schema (used by make-model).
nlohmann::json config_to_json(const ModelConfig& c);

}  // namespace md
