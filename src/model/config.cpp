#include "megadecode/model/config.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "megadecode/base/error.h"

namespace md {

using nlohmann::json;

namespace {

// Field readers: a missing or mistyped field is an error that names it (with its JSON path).
const json& field(const json& j, const std::string& path, const char* key) {
  auto it = j.find(key);
  MD_CHECK(it != j.end() && !it->is_null(), "config.json: missing field '{}{}'", path, key);
  return *it;
}

int64_t get_int(const json& j, const std::string& path, const char* key) {
  const json& v = field(j, path, key);
  MD_CHECK(v.is_number_integer(), "config.json: field '{}{}' must be an integer, got {}", path,
           key, v.dump());
  return v.get<int64_t>();
}

int64_t get_int_or(const json& j, const std::string& path, const char* key, int64_t dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  return get_int(j, path, key);
}

double get_num(const json& j, const std::string& path, const char* key) {
  const json& v = field(j, path, key);
  MD_CHECK(v.is_number(), "config.json: field '{}{}' must be a number, got {}", path, key,
           v.dump());
  return v.get<double>();
}

double get_num_or(const json& j, const std::string& path, const char* key, double dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  return get_num(j, path, key);
}

bool get_bool_or(const json& j, const std::string& path, const char* key, bool dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  MD_CHECK(it->is_boolean(), "config.json: field '{}{}' must be true or false, got {}", path, key,
           it->dump());
  return it->get<bool>();
}

std::string get_str_or(const json& j, const std::string& path, const char* key,
                       const std::string& dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  MD_CHECK(it->is_string(), "config.json: field '{}{}' must be a string, got {}", path, key,
           it->dump());
  return it->get<std::string>();
}

int positive(int64_t v, const std::string& path, const char* key, int64_t max = 1 << 30) {
  MD_CHECK(v > 0 && v <= max, "config.json: field '{}{}' must be in [1, {}], got {}", path, key,
           max, v);
  return static_cast<int>(v);
}

std::vector<int64_t> get_int_list(const json& j, const std::string& path, const char* key) {
  const json& v = field(j, path, key);
  MD_CHECK(v.is_array(), "config.json: field '{}{}' must be a list of integers", path, key);
  std::vector<int64_t> out;
  for (const auto& e : v) {
    MD_CHECK(e.is_number_integer(), "config.json: field '{}{}' must be a list of integers, got {}",
             path, key, e.dump());
    out.push_back(e.get<int64_t>());
  }
  return out;
}

}  // namespace

int ModelConfig::num_kda_layers() const {
  return static_cast<int>(std::count(attn_kind.begin(), attn_kind.end(), AttnKind::KDA));
}
int ModelConfig::num_mla_layers() const {
  return static_cast<int>(std::count(attn_kind.begin(), attn_kind.end(), AttnKind::MLA));
}

ModelConfig parse_config(const json& root) {
  MD_CHECK(root.is_object(), "config.json: top level must be a JSON object");
  const std::string p;  // path prefix for messages
  ModelConfig c;
  c.model_type = get_str_or(root, p, "model_type", "");
  MD_CHECK(c.model_type == "kimi_linear",
           "config.json: unsupported model_type '{}' (supported: kimi_linear)", c.model_type);

  c.vocab_size = positive(get_int(root, p, "vocab_size"), p, "vocab_size");
  c.hidden_size = positive(get_int(root, p, "hidden_size"), p, "hidden_size", 1 << 20);
  c.num_layers = positive(get_int(root, p, "num_hidden_layers"), p, "num_hidden_layers", 4096);
  c.rms_norm_eps = get_num(root, p, "rms_norm_eps");
  MD_CHECK(c.rms_norm_eps > 0 && c.rms_norm_eps < 1,
           "config.json: field 'rms_norm_eps' must be in (0, 1), got {}", c.rms_norm_eps);
  c.tie_word_embeddings = get_bool_or(root, p, "tie_word_embeddings", false);
  c.hidden_act = get_str_or(root, p, "hidden_act", "silu");
  MD_CHECK(c.hidden_act == "silu", "config.json: unsupported hidden_act '{}' (supported: silu)",
           c.hidden_act);

  // Linear attention block. Layer lists are 1-indexed in the released config.
  const json& la = field(root, p, "linear_attn_config");
  MD_CHECK(la.is_object(), "config.json: field 'linear_attn_config' must be an object");
  const std::string lp = "linear_attn_config.";
  c.kda_num_heads = positive(get_int(la, lp, "num_heads"), lp, "num_heads", 4096);
  c.kda_head_dim = positive(get_int(la, lp, "head_dim"), lp, "head_dim", 4096);
  c.kda_conv_size = positive(get_int_or(la, lp, "short_conv_kernel_size", 4), lp,
                             "short_conv_kernel_size", 64);
  auto full = get_int_list(la, lp, "full_attn_layers");
  auto kda = get_int_list(la, lp, "kda_layers");
  c.attn_kind.assign(c.num_layers, AttnKind::KDA);
  std::vector<int> seen(c.num_layers, 0);
  for (auto [list, kind, name] : {std::tuple{&full, AttnKind::MLA, "full_attn_layers"},
                                  std::tuple{&kda, AttnKind::KDA, "kda_layers"}}) {
    for (int64_t l : *list) {
      MD_CHECK(l >= 1 && l <= c.num_layers,
               "config.json: linear_attn_config.{} entry {} is outside 1..{} (the lists are "
               "1-indexed)",
               name, l, c.num_layers);
      MD_CHECK(seen[l - 1] == 0,
               "config.json: layer {} (1-indexed) appears twice in linear_attn_config "
               "full_attn_layers/kda_layers",
               l);
      seen[l - 1] = 1;
      c.attn_kind[l - 1] = kind;
    }
  }
  for (int l = 0; l < c.num_layers; ++l)
    MD_CHECK(seen[l], "config.json: layer {} (1-indexed) is in neither full_attn_layers nor "
             "kda_layers", l + 1);

  // MLA.
  c.mla_num_heads = positive(get_int(root, p, "num_attention_heads"), p, "num_attention_heads",
                             4096);
  int64_t kvh = get_int_or(root, p, "num_key_value_heads", c.mla_num_heads);
  MD_CHECK(kvh == c.mla_num_heads,
           "config.json: num_key_value_heads ({}) must equal num_attention_heads ({}) for MLA",
           kvh, c.mla_num_heads);
  c.q_lora_rank = static_cast<int>(get_int_or(root, p, "q_lora_rank", 0));
  MD_CHECK(c.q_lora_rank >= 0, "config.json: field 'q_lora_rank' must be null or positive");
  c.kv_lora_rank = positive(get_int(root, p, "kv_lora_rank"), p, "kv_lora_rank", 1 << 16);
  c.qk_nope_head_dim = positive(get_int(root, p, "qk_nope_head_dim"), p, "qk_nope_head_dim", 4096);
  c.qk_rope_head_dim = positive(get_int(root, p, "qk_rope_head_dim"), p, "qk_rope_head_dim", 4096);
  c.v_head_dim = positive(get_int(root, p, "v_head_dim"), p, "v_head_dim", 4096);
  MD_CHECK(get_bool_or(root, p, "mla_use_nope", true),
           "config.json: mla_use_nope=false (rotary MLA) is not supported; Kimi Linear uses NoPE");

  // FFN / MoE.
  c.intermediate_size = positive(get_int(root, p, "intermediate_size"), p, "intermediate_size");
  int first_dense = static_cast<int>(get_int_or(root, p, "first_k_dense_replace", 1));
  MD_CHECK(first_dense >= 0 && first_dense <= c.num_layers,
           "config.json: first_k_dense_replace ({}) must be in 0..num_hidden_layers ({})",
           first_dense, c.num_layers);
  int64_t freq = get_int_or(root, p, "moe_layer_freq", 1);
  MD_CHECK(freq >= 1, "config.json: moe_layer_freq must be >= 1, got {}", freq);
  c.ffn_kind.assign(c.num_layers, FfnKind::Dense);
  bool any_moe = false;
  for (int l = first_dense; l < c.num_layers; ++l) {
    if ((l - first_dense) % freq == 0) {
      c.ffn_kind[l] = FfnKind::MoE;
      any_moe = true;
    }
  }
  if (any_moe) {
    c.num_experts = positive(get_int(root, p, "num_experts"), p, "num_experts", 1 << 16);
    c.num_experts_per_token =
        positive(get_int(root, p, "num_experts_per_token"), p, "num_experts_per_token", 1 << 16);
    MD_CHECK(c.num_experts_per_token <= c.num_experts,
             "config.json: num_experts_per_token ({}) exceeds num_experts ({})",
             c.num_experts_per_token, c.num_experts);
    c.moe_intermediate_size =
        positive(get_int(root, p, "moe_intermediate_size"), p, "moe_intermediate_size");
    c.num_shared_experts = static_cast<int>(get_int_or(root, p, "num_shared_experts", 0));
    MD_CHECK(c.num_shared_experts >= 0 && c.num_shared_experts <= 64,
             "config.json: num_shared_experts must be in 0..64, got {}", c.num_shared_experts);
    std::string act = get_str_or(root, p, "moe_router_activation_func", "sigmoid");
    MD_CHECK(act == "sigmoid",
             "config.json: unsupported moe_router_activation_func '{}' (supported: sigmoid)", act);
    c.moe_renormalize = get_bool_or(root, p, "moe_renormalize", true);
    c.routed_scaling_factor = get_num_or(root, p, "routed_scaling_factor", 1.0);
    MD_CHECK(c.routed_scaling_factor > 0, "config.json: routed_scaling_factor must be > 0");
    if (get_bool_or(root, p, "use_grouped_topk", false)) {
      c.num_expert_group = positive(get_int_or(root, p, "num_expert_group", 1), p,
                                    "num_expert_group", c.num_experts);
      c.topk_group = positive(get_int_or(root, p, "topk_group", 1), p, "topk_group",
                              c.num_expert_group);
      MD_CHECK(c.num_experts % c.num_expert_group == 0,
               "config.json: num_experts ({}) is not divisible by num_expert_group ({})",
               c.num_experts, c.num_expert_group);
      MD_CHECK(c.num_expert_group == 1 || c.num_experts / c.num_expert_group >= 2,
               "config.json: grouped top-k needs at least 2 experts per group");
      MD_CHECK(c.num_experts_per_token <= c.topk_group * (c.num_experts / c.num_expert_group),
               "config.json: num_experts_per_token ({}) exceeds the experts in topk_group groups",
               c.num_experts_per_token);
    }
  }

  c.bos_token_id = get_int_or(root, p, "bos_token_id", -1);
  c.pad_token_id = get_int_or(root, p, "pad_token_id", -1);
  if (auto it = root.find("eos_token_id"); it != root.end() && !it->is_null()) {
    if (it->is_array()) {
      c.eos_token_ids = get_int_list(root, p, "eos_token_id");
    } else {
      c.eos_token_ids.push_back(get_int(root, p, "eos_token_id"));
    }
  }
  for (int64_t id : c.eos_token_ids)
    MD_CHECK(id >= 0 && id < c.vocab_size, "config.json: eos_token_id {} is outside the vocabulary",
             id);
  MD_CHECK(c.bos_token_id < c.vocab_size, "config.json: bos_token_id {} is outside the vocabulary",
           c.bos_token_id);
  return c;
}

ModelConfig load_config_file(const std::string& path) {
  std::ifstream f(path);
  MD_CHECK(f.good(), "cannot open {}", path);
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
  try {
    return parse_config(j);
  } catch (const Error& e) {
    fail("{}: {}", path, e.what());
  }
}

json config_to_json(const ModelConfig& c) {
  json la;
  std::vector<int> full, kda;
  for (int l = 0; l < c.num_layers; ++l)
    (c.attn_kind[l] == AttnKind::MLA ? full : kda).push_back(l + 1);
  la["full_attn_layers"] = full;
  la["kda_layers"] = kda;
  la["num_heads"] = c.kda_num_heads;
  la["head_dim"] = c.kda_head_dim;
  la["short_conv_kernel_size"] = c.kda_conv_size;
  int first_dense = 0;
  while (first_dense < c.num_layers && c.ffn_kind[first_dense] == FfnKind::Dense) ++first_dense;
  json j = {
      {"architectures", {"KimiLinearForCausalLM"}},
      {"model_type", "kimi_linear"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.mla_num_heads},
      {"num_key_value_heads", c.mla_num_heads},
      {"hidden_act", c.hidden_act},
      {"rms_norm_eps", c.rms_norm_eps},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"linear_attn_config", la},
      {"q_lora_rank", c.q_lora_rank > 0 ? json(c.q_lora_rank) : json(nullptr)},
      {"kv_lora_rank", c.kv_lora_rank},
      {"qk_nope_head_dim", c.qk_nope_head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim},
      {"v_head_dim", c.v_head_dim},
      {"mla_use_nope", true},
      {"num_experts", c.num_experts},
      {"num_experts_per_token", c.num_experts_per_token},
      {"num_shared_experts", c.num_shared_experts},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"moe_router_activation_func", "sigmoid"},
      {"moe_renormalize", c.moe_renormalize},
      {"routed_scaling_factor", c.routed_scaling_factor},
      {"first_k_dense_replace", first_dense},
      {"moe_layer_freq", 1},
      {"use_grouped_topk", true},
      {"num_expert_group", c.num_expert_group},
      {"topk_group", c.topk_group},
      {"bos_token_id", c.bos_token_id},
      {"pad_token_id", c.pad_token_id},
      {"model_max_length", 1048576},
      {"torch_dtype", "bfloat16"},
  };
  if (c.eos_token_ids.size() == 1)
    j["eos_token_id"] = c.eos_token_ids[0];
  else
    j["eos_token_id"] = c.eos_token_ids;
  return j;
}

}  // namespace md
