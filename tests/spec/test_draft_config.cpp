// The DSpark draft's config.json: parsing, validation against a target, the sizing of
// make-model --draft-for (spec/draft_config.h).
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>

#include "megadecode/base/error.h"
#include "megadecode/model/config.h"
#include "megadecode/model/presets.h"
#include "megadecode/model/draft_config.h"

namespace md {
namespace {

using nlohmann::json;

// The seed's draft for Kimi K3 (kimi/dspark.py DraftConfig defaults).
DraftConfig seed_k3_draft() {
  DraftConfig d;
  d.hidden_size = 7168;
  d.num_layers = 5;
  d.num_heads = 96;
  d.num_kv_heads = 16;
  d.head_dim = 64;
  d.intermediate_size = 14336;
  d.vocab_size = 163840;
  d.window = 2048;
  d.rope_theta = 1e4;
  d.rms_norm_eps = 1e-5;
  d.aux_layer_ids = {24, 48, 72, 88, 92};
  d.mask_token_id = 163837;
  d.markov_rank = 256;
  return d;
}

// A config with Kimi K3's released geometry (only what the draft reads).
ModelConfig k3_target() {
  ModelConfig c = preset_config("k3-tiny");
  c.hidden_size = 7168;
  c.vocab_size = 163840;
  c.num_layers = 93;
  c.mla_num_heads = 96;
  c.kda_num_heads = 96;
  c.kda_head_dim = 128;
  c.rms_norm_eps = 1e-5;
  return c;
}

void expect_same(const DraftConfig& a, const DraftConfig& b) {
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.window, b.window);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.aux_layer_ids, b.aux_layer_ids);
  EXPECT_EQ(a.mask_token_id, b.mask_token_id);
  EXPECT_EQ(a.markov_rank, b.markov_rank);
}

// parse_draft_config(j) must fail with a message containing `what`.
void expect_error(const json& j, const std::string& what) {
  try {
    parse_draft_config(j, "draft.json");
    ADD_FAILURE() << "accepted: " << j.dump();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("draft.json"), std::string::npos) << e.what();
  }
}

TEST(DraftConfig, RoundTripsThroughJson) {
  const DraftConfig d = seed_k3_draft();
  expect_same(parse_draft_config(draft_config_to_json(d)), d);
  // The older serialisation: rope_theta at the layer config's top level.
  json j = draft_config_to_json(d);
  j["transformer_layer_config"].erase("rope_parameters");
  j["transformer_layer_config"]["rope_theta"] = 5e5;
  EXPECT_EQ(parse_draft_config(j).rope_theta, 5e5);
  // Keys the draft does not use (training metadata) are ignored.
  j["speculators_version"] = "0.3";
  j["transformer_layer_config"]["max_position_embeddings"] = 40960;
  EXPECT_NO_THROW(parse_draft_config(j));
}

TEST(DraftConfig, BadValuesAreNamed) {
  const json good = draft_config_to_json(seed_k3_draft());
  auto with = [&](const std::function<void(json&)>& edit) {
    json j = good;
    edit(j);
    return j;
  };
  expect_error(with([](json& j) { j.erase("transformer_layer_config"); }),
               "missing field 'transformer_layer_config'");
  expect_error(with([](json& j) { j["transformer_layer_config"].erase("head_dim"); }),
               "missing field 'transformer_layer_config.head_dim'");
  expect_error(with([](json& j) { j["transformer_layer_config"]["hidden_size"] = "7168"; }),
               "'transformer_layer_config.hidden_size' must be an integer");
  expect_error(with([](json& j) { j["transformer_layer_config"]["num_hidden_layers"] = 0; }),
               "'transformer_layer_config.num_hidden_layers' must be in [1, 1024], got 0");
  expect_error(with([](json& j) { j["transformer_layer_config"]["num_key_value_heads"] = 7; }),
               "must be a multiple of num_key_value_heads (7)");
  expect_error(with([](json& j) { j["transformer_layer_config"]["head_dim"] = 63; }),
               "'transformer_layer_config.head_dim' must be even");
  expect_error(with([](json& j) { j["transformer_layer_config"]["rms_norm_eps"] = -1; }),
               "'transformer_layer_config.rms_norm_eps' must be a positive number");
  expect_error(with([](json& j) { j["transformer_layer_config"]["hidden_act"] = "gelu"; }),
               "hidden_act");
  expect_error(
      with([](json& j) { j["transformer_layer_config"]["rope_parameters"]["rope_type"] = "yarn"; }),
      "rope_type");
  expect_error(with([](json& j) { j["transformer_layer_config"]["tie_word_embeddings"] = true; }),
               "tie_word_embeddings");
  expect_error(with([](json& j) { j["aux_hidden_state_layer_ids"] = json::array(); }),
               "'aux_hidden_state_layer_ids' must be a non-empty list");
  expect_error(with([](json& j) {
                 j["aux_hidden_state_layer_ids"] = {24, 48, 24};
               }),
               "lists layer 24 twice");
  expect_error(with([](json& j) {
                 j["aux_hidden_state_layer_ids"] = {24, -1};
               }),
               "holds -1, not a layer id");
  expect_error(with([](json& j) { j["mask_token_id"] = 163840; }),
               "'mask_token_id' must be in [0, 163839], got 163840");
  expect_error(with([](json& j) { j.erase("markov_rank"); }), "missing field 'markov_rank'");
  expect_error(json::array(), "must be a JSON object");
}

