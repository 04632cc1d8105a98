// Binding Kimi K3 checkpoints: the language_model.* names, MXFP4 routed experts, K3-only tensors,
// A_log with more entries than heads, skipped vision tensors, and errors naming the tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "megadecode/base/error.h"
#include "megadecode/base/threads.h"
#include "megadecode/model/presets.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/model/weights.h"
#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

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

TEST(WeightsK3, ExpectedTensorsFollowTheReleasedSchema) {
  ModelConfig c = preset_config("k3-tiny");
  auto specs = expected_tensors(c);
  const std::string P = "language_model.model.";
  auto has = [&](const std::string& n, DType dt, std::vector<int64_t> shape) {
    const TensorSpec* t = find(specs, n);
    ASSERT_TRUE(t) << n;
    EXPECT_EQ(t->dtype, dt) << n;
    EXPECT_EQ(t->shape, shape) << n;
  };
  has(P + "embed_tokens.weight", DType::BF16, {1024, 64});
  has("language_model.lm_head.weight", DType::BF16, {1024, 64});
  has(P + "output_attn_res_proj.weight", DType::BF16, {1, 64});
  has(P + "output_attn_res_norm.weight", DType::BF16, {64});
  has(P + "layers.0.self_attention_res_proj.weight", DType::BF16, {1, 64});
  has(P + "layers.5.mlp_res_norm.weight", DType::BF16, {64});
  has(P + "layers.0.self_attn.g_proj.weight", DType::BF16, {64, 64});
  has(P + "layers.0.self_attn.A_log", DType::F32, {4});  // more entries than the 2 heads
  has(P + "layers.0.self_attn.q_conv1d.weight", DType::F32, {64, 1, 4});
  has(P + "layers.0.self_attn.o_norm.weight", DType::F32, {32});
  has(P + "layers.0.mlp.gate_proj.weight", DType::BF16, {128, 64});
  has(P + "layers.3.self_attn.q_a_proj.weight", DType::BF16, {48, 64});
  has(P + "layers.3.self_attn.q_a_layernorm.weight", DType::BF16, {48});
  has(P + "layers.3.self_attn.q_b_proj.weight", DType::BF16, {2 * 24, 48});
  has(P + "layers.3.self_attn.g_proj.weight", DType::BF16, {2 * 16, 64});
  has(P + "layers.1.block_sparse_moe.gate.weight", DType::BF16, {8, 64});
  has(P + "layers.1.block_sparse_moe.routed_expert_down_proj.weight", DType::BF16, {64, 64});
  has(P + "layers.1.block_sparse_moe.routed_expert_norm.weight", DType::BF16, {64});
  has(P + "layers.1.block_sparse_moe.routed_expert_up_proj.weight", DType::BF16, {64, 64});
  has(P + "layers.1.block_sparse_moe.experts.7.w1.weight_packed", DType::U8, {64, 32});
  has(P + "layers.1.block_sparse_moe.experts.7.w1.weight_scale", DType::U8, {64, 2});
  has(P + "layers.1.block_sparse_moe.experts.7.w2.weight_packed", DType::U8, {64, 32});
  has(P + "layers.1.block_sparse_moe.experts.7.w2.weight_scale", DType::U8, {64, 2});
  has(P + "layers.1.block_sparse_moe.shared_experts.gate_proj.weight", DType::BF16, {128, 64});
  for (const auto& t : specs) {
    EXPECT_EQ(t.name.rfind("language_model.", 0), 0u) << t.name;
    EXPECT_EQ(t.name.find("g_a_proj"), std::string::npos) << t.name;
    EXPECT_EQ(t.name.find(".q_proj"), t.name.find("layers.3.") == std::string::npos &&
                                              t.name.find("layers.5.") == std::string::npos
                                          ? t.name.find(".q_proj")
                                          : std::string::npos)
        << t.name;
  }
}

TEST(WeightsK3, BindsAGeneratedCheckpointAndSkipsVisionTensors) {
  test::TempDir d("k3bind");
  ModelConfig cfg = preset_config("k3-tiny");
  ThreadPool pool(2, false);
  make_random_checkpoint(cfg, d.path(), 5, 1, pool);
  {
    Checkpoint ck(d.path());
    ModelWeights w = bind_weights(cfg, ck);
    EXPECT_EQ(w.ignored_tensors, 0);
    EXPECT_TRUE(w.note.empty());
    ASSERT_EQ(w.layers.size(), 6u);
    EXPECT_EQ(w.layers[0].kda.A_log.size(), 2u);
    EXPECT_EQ(w.layers[0].kda.g.rows, 64);
    EXPECT_TRUE(w.layers[1].moe.experts[3].gate.mxfp4());
    EXPECT_EQ(w.layers[1].moe.experts[3].down.rows, 64);
    EXPECT_EQ(w.layers[1].moe.experts[3].down.bytes(), size_t(64 * 32 + 64 * 2));
    EXPECT_EQ(w.output_res_w.size(), 64u);
    EXPECT_EQ(w.layers[2].attn_res_w.size(), 64u);
    ModelSizes s = model_sizes(cfg);
    EXPECT_EQ(double(ck.total_bytes()), s.total_bytes);
  }
  // A K3 file also holds the vision tower: skipped with a note, not an error.
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
  // ... but an unknown tensor inside the language model is still an error.
  test::TempDir x("k3extra");
  write_variant(x.path(), cfg, [](auto& s) {
    s.push_back({"language_model.model.layers.0.self_attn.g_a_proj.weight", DType::BF16, {32, 64}});
  });
  EXPECT_THAT(bind_error(x.path(), cfg),
              HasSubstr("unexpected tensor(s) not used by the architecture: "
                        "language_model.model.layers.0.self_attn.g_a_proj.weight"));
}

