// The DSpark speculative draft's description (config.json of a checkpoint in the layout of
// RedHatAI/Kimi-K3-speculator.dspark): a small Qwen3-style transformer fed by the target's
// hidden states; docs/speculative.md has the semantics and their sources.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace md {

struct ModelConfig;

// Rows of one draft block: the anchor and 7 mask tokens (the seed's ROWS); a block may be smaller.
inline constexpr int kDraftBlockRows = 8;
// Largest block DraftModel::draft accepts (the verify step's row limit for one sequence).
inline constexpr int kDraftMaxBlockRows = 16;

struct DraftConfig {
  // transformer_layer_config.*
  int64_t hidden_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  int window = 0;  // sliding_window: the ring of context K/V rows per layer
  double rope_theta = 0;
  double rms_norm_eps = 0;
  // Top level. Id L captures the target's residual stream entering layer L (0-indexed), i.e.
  // after layer L - 1; the fc input is their concatenation in this order.
  std::vector<int> aux_layer_ids;
  int64_t mask_token_id = -1;
  int markov_rank = 0;

  int64_t q_width() const { return int64_t(num_heads) * head_dim; }
  int64_t kv_width() const { return int64_t(num_kv_heads) * head_dim; }
  // fc's input width: the concatenated aux hidden states of one token (the target's hidden size
  // each, which validate_draft_for_target requires to equal hidden_size).
  int64_t context_width() const { return int64_t(aux_layer_ids.size()) * hidden_size; }
};

// Parses the draft's config.json document. Throws md::Error naming the field on a missing,
// mistyped or inconsistent value (source starts the message). Keys the draft does not use are
// ignored: the file is a third-party format with training metadata.
DraftConfig parse_draft_config(const nlohmann::json& j, const std::string& source = "config.json");
DraftConfig load_draft_config_file(const std::string& path);
// The config.json make-model writes (what parse_draft_config reads back).
nlohmann::json draft_config_to_json(const DraftConfig& c);

// Checks that the draft can run against this target: the same hidden size and vocabulary, and
// aux layer ids inside the target's layers (1 .. num_layers - 1). md::Error naming the mismatch.
void validate_draft_for_target(const DraftConfig& d, const ModelConfig& target,
                               const std::string& source = "draft");

// make-model --draft-for: a draft sized for `target` as the seed's draft is for Kimi K3
// (docs/speculative.md "A draft for any target"). layers > 0 and non-empty aux_ids override the
// defaults (5 layers; aux ids at the seed's fractions of the target's depth).
DraftConfig draft_config_for_target(const ModelConfig& target, int layers = 0,
                                    const std::vector<int>& aux_ids = {});
// The default aux layer ids for a target of `target_layers` layers (n ids, distinct, ascending,
// in 1 .. target_layers - 1): the seed's ids 24, 48, 72, 88, 92 of 93 layers scaled to the depth.
std::vector<int> default_aux_layer_ids(int target_layers);

}  // namespace md
