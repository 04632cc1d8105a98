// Checkpoint::random (make-model's weights without files): its host tensors are byte for byte
// the files make-model writes, its other tensors carry recipes that regenerate those files'
// bytes, and a Model of it is refused by the CPU paths with a clear error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/executor.h"
#include "megadecode/model/presets.h"
#include "megadecode/model/safetensors.h"
#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

void expect_same_as_files(const std::string& preset, uint64_t seed) {
  SCOPED_TRACE(preset);
  const ModelConfig cfg = preset_config(preset);
  const Checkpoint files(test::shared_checkpoint(preset, seed));
  const std::unique_ptr<Checkpoint> gen = Checkpoint::random(cfg, seed);
  ASSERT_EQ(gen->tensors().size(), files.tensors().size());
  EXPECT_FALSE(gen->host_complete());
  EXPECT_TRUE(files.host_complete());
  int host = 0, device = 0;
  for (const auto& [name, f] : files.tensors()) {
    SCOPED_TRACE(name);
    const TensorInfo* g = gen->find(name);
    ASSERT_NE(g, nullptr);
    EXPECT_EQ(g->dtype, f.dtype);
    EXPECT_EQ(g->shape, f.shape);
    ASSERT_EQ(g->nbytes, f.nbytes);
    EXPECT_EQ(files.device_only(f.data), nullptr);
    std::vector<uint8_t> bytes(g->nbytes);
    if (const RandomInit* r = gen->device_only(g->data)) {
      // The recipe the device replays: the host generator on it gives the file's bytes.
      ++device;
      ASSERT_EQ(r->numel * r->element_bytes(), g->nbytes);
      for (uint64_t c = 0; c < r->chunks(); ++c) fill_random_chunk(*r, c, bytes.data());
    } else {
      ++host;
      std::memcpy(bytes.data(), g->data, g->nbytes);
    }
    EXPECT_EQ(std::memcmp(bytes.data(), f.data, f.nbytes), 0);
  }
  // Vectors on the host, matrices (and MXFP4 codes and scales) as recipes.
  EXPECT_GT(host, 0);
  EXPECT_GT(device, host / 4);
}

TEST(RandomCheckpoint, HostTensorsAndRecipesGiveMakeModelsBytes) {
  expect_same_as_files("tiny", 31);
  expect_same_as_files("k3-tiny", 32);
}

TEST(RandomCheckpoint, TensorsAcrossSeveralChunks) {
  // A 3-chunk tensor (the test presets' tensors are all below one chunk): generated in any
  // chunk order, each chunk's first elements are those of its own md::Rng stream.
  const ModelConfig cfg = preset_config("small");
  TensorSpec big{"model.embed_tokens.weight", DType::BF16, {3, int64_t(kRandomChunk)}};
  const RandomInit r = random_init(big, cfg, 9, 0);
  ASSERT_EQ(r.chunks(), 3u);
  std::vector<uint8_t> out(big.nbytes());
  for (uint64_t c : {2u, 0u, 1u}) fill_random_chunk(r, c, out.data());  // any order
  for (uint64_t c = 0; c < 3; ++c) {
    Rng rng(random_chunk_seed(r.seed, c));
    for (uint64_t i = 0; i < 5; ++i) {
      const float v = round_bf16(float(r.mean + rng.uniform(-r.half, r.half)));
      bf16 b;
      std::memcpy(&b, out.data() + 2 * (c * kRandomChunk + i), 2);
      EXPECT_EQ(b, f32_to_bf16(v)) << "chunk " << c << " element " << i;
    }
  }
}

TEST(RandomCheckpoint, CpuPathsRefuseDeviceOnlyWeights) {
  Model m(preset_config("tiny"), 3);
  EXPECT_FALSE(m.weights_on_host());
  SequenceState s = m.new_sequence();
  const int32_t id = 1;
  try {
    m.forward(s, std::span(&id, 1), nullptr, false);
    FAIL() << "the reference path ran on weights that are not in host memory";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("generated on a CUDA device"));
    EXPECT_THAT(e.what(), HasSubstr("the reference path"));
  }
  try {
    make_executor(m, ExecutorKind::kMegakernel, 1);
    FAIL() << "a CPU executor accepted weights that are not in host memory";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("the CPU executors"));
  }
  // touch_weights skips what is not in host memory (it would fault otherwise).
  double seen = 0;
  m.touch_weights([&](double done, double) { seen = done; });
  EXPECT_EQ(seen, double(m.checkpoint().total_bytes()));
}

}  // namespace
}  // namespace md