TEST(WeightsK3, ErrorsNameTheTensor) {
  ModelConfig cfg = preset_config("k3-tiny");
  const std::string P = "language_model.model.layers.";
  struct Case {
    const char* tag;
    std::function<void(std::vector<TensorSpec>&)> edit;
    std::string want;
  };
  std::vector<Case> cases = {
      {"missing_g",
       [&](auto& s) {
         std::erase_if(
             s, [&](const TensorSpec& t) { return t.name == P + "0.self_attn.g_proj.weight"; });
       },
       "missing tensor " + P + "0.self_attn.g_proj.weight"},
      {"missing_scale",
       [&](auto& s) {
         std::erase_if(s, [&](const TensorSpec& t) {
           return t.name == P + "2.block_sparse_moe.experts.5.w2.weight_scale";
         });
       },
       "missing tensor " + P + "2.block_sparse_moe.experts.5.w2.weight_scale"},
      {"packed_shape",
       [&](auto& s) {
         for (auto& t : s)
           if (t.name == P + "1.block_sparse_moe.experts.0.w3.weight_packed") t.shape = {32, 32};
       },
       "tensor " + P + "1.block_sparse_moe.experts.0.w3.weight_packed"},
      {"packed_dtype",
       [&](auto& s) {
         for (auto& t : s)
           if (t.name == P + "1.block_sparse_moe.experts.0.w1.weight_packed") {
             t.dtype = DType::BF16;
           }
       },
       "dtype BF16 is not supported for an MXFP4 expert weight"},
      {"short_alog",
       [&](auto& s) {
         for (auto& t : s)
           if (t.name == P + "2.self_attn.A_log") t.shape = {1};
       },
       "tensor " + P + "2.self_attn.A_log"},
      {"matrix_alog",
       [&](auto& s) {
         for (auto& t : s)
           if (t.name == P + "2.self_attn.A_log") t.shape = {2, 2};
       },
       "expected a vector of at least 2 entries"},
      {"res_proj",
       [&](auto& s) {
         for (auto& t : s)
           if (t.name == P + "4.mlp_res_proj.weight") t.shape = {64};
       },
       "tensor " + P + "4.mlp_res_proj.weight"},
      {"latent",
       [&](auto& s) {
         std::erase_if(s, [&](const TensorSpec& t) {
           return t.name == P + "3.block_sparse_moe.routed_expert_norm.weight";
         });
       },
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

TEST(WeightsK3, DecodeBytesCountMxfp4AtFourAndAQuarterBits) {
  ModelConfig c = preset_config("k3-slice");
  ModelSizes s = model_sizes(c);
  const double expert_params = 3.0 * 3584 * 3072;
  EXPECT_DOUBLE_EQ(s.expert_bytes, expert_params * 4.25 / 8);
  // Active bytes: everything but the routed experts and the embedding table, plus one embedding
  // row and top-16 experts in each of the three MoE layers.
  double non_expert = 0;
  for (const TensorSpec& t : expected_tensors(c))
    if (t.name.find(".experts.") == std::string::npos &&
        t.name != "language_model.model.embed_tokens.weight")
      non_expert += double(t.nbytes());
  EXPECT_DOUBLE_EQ(s.active_bytes, non_expert + 7168 * 2 + 3 * 16 * s.expert_bytes);
  // Parameters: MXFP4 packed bytes hold two weights each; scales hold none.
  int64_t non_expert_params = 0;
  for (const TensorSpec& t : expected_tensors(c))
    if (t.name.find(".experts.") == std::string::npos &&
        t.name != "language_model.model.embed_tokens.weight")
      non_expert_params += int64_t(t.nbytes() / dtype_size(t.dtype));
  EXPECT_EQ(s.active_params, non_expert_params + 7168 + int64_t(expert_params) * 16 * 3);
  EXPECT_EQ(
      s.total_params - (s.active_params - 7168 - int64_t(expert_params) * 16 * 3) - 163840 * 7168,
      int64_t(expert_params) * 64 * 3);
  std::printf("[ k3-slice ] %.2f GB on disk, %.2f GB read per decode token at batch 1\n",
              s.total_bytes / 1e9, s.active_bytes / 1e9);
}

}  // namespace
}  // namespace md
