// Binding checkpoints to the architecture, one suite for Kimi Linear (tiny: model.* names, bf16
// experts) and Kimi K3 (k3-tiny: language_model.* names, MXFP4 routed experts, block attention
// residuals, A_log with more entries than heads): the expected tensors, binding generated
// checkpoints, errors naming the tensor, and the bytes read per decode token. Below the shared
// suite: what only K3 has (skipped vision tensors, MXFP4 and K3-only tensor errors).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <ostream>

#include "megadecode/base/error.h"
#include "megadecode/base/threads.h"
#include "megadecode/model/presets.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/model/weights.h"
#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

// Writes the architecture's tensors after `edit` has changed the list, every byte `fill`.
void write_variant(const std::string& dir, const ModelConfig& cfg,
                   const std::function<void(std::vector<TensorSpec>&)>& edit, uint8_t fill = 0) {
  std::vector<TensorSpec> specs = expected_tensors(cfg);
  edit(specs);
  write_checkpoint(dir, specs, [fill](const TensorSpec& t, uint8_t* out) {
    std::memset(out, fill, t.nbytes());
  });
}

std::string bind_error(const std::string& dir, const ModelConfig& cfg) {
  try {
    Checkpoint ck(dir);
    bind_weights(cfg, ck);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

const TensorSpec* find(const std::vector<TensorSpec>& s, const std::string& name) {
  for (const auto& t : s)
    if (t.name == name) return &t;
  return nullptr;
}

// Edits of a tensor list.
using Edit = std::function<void(std::vector<TensorSpec>&)>;
Edit drop(const std::string& name) {
  return [name](auto& s) { std::erase_if(s, [&](const TensorSpec& t) { return t.name == name; }); };
}
Edit reshape(const std::string& name, std::vector<int64_t> shape) {
  return [name, shape](auto& s) {
    for (auto& t : s)
      if (t.name == name) t.shape = shape;
  };
}
Edit retype(const std::string& name, DType dtype) {
  return [name, dtype](auto& s) {
    for (auto& t : s)
      if (t.name == name) t.dtype = dtype;
  };
}

struct WeightsCase {
  const char* name;  // the instantiation's name
  const char* preset;
  uint64_t seed;
  int shards;
  std::string model;            // the model's tensor name prefix
  std::vector<int> mla_layers;  // 0-indexed (layer 2 is a KDA MoE layer in both)
  bool mla_q_lora;              // MLA layers have q_a/q_b, not q_proj
  // Some expected tensors and name fragments that no tensor has.
  std::vector<TensorSpec> expected;
  std::vector<std::string> absent;
  // What binding a generated checkpoint gives.
  DType router;
  double a_hi;  // exp(A_log) in [1, a_hi)
  int64_t full_rank_gate_rows, low_rank_gate_rows;
  bool expert_mxfp4;
  int64_t expert_down_rows;
  size_t expert_down_bytes, res_w;
  // Errors naming the tensor.
  std::string kda_gate;           // an output-gate tensor of a KDA layer
  std::string expert_w2;          // a tensor of one routed expert's w2
  std::string alog_matrix;        // the message for a [2, 2] A_log
  std::vector<TensorSpec> extra;  // tensors the architecture does not use
  // Decode bytes of a full-width preset.
  const char* large_preset;
  double expert_params;  // per routed expert
  double bits;           // per routed-expert weight
  int64_t hidden, vocab;
  int experts, experts_per_token, moe_layers;
};
void PrintTo(const WeightsCase& c, std::ostream* os) {
  *os << c.name;
}

const WeightsCase kKimiLinear{
    .name = "KimiLinear",
    .preset = "tiny",
    .seed = 3,
    .shards = 2,
    .model = "model.",
    .mla_layers = {1, 3},
    .mla_q_lora = false,
    .expected =
        {
            {"model.embed_tokens.weight", DType::BF16, {1024, 64}},
            {"lm_head.weight", DType::BF16, {1024, 64}},
            {"model.norm.weight", DType::BF16, {64}},
            {"model.layers.0.self_attn.q_proj.weight", DType::BF16, {64, 64}},
            {"model.layers.0.self_attn.A_log", DType::F32, {1, 1, 2, 1}},
            {"model.layers.0.self_attn.dt_bias", DType::F32, {64}},
            {"model.layers.0.self_attn.q_conv1d.weight", DType::BF16, {64, 1, 4}},
            {"model.layers.0.self_attn.g_a_proj.weight", DType::BF16, {32, 64}},
            {"model.layers.0.self_attn.g_b_proj.weight", DType::BF16, {64, 32}},
            {"model.layers.0.self_attn.o_norm.weight", DType::BF16, {32}},
            {"model.layers.0.mlp.gate_proj.weight", DType::BF16, {128, 64}},
            {"model.layers.1.self_attn.q_proj.weight", DType::BF16, {2 * 24, 64}},
            {"model.layers.1.self_attn.kv_a_proj_with_mqa.weight", DType::BF16, {32 + 8, 64}},
            {"model.layers.1.self_attn.kv_b_proj.weight", DType::BF16, {2 * 32, 32}},
            {"model.layers.1.block_sparse_moe.gate.weight", DType::F32, {8, 64}},
            {"model.layers.1.block_sparse_moe.gate.e_score_correction_bias", DType::F32, {8}},
            {"model.layers.1.block_sparse_moe.experts.7.w1.weight", DType::BF16, {32, 64}},
            {"model.layers.1.block_sparse_moe.experts.7.w2.weight", DType::BF16, {64, 32}},
            {"model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
             DType::BF16,
             {32, 64}},
        },
    .absent = {"self_attn.g_proj", "_res_", "weight_packed", "weight_scale", "routed_expert",
               "language_model."},
    .router = DType::F32,  // as the reference saves it
    .a_hi = 4.0,
    .full_rank_gate_rows = 0,
    .low_rank_gate_rows = 32,
    .expert_mxfp4 = false,
    .expert_down_rows = 64,
    .expert_down_bytes = 64 * 32 * 2,
    .res_w = 0,
    .kda_gate = "g_a_proj.weight",
    .expert_w2 = "experts.5.w2.weight",
    .alog_matrix = "expected [1, 1, 2, 1]",
    // A Kimi Linear file has no vision tower: every tensor must be the language model's.
    .extra = {{"model.layers.0.self_attn.rotary_emb.inv_freq", DType::F32, {4}},
              {"vision_tower.patch_embed.proj.weight", DType::BF16, {8, 3, 2, 2}}},
    .large_preset = "kl48",
    .expert_params = 3.0 * 2304 * 1024,
    .bits = 16,
    .hidden = 2304,
    .vocab = 163840,
    .experts = 256,
    .experts_per_token = 8,
    .moe_layers = 26,
};

const std::string kK3Model = "language_model.model.";
const WeightsCase kK3{
    .name = "K3",
    .preset = "k3-tiny",
    .seed = 5,
    .shards = 1,
    .model = kK3Model,
    .mla_layers = {3, 5},
    .mla_q_lora = true,
    .expected =
        {
            {kK3Model + "embed_tokens.weight", DType::BF16, {1024, 64}},
            {"language_model.lm_head.weight", DType::BF16, {1024, 64}},
            {kK3Model + "output_attn_res_proj.weight", DType::BF16, {1, 64}},
            {kK3Model + "output_attn_res_norm.weight", DType::BF16, {64}},
            {kK3Model + "layers.0.self_attention_res_proj.weight", DType::BF16, {1, 64}},
            {kK3Model + "layers.5.mlp_res_norm.weight", DType::BF16, {64}},
            {kK3Model + "layers.0.self_attn.g_proj.weight", DType::BF16, {64, 64}},
            // more entries than the 2 heads
            {kK3Model + "layers.0.self_attn.A_log", DType::F32, {4}},
            {kK3Model + "layers.0.self_attn.q_conv1d.weight", DType::F32, {64, 1, 4}},
            {kK3Model + "layers.0.self_attn.o_norm.weight", DType::F32, {32}},
            {kK3Model + "layers.0.mlp.gate_proj.weight", DType::BF16, {128, 64}},
            {kK3Model + "layers.3.self_attn.q_a_proj.weight", DType::BF16, {48, 64}},
            {kK3Model + "layers.3.self_attn.q_a_layernorm.weight", DType::BF16, {48}},
            {kK3Model + "layers.3.self_attn.q_b_proj.weight", DType::BF16, {2 * 24, 48}},
            {kK3Model + "layers.3.self_attn.g_proj.weight", DType::BF16, {2 * 16, 64}},
            {kK3Model + "layers.1.block_sparse_moe.gate.weight", DType::BF16, {8, 64}},
            {kK3Model + "layers.1.block_sparse_moe.routed_expert_down_proj.weight",
             DType::BF16,
             {64, 64}},
            {kK3Model + "layers.1.block_sparse_moe.routed_expert_norm.weight", DType::BF16, {64}},
            {kK3Model + "layers.1.block_sparse_moe.routed_expert_up_proj.weight",
             DType::BF16,
             {64, 64}},
            {kK3Model + "layers.1.block_sparse_moe.experts.7.w1.weight_packed",
             DType::U8,
             {64, 32}},
            {kK3Model + "layers.1.block_sparse_moe.experts.7.w1.weight_scale", DType::U8, {64, 2}},
            {kK3Model + "layers.1.block_sparse_moe.experts.7.w2.weight_packed",
             DType::U8,
             {64, 32}},
            {kK3Model + "layers.1.block_sparse_moe.experts.7.w2.weight_scale", DType::U8, {64, 2}},
            {kK3Model + "layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
             DType::BF16,
             {128, 64}},
        },
    .absent = {"g_a_proj", "g_b_proj"},
    .router = DType::BF16,
    .a_hi = 2.0,
    .full_rank_gate_rows = 64,
    .low_rank_gate_rows = 0,
    .expert_mxfp4 = true,
    .expert_down_rows = 64,
    .expert_down_bytes = 64 * 32 + 64 * 2,
    .res_w = 64,
    .kda_gate = "g_proj.weight",
    .expert_w2 = "experts.5.w2.weight_scale",
    .alog_matrix = "expected a vector of at least 2 entries",
    // An unknown tensor inside the language model is an error (those outside are skipped).
    .extra = {{kK3Model + "layers.0.self_attn.g_a_proj.weight", DType::BF16, {32, 64}},
              {kK3Model + "layers.0.self_attn.rotary_emb.inv_freq", DType::F32, {4}}},
    .large_preset = "k3-slice",
    .expert_params = 3.0 * 3584 * 3072,
    .bits = 4.25,
    .hidden = 7168,
    .vocab = 163840,
    .experts = 64,
    .experts_per_token = 16,
    .moe_layers = 3,
};

class WeightsTest : public ::testing::TestWithParam<WeightsCase> {};

// ---- Both variants ----

TEST_P(WeightsTest, ExpectedTensorsFollowTheReleasedSchema) {
  const WeightsCase& P = GetParam();
  const ModelConfig c = preset_config(P.preset);
  const auto specs = expected_tensors(c);
  for (const TensorSpec& want : P.expected) {
    const TensorSpec* t = find(specs, want.name);
    ASSERT_TRUE(t) << want.name;
    EXPECT_EQ(t->dtype, want.dtype) << want.name;
    EXPECT_EQ(t->shape, want.shape) << want.name;
  }
  const std::string lm_head = c.tensor_prefix + "lm_head.weight";
  for (const auto& t : specs) {
    EXPECT_TRUE(t.name.rfind(P.model, 0) == 0 || t.name == lm_head) << t.name;
    for (const std::string& a : P.absent) EXPECT_EQ(t.name.find(a), std::string::npos) << t.name;
    for (int l : P.mla_layers) {
      if (t.name.find("layers." + std::to_string(l) + ".") == std::string::npos) continue;
      // With q LoRA, q comes from q_a/q_b only; without, from q_proj only.
      for (const char* q : P.mla_q_lora ? std::vector<const char*>{".q_proj"}
                                        : std::vector<const char*>{".q_a_proj", ".q_b_proj"})
        EXPECT_EQ(t.name.find(q), std::string::npos) << t.name;
    }
  }
}

TEST_P(WeightsTest, BindsAGeneratedCheckpoint) {
  const WeightsCase& P = GetParam();
  test::TempDir d("bind");
  const ModelConfig cfg = preset_config(P.preset);
  ThreadPool pool(2, false);
  make_random_checkpoint(cfg, d.path(), P.seed, P.shards, pool);
  Checkpoint ck(d.path());
  ModelWeights w = bind_weights(cfg, ck);
  EXPECT_EQ(w.ignored_tensors, 0);
  EXPECT_TRUE(w.note.empty());
  ASSERT_EQ(int(w.layers.size()), cfg.num_layers);
  EXPECT_EQ(w.embed.rows, cfg.vocab_size);
  ASSERT_EQ(w.layers[1].moe.experts.size(), size_t(cfg.num_experts));
  EXPECT_EQ(w.layers[1].moe.router.dtype, P.router);
  EXPECT_EQ(w.layers[0].kda.A_log.size(), size_t(cfg.kda_num_heads));
  // Realistic decay parameters: A = exp(A_log) in [1, a_hi).
  for (float a : w.layers[0].kda.A_log) {
    EXPECT_GE(std::exp(a), 1.0f - 1e-2f);
    EXPECT_LT(std::exp(a), float(P.a_hi) + 1e-2f);
  }
  EXPECT_EQ(w.layers[0].kda.g.rows, P.full_rank_gate_rows);
  EXPECT_EQ(w.layers[0].kda.g_a.rows, P.low_rank_gate_rows);
  const FfnWeights& e = w.layers[1].moe.experts[3];
  EXPECT_EQ(e.gate.mxfp4(), P.expert_mxfp4);
  EXPECT_EQ(e.down.rows, P.expert_down_rows);
  EXPECT_EQ(e.down.bytes(), P.expert_down_bytes);
  EXPECT_EQ(w.output_res_w.size(), P.res_w);
  EXPECT_EQ(w.layers[2].attn_res_w.size(), P.res_w);
  ModelSizes s = model_sizes(cfg);
  EXPECT_EQ(double(ck.total_bytes()), s.total_bytes);
  EXPECT_LT(s.active_bytes, s.total_bytes);
}

TEST_P(WeightsTest, SameSeedSameBytes) {
  test::TempDir a("seed_a"), b("seed_b");
  const ModelConfig cfg = preset_config(GetParam().preset);
  ThreadPool p1(1, false), p2(2, false);
  make_random_checkpoint(cfg, a.path(), 9, 1, p1);
  make_random_checkpoint(cfg, b.path(), 9, 1, p2);
  Checkpoint ca(a.path()), cb(b.path());
  ASSERT_EQ(ca.tensors().size(), cb.tensors().size());
  for (const auto& [name, t] : ca.tensors()) {
    const TensorInfo& u = cb.get(name);
    ASSERT_EQ(t.nbytes, u.nbytes);
    EXPECT_EQ(std::memcmp(t.data, u.data, t.nbytes), 0) << name;
  }
}

TEST_P(WeightsTest, ErrorsNameTheTensor) {
  const WeightsCase& P = GetParam();
  const ModelConfig cfg = preset_config(P.preset);
  const std::string L = P.model + "layers.";
  const std::string mla_kv_b = L + std::to_string(P.mla_layers[0]) + ".self_attn.kv_b_proj.weight";
  struct Case {
    const char* tag;
    Edit edit;
    std::vector<std::string> want;
  };
  const std::vector<Case> cases = {
      {"missing",
       drop(L + "2.self_attn.b_proj.weight"),
       {"missing tensor " + L + "2.self_attn.b_proj.weight"}},
      {"missing_gate",
       drop(L + "0.self_attn." + P.kda_gate),
       {"missing tensor " + L + "0.self_attn." + P.kda_gate}},
      {"missing_expert",
       drop(L + "2.block_sparse_moe." + P.expert_w2),
       {"missing tensor " + L + "2.block_sparse_moe." + P.expert_w2}},
      {"shape",
       [&](auto& s) {
         for (auto& t : s)
           if (t.name == mla_kv_b) std::swap(t.shape[0], t.shape[1]);
       },
       {"tensor " + mla_kv_b, "does not match the config"}},
      {"short_alog", reshape(L + "2.self_attn.A_log", {1}), {"tensor " + L + "2.self_attn.A_log"}},
      {"matrix_alog",
       reshape(L + "2.self_attn.A_log", {2, 2}),
       {"tensor " + L + "2.self_attn.A_log", P.alog_matrix}},
      {"dtype",
       retype(L + "0.self_attn.q_proj.weight", DType::I64),
       {L + "0.self_attn.q_proj.weight", "dtype I64 is not supported"}},
      {"dtype2", retype(P.model + "norm.weight", DType::U8), {P.model + "norm.weight"}},
  };
  for (const Case& c : cases) {
    test::TempDir d(c.tag);
    write_variant(d.path(), cfg, c.edit);
    const std::string err = bind_error(d.path(), cfg);
    for (const std::string& want : c.want) EXPECT_THAT(err, HasSubstr(want)) << c.tag;
  }
}

TEST_P(WeightsTest, ExtraTensorIsNamed) {
  const WeightsCase& P = GetParam();
  const ModelConfig cfg = preset_config(P.preset);
  for (const TensorSpec& x : P.extra) {
    test::TempDir d("extra");
    write_variant(d.path(), cfg, [&](auto& s) { s.push_back(x); });
    EXPECT_THAT(bind_error(d.path(), cfg),
                HasSubstr("unexpected tensor(s) not used by the architecture: " + x.name));
  }
}

TEST_P(WeightsTest, DecodeBytesCountTheRoutedExpertsAtTheirWidth) {
  // bf16 experts (Kimi Linear) at 16 bits per weight, MXFP4 ones (K3) at 4.25.
  const WeightsCase& P = GetParam();
  const ModelConfig c = preset_config(P.large_preset);
  ModelSizes s = model_sizes(c);
  const double expert_params = P.expert_params;
  EXPECT_DOUBLE_EQ(s.expert_bytes, expert_params * P.bits / 8);
  // Active bytes: everything but the routed experts and the embedding table, plus one embedding
  // row and the top-k experts in each MoE layer.
  const std::string embed = P.model + "embed_tokens.weight";
  double non_expert = 0;
  int64_t non_expert_params = 0;
  for (const TensorSpec& t : expected_tensors(c))
    if (t.name.find(".experts.") == std::string::npos && t.name != embed) {
      non_expert += double(t.nbytes());
      non_expert_params += int64_t(t.nbytes() / dtype_size(t.dtype));
    }
  const int64_t active_experts = int64_t(P.experts_per_token) * P.moe_layers;
  EXPECT_DOUBLE_EQ(s.active_bytes,
                   non_expert + double(P.hidden) * 2 + double(active_experts) * s.expert_bytes);
  // Parameters: MXFP4 packed bytes hold two weights each; scales hold none.
  EXPECT_EQ(s.active_params,
            non_expert_params + P.hidden + int64_t(expert_params) * active_experts);
  EXPECT_EQ(s.total_params -
                (s.active_params - P.hidden - int64_t(expert_params) * active_experts) -
                P.vocab * P.hidden,
            int64_t(expert_params) * P.experts * P.moe_layers);
  std::printf("[ %s ] %.2f GB on disk, %.2f GB read per decode token at batch 1\n", P.large_preset,
              s.total_bytes / 1e9, s.active_bytes / 1e9);
}

INSTANTIATE_TEST_SUITE_P(Variants, WeightsTest, ::testing::Values(kKimiLinear, kK3),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- Kimi K3 only: vision tensors, MXFP4 experts, K3-only tensors ----

TEST(WeightsK3, SkipsVisionTensors) {
  // A K3 file also holds the vision tower: skipped with a note, not an error.
  const ModelConfig cfg = preset_config("k3-tiny");
  test::TempDir v("k3vision");
  write_variant(
      v.path(), cfg,
      [](auto& s) {
        s.push_back({"vision_tower.patch_embed.proj.weight", DType::BF16, {8, 3, 2, 2}});
        s.push_back({"mm_projector.proj.0.weight", DType::BF16, {16, 16}});
      },
      0x3c);  // every byte 0x3c: bf16 1.1, E8M0 scales 2^-67 (not NaN)
  Checkpoint ck(v.path());
  ModelWeights w = bind_weights(cfg, ck);
  EXPECT_EQ(w.ignored_tensors, 2);
  EXPECT_THAT(w.note, HasSubstr("ignored 2 tensor(s) outside the language model"));
}

TEST(WeightsK3, Mxfp4AndK3TensorErrorsAreNamed) {
  const ModelConfig cfg = preset_config("k3-tiny");
  const std::string P = kK3Model + "layers.";
  struct Case {
    const char* tag;
    Edit edit;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"packed_shape", reshape(P + "1.block_sparse_moe.experts.0.w3.weight_packed", {32, 32}),
       "tensor " + P + "1.block_sparse_moe.experts.0.w3.weight_packed"},
      {"packed_dtype", retype(P + "1.block_sparse_moe.experts.0.w1.weight_packed", DType::BF16),
       "dtype BF16 is not supported for an MXFP4 weight"},
      {"res_proj", reshape(P + "4.mlp_res_proj.weight", {64}),
       "tensor " + P + "4.mlp_res_proj.weight"},
      {"latent", drop(P + "3.block_sparse_moe.routed_expert_norm.weight"),
       "missing tensor " + P + "3.block_sparse_moe.routed_expert_norm.weight"},
  };
  for (const Case& c : cases) {
    test::TempDir d(c.tag);
    write_variant(d.path(), cfg, c.edit);
    EXPECT_THAT(bind_error(d.path(), cfg), HasSubstr(c.want)) << c.tag;
  }
  // A NaN E8M0 scale (255) is rejected by name.
  test::TempDir n("k3nan");
  write_variant(
      n.path(), cfg, [](auto&) {}, 0xff);
  EXPECT_THAT(bind_error(n.path(), cfg), HasSubstr("is 255 (NaN in E8M0)"));
}

}  // namespace
}  // namespace md
