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

// Writes the tiny architecture's tensors after `edit` has changed the list.
void write_variant(const std::string& dir, const ModelConfig& cfg,
                   const std::function<void(std::vector<TensorSpec>&)>& edit) {
  std::vector<TensorSpec> specs = expected_tensors(cfg);
  edit(specs);
  write_checkpoint(dir, specs, [](const TensorSpec& t, uint8_t* out) {
    std::memset(out, 0, t.nbytes());
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

TEST(Weights, BindsAGeneratedCheckpoint) {
  test::TempDir d("bind");
  ModelConfig cfg = preset_config("tiny");
  ThreadPool pool(2, false);
  make_random_checkpoint(cfg, d.path(), 3, 2, pool);
  Checkpoint ck(d.path());
  ModelWeights w = bind_weights(cfg, ck);
  ASSERT_EQ(int(w.layers.size()), cfg.num_layers);
  EXPECT_EQ(w.embed.rows, cfg.vocab_size);
  EXPECT_EQ(w.layers[1].moe.experts.size(), size_t(cfg.num_experts));
  EXPECT_EQ(w.layers[1].moe.router.dtype, DType::F32);  // as the reference saves it
  EXPECT_EQ(w.layers[0].kda.A_log.size(), size_t(cfg.kda_num_heads));
  // Realistic decay parameters: A = exp(A_log) in [1, 4).
  for (float a : w.layers[0].kda.A_log) {
    EXPECT_GE(std::exp(a), 1.0f - 1e-2f);
    EXPECT_LT(std::exp(a), 4.0f + 1e-2f);
  }
  ModelSizes s = model_sizes(cfg);
  EXPECT_EQ(double(ck.total_bytes()), s.total_bytes);
  EXPECT_LT(s.active_bytes, s.total_bytes);
}

TEST(Weights, SameSeedSameBytes) {
  test::TempDir a("seed_a"), b("seed_b");
  ModelConfig cfg = preset_config("tiny");
  ThreadPool p1(1, false), p2(2, false);
  make_random_checkpoint(cfg, a.path(), 9, 1, p1);
  make_random_checkpoint(cfg, b.path(), 9, 1, p2);
  Checkpoint ca(a.path()), cb(b.path());
  for (const auto& [name, t] : ca.tensors()) {
    const TensorInfo& u = cb.get(name);
    ASSERT_EQ(t.nbytes, u.nbytes);
    EXPECT_EQ(std::memcmp(t.data, u.data, t.nbytes), 0) << name;
  }
}

TEST(Weights, MissingTensorIsNamed) {
  test::TempDir d("missing");
  ModelConfig cfg = preset_config("tiny");
  write_variant(d.path(), cfg, [](auto& s) {
    std::erase_if(s, [](const TensorSpec& t) { return t.name == "model.layers.2.self_attn.b_proj.weight"; });
  });
  EXPECT_THAT(bind_error(d.path(), cfg),
              HasSubstr("missing tensor model.layers.2.self_attn.b_proj.weight"));
}

TEST(Weights, ExtraTensorIsNamed) {
  test::TempDir d("extra");
  ModelConfig cfg = preset_config("tiny");
  write_variant(d.path(), cfg, [](auto& s) {
    s.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", DType::F32, {4}});
  });
  EXPECT_THAT(bind_error(d.path(), cfg),
              HasSubstr("unexpected tensor(s) not used by the architecture: "
                        "model.layers.0.self_attn.rotary_emb.inv_freq"));
}

TEST(Weights, WrongShapeIsNamed) {
  test::TempDir d("shape");
  ModelConfig cfg = preset_config("tiny");
  write_variant(d.path(), cfg, [](auto& s) {
    for (auto& t : s)
      if (t.name == "model.layers.1.self_attn.kv_b_proj.weight") std::swap(t.shape[0], t.shape[1]);
  });
  EXPECT_THAT(bind_error(d.path(), cfg),
              HasSubstr("tensor model.layers.1.self_attn.kv_b_proj.weight"));
  EXPECT_THAT(bind_error(d.path(), cfg), HasSubstr("does not match the config"));
}

TEST(Weights, WrongDtypeIsNamed) {
  test::TempDir d("dtype");
  ModelConfig cfg = preset_config("tiny");
  write_variant(d.path(), cfg, [](auto& s) {
    for (auto& t : s)
      if (t.name == "model.layers.0.self_attn.q_proj.weight") t.dtype = DType::I64;
  });
  EXPECT_THAT(bind_error(d.path(), cfg),
              HasSubstr("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_THAT(bind_error(d.path(), cfg), HasSubstr("dtype I64 is not supported"));
  test::TempDir d2("dtype2");
  write_variant(d2.path(), cfg, [](auto& s) {
    for (auto& t : s)
      if (t.name == "model.norm.weight") t.dtype = DType::U8;
  });
  EXPECT_THAT(bind_error(d2.path(), cfg), HasSubstr("model.norm.weight"));
}

}  // namespace
}  // namespace md
