// The typed model description: everything in config.json that changes the math.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace md {

enum class AttnKind : uint8_t { KDA, MLA };
enum class FfnKind : uint8_t { Dense, MoE };

struct ModelConfig {
  std::string model_type;  // "kimi_linear"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int num_layers = 0;
  double rms_norm_eps = 0;
  bool tie_word_embeddings = false;
  std::string hidden_act;  // "silu"
  std::vector<AttnKind> attn_kind;  // per layer, 0-indexed
  std::vector<FfnKind> ffn_kind;    // per layer

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
  // these norms with its default eps 1e-6, not rms_norm_eps; see MODELS.md "where sources differ".
  double latent_norm_eps = 1e-6;

  // FFN.
  int64_t intermediate_size = 0;      // dense layers
  int64_t moe_intermediate_size = 0;  // each routed expert
  int num_experts = 0;
  int num_experts_per_token = 0;
  int num_shared_experts = 0;
  int num_expert_group = 1;
  int topk_group = 1;
  bool moe_renormalize = true;
  double routed_scaling_factor = 1.0;
  // The original remote code took the expert weights from the bias-corrected scores; every other
  // implementation uses the unbiased sigmoid scores. false = unbiased (default).
  bool router_biased_weights = false;

  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;
  int64_t pad_token_id = -1;

  int num_kda_layers() const;
  int num_mla_layers() const;
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t kda_dim() const { return int64_t(kda_num_heads) * kda_head_dim; }
  int64_t mla_cache_width() const { return kv_lora_rank + qk_rope_head_dim; }  // per token per layer
};

// Parses a config.json document. Throws md::Error naming the field on a missing, mistyped,
// unknown or inconsistent value.
ModelConfig parse_config(const nlohmann::json& j);
ModelConfig load_config_file(const std::string& path);

// Serialises to the official config.json schema (used by make-model).
nlohmann::json config_to_json(const ModelConfig& c);

}  // namespace md