TEST(DraftConfig, ValidatedAgainstTheTarget) {
  const ModelConfig target = k3_target();
  DraftConfig d = seed_k3_draft();
  EXPECT_NO_THROW(validate_draft_for_target(d, target));
  auto expect_mismatch = [&](const DraftConfig& bad, const std::string& what) {
    try {
      validate_draft_for_target(bad, target, "mydraft");
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind("mydraft:", 0), 0u) << e.what();
    }
  };
  DraftConfig b = d;
  b.hidden_size = 2304;
  expect_mismatch(b, "hidden size 2304 does not match the target's 7168");
  b = d;
  b.vocab_size = 163841;
  expect_mismatch(b, "vocabulary 163841 does not match the target's 163840");
  b = d;
  b.aux_layer_ids = {24, 93};
  expect_mismatch(b, "aux layer id 93 is out of range for a target of 93 layers");
  b.aux_layer_ids = {0, 24};
  expect_mismatch(b, "aux layer id 0 is out of range");
}

TEST(DraftConfig, SizedForATargetLikeTheSeedsDraft) {
  // For Kimi K3 the rule gives exactly the seed's draft.
  expect_same(draft_config_for_target(k3_target()), seed_k3_draft());
  EXPECT_EQ(default_aux_layer_ids(93), (std::vector<int>{24, 48, 72, 88, 92}));
  // Kimi-Linear-48B (27 layers): the same fractions, distinct, the last at the last layer's input.
  EXPECT_EQ(default_aux_layer_ids(27), (std::vector<int>{7, 14, 21, 25, 26}));
  // A shallow target gets fewer ids.
  EXPECT_EQ(default_aux_layer_ids(4), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(default_aux_layer_ids(2), (std::vector<int>{1}));
  for (int L = 2; L <= 200; ++L) {
    const std::vector<int> ids = default_aux_layer_ids(L);
    ASSERT_FALSE(ids.empty()) << L;
    EXPECT_EQ(ids.back(), L - 1) << L;
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_GE(ids[i], 1) << L;
      if (i) {
        EXPECT_GT(ids[i], ids[i - 1]) << L;
      }
    }
  }
  const ModelConfig kl48 = preset_config("kl48");
  const DraftConfig d = draft_config_for_target(kl48);
  EXPECT_EQ(d.hidden_size, kl48.hidden_size);
  EXPECT_EQ(d.vocab_size, kl48.vocab_size);
  EXPECT_EQ(d.num_heads, 32);
  EXPECT_EQ(d.num_kv_heads, 4);
  EXPECT_EQ(d.head_dim, 64);
  EXPECT_EQ(d.markov_rank, 80);
  EXPECT_NO_THROW(validate_draft_for_target(d, kl48));
  // Overrides.
  const DraftConfig o = draft_config_for_target(kl48, 2, {3, 9});
  EXPECT_EQ(o.num_layers, 2);
  EXPECT_EQ(o.aux_layer_ids, (std::vector<int>{3, 9}));
  EXPECT_THROW(draft_config_for_target(kl48, 0, {3, 27}), Error);
  EXPECT_THROW(draft_config_for_target(kl48, 0, {3, 3}), Error);
}

}  // namespace
}  // namespace md
