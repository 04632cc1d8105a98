// The DSpark draft's config.json: parsing, validation against a target, and the sizing rule of
// make-model --draft-for (spec/draft_config.h; docs/speculative.md).
#include "megadecode/model/draft_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "megadecode/base/error.h"
#include "megadecode/model/config.h"

namespace md {

using nlohmann::json;

namespace {

// Field readers naming the file and the JSON path of what is wrong.
struct Reader {
  const std::string& source;

  const json& field(const json& j, const std::string& path, const char* key) const {
    auto it = j.find(key);
    MD_CHECK(it != j.end() && !it->is_null(), "{}: missing field '{}{}'", source, path, key);
    return *it;
  }
  int64_t integer(const json& j, const std::string& path, const char* key, int64_t lo,
                  int64_t hi) const {
    const json& v = field(j, path, key);
    MD_CHECK(v.is_number_integer(), "{}: field '{}{}' must be an integer, got {}", source, path,
             key, v.dump());
    const int64_t x = v.get<int64_t>();
    MD_CHECK(x >= lo && x <= hi, "{}: field '{}{}' must be in [{}, {}], got {}", source, path, key,
             lo, hi, x);
    return x;
  }
  double positive_number(const json& j, const std::string& path, const char* key) const {
    const json& v = field(j, path, key);
    MD_CHECK(v.is_number(), "{}: field '{}{}' must be a number, got {}", source, path, key,
             v.dump());
    const double x = v.get<double>();
    MD_CHECK(std::isfinite(x) && x > 0, "{}: field '{}{}' must be a positive number, got {}",
             source, path, key, x);
    return x;
  }
};

constexpr int64_t kMaxDim = int64_t(1) << 24;

}  // namespace

DraftConfig parse_draft_config(const json& j, const std::string& source) {
  const Reader r{source};
  MD_CHECK(j.is_object(), "{}: the draft config must be a JSON object", source);
  const json& t = r.field(j, "", "transformer_layer_config");
  MD_CHECK(t.is_object(), "{}: field 'transformer_layer_config' must be an object", source);
  const std::string p = "transformer_layer_config.";
  DraftConfig c;
  c.hidden_size = r.integer(t, p, "hidden_size", 1, kMaxDim);
  c.num_layers = int(r.integer(t, p, "num_hidden_layers", 1, 1024));
  c.num_heads = int(r.integer(t, p, "num_attention_heads", 1, 4096));
  c.num_kv_heads = int(r.integer(t, p, "num_key_value_heads", 1, 4096));
  c.head_dim = int(r.integer(t, p, "head_dim", 2, 4096));
  c.intermediate_size = r.integer(t, p, "intermediate_size", 1, kMaxDim);
  c.vocab_size = r.integer(t, p, "vocab_size", 1, int64_t(1) << 31);
  c.window = int(r.integer(t, p, "sliding_window", 1, 1 << 24));
  c.rms_norm_eps = r.positive_number(t, p, "rms_norm_eps");
  // transformers >= 5 nests rope_theta in rope_parameters (the seed reads it there); older
  // serialisations keep it at the layer config's top level.
  auto rp = t.find("rope_parameters");
  if (rp != t.end() && !rp->is_null()) {
    MD_CHECK(rp->is_object(), "{}: field '{}rope_parameters' must be an object", source, p);
    auto type = rp->find("rope_type");
    MD_CHECK(type == rp->end() || type->is_null() || *type == "default",
             "{}: field '{}rope_parameters.rope_type' is {}: only the default (unscaled) neox "
             "RoPE is supported",
             source, p, type == rp->end() ? "" : type->dump());
    c.rope_theta = r.positive_number(*rp, p + "rope_parameters.", "rope_theta");
  } else {
    c.rope_theta = r.positive_number(t, p, "rope_theta");
  }
  auto act = t.find("hidden_act");
  MD_CHECK(act == t.end() || act->is_null() || *act == "silu",
           "{}: field '{}hidden_act' is {}: the draft's MLP is SiLU-gated", source, p,
           act == t.end() ? "" : act->dump());
  for (const char* flag : {"attention_bias", "tie_word_embeddings"}) {
    auto it = t.find(flag);
    MD_CHECK(it == t.end() || it->is_null() || *it == false,
             "{}: field '{}{}' is {}: not supported (the draft has no attention biases and its "
             "own lm_head)",
             source, p, flag, it == t.end() ? "" : it->dump());
  }
  MD_CHECK(c.head_dim % 2 == 0, "{}: field '{}head_dim' must be even for RoPE, got {}", source, p,
           c.head_dim);
  MD_CHECK(c.num_heads % c.num_kv_heads == 0,
           "{}: field '{}num_attention_heads' ({}) must be a multiple of num_key_value_heads ({})",
           source, p, c.num_heads, c.num_kv_heads);

  const json& ids = r.field(j, "", "aux_hidden_state_layer_ids");
  MD_CHECK(ids.is_array() && !ids.empty(),
           "{}: field 'aux_hidden_state_layer_ids' must be a non-empty list of layer ids, got {}",
           source, ids.dump());
  std::set<int> seen;
  for (const json& v : ids) {
    MD_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < (1 << 20),
             "{}: field 'aux_hidden_state_layer_ids' holds {}, not a layer id", source, v.dump());
    const int id = int(v.get<int64_t>());
    MD_CHECK(seen.insert(id).second, "{}: field 'aux_hidden_state_layer_ids' lists layer {} twice",
             source, id);
    c.aux_layer_ids.push_back(id);
  }
  MD_CHECK(c.context_width() <= (int64_t(1) << 28),
           "{}: {} aux layers x hidden {} is too wide for fc", source, ids.size(), c.hidden_size);
  c.mask_token_id = r.integer(j, "", "mask_token_id", 0, c.vocab_size - 1);
  c.markov_rank = int(r.integer(j, "", "markov_rank", 1, 1 << 16));
  return c;
}

DraftConfig load_draft_config_file(const std::string& path) {
  std::ifstream f(path);
  MD_CHECK(f.good(), "cannot read the draft config {}", path);
  std::stringstream ss;
  ss << f.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  MD_CHECK(!j.is_discarded(), "{}: not valid JSON", path);
  return parse_draft_config(j, path);
}

json draft_config_to_json(const DraftConfig& c) {
  json t = {
      {"model_type", "qwen3"},
      {"hidden_size", c.hidden_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"intermediate_size", c.intermediate_size},
      {"vocab_size", c.vocab_size},
      {"sliding_window", c.window},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"tie_word_embeddings", false},
  };
  return json{
      {"speculators_model_type", "dspark"},
      {"transformer_layer_config", t},
      {"aux_hidden_state_layer_ids", c.aux_layer_ids},
      {"mask_token_id", c.mask_token_id},
      {"markov_rank", c.markov_rank},
      {"block_size", kDraftBlockRows},
  };
}

void validate_draft_for_target(const DraftConfig& d, const ModelConfig& target,
                               const std::string& source) {
  MD_CHECK(d.hidden_size == target.hidden_size,
           "{}: hidden size {} does not match the target's {} (fc reads the target's hidden "
           "states and the draft's rows have the same width)",
           source, d.hidden_size, target.hidden_size);
  MD_CHECK(d.vocab_size == target.vocab_size,
           "{}: vocabulary {} does not match the target's {} (the draft proposes target tokens)",
           source, d.vocab_size, target.vocab_size);
  for (int id : d.aux_layer_ids)
    MD_CHECK(id >= 1 && id <= target.num_layers - 1,
             "{}: aux layer id {} is out of range for a target of {} layers (id L captures the "
             "residual stream entering layer L: 1 .. {})",
             source, id, target.num_layers, target.num_layers - 1);
}

std::vector<int> default_aux_layer_ids(int target_layers) {
  MD_CHECK(target_layers >= 2, "a draft needs a target of at least 2 layers, got {}",
           target_layers);
  // The seed's checkpoint reads Kimi K3 (93 layers) at 24, 48, 72, 88, 92: the last at the last
  // layer's input (L - 1), the others at the same fractions of the depth, rounded, made distinct
  // from the top down; a target too shallow for five distinct ids gets fewer.
  static constexpr double kSeedIds[] = {24, 48, 72, 88, 92};
  const int n = int(std::size(kSeedIds));
  std::vector<int> down;
  int next = target_layers - 1;
  for (int k = n - 1; k >= 0; --k) {
    const int id =
        k == n - 1 ? next : std::min(next, int(std::lround(kSeedIds[k] / 93.0 * target_layers)));
    if (id < 1) break;
    down.push_back(id);
    next = id - 1;
  }
  return std::vector<int>(down.rbegin(), down.rend());
}

DraftConfig draft_config_for_target(const ModelConfig& target, int layers,
                                    const std::vector<int>& aux_ids) {
  // The seed's draft for Kimi K3 (hidden 7168, 96 attention heads of 128, vocab 163840): 5
  // layers, hidden 7168, 96 query heads of 64, 16 KV heads, intermediate 14336, markov rank 256,
  // window 2048, theta 1e4, eps 1e-5, mask token 163837 (vocab - 3). The same ratios for any
  // target: query heads = the target's attention heads, head_dim = half the target's KDA head
  // dim, the largest divisor of the heads not above heads / 6 as KV heads, intermediate 2 x
  // hidden, markov rank hidden / 28 (a multiple of 8, 8 .. 256).
  DraftConfig d;
  d.hidden_size = target.hidden_size;
  d.vocab_size = target.vocab_size;
  d.num_layers = layers > 0 ? layers : 5;
  d.num_heads = std::max(1, target.mla_num_heads > 0 ? target.mla_num_heads : target.kda_num_heads);
  d.num_kv_heads = 1;
  for (int k = 1; k <= d.num_heads / 6; ++k)
    if (d.num_heads % k == 0) d.num_kv_heads = k;
  d.head_dim = std::max(8, (target.kda_head_dim / 2) / 2 * 2);
  d.intermediate_size = 2 * target.hidden_size;
  d.markov_rank = int(std::clamp<int64_t>(target.hidden_size / 28 / 8 * 8, 8, 256));
  d.window = 2048;
  d.rope_theta = 1e4;
  d.rms_norm_eps = target.rms_norm_eps > 0 ? target.rms_norm_eps : 1e-5;
  d.mask_token_id = target.vocab_size - 3;
  d.aux_layer_ids = aux_ids.empty() ? default_aux_layer_ids(target.num_layers) : aux_ids;
  MD_CHECK(d.mask_token_id >= 0, "the target's vocabulary ({}) is too small for a draft",
           target.vocab_size);
  validate_draft_for_target(d, target, "--aux-layers");
  std::set<int> seen(d.aux_layer_ids.begin(), d.aux_layer_ids.end());
  MD_CHECK(seen.size() == d.aux_layer_ids.size(), "--aux-layers: a layer id is listed twice");
  return d;
}

}  // namespace md
