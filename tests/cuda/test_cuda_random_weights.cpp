// Random weights generated on the device (Device::fill_random, through the simulation): the
// device's bytes are the host generator's for every recipe kind and across chunk boundaries, and
// a CUDA executor on a Model of device-generated weights (Checkpoint::random) computes bit for
// bit what it computes on the make-model checkpoint of the same seed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "../../src/kernels/cuda/device.h"
#include "../exec/exec_test_util.h"
#include "cuda_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/model/presets.h"
#include "test_util.h"

namespace md {
namespace {

using test::opts;

TEST(CudaRandomWeights, DeviceBytesAreTheHostGenerators) {
  const ModelConfig cfg = preset_config("tiny");
  // One recipe of each kind the device generates, 2.5 chunks long (a short last chunk).
  const uint64_t n = kRandomChunk * 5 / 2;
  std::vector<TensorSpec> specs = {
      {"model.layers.1.mlp.gate_proj.weight", DType::BF16, {int64_t(n / 64), 64}},
      {"model.layers.1.block_sparse_moe.gate.weight", DType::F32, {int64_t(n / 64), 64}},
      {"model.layers.1.mlp.experts.0.w1.weight_packed", DType::U8, {int64_t(n / 64), 64}},
      {"model.layers.1.mlp.experts.0.w1.weight_scale", DType::U8, {int64_t(n / 64), 64}},
  };
  auto dev = cuda::make_sim_device();
  for (size_t t = 0; t < specs.size(); ++t) {
    SCOPED_TRACE(specs[t].name);
    const RandomInit r = random_init(specs[t], cfg, 11, t);
    ASSERT_EQ(r.chunks(), 3u);
    ASSERT_EQ(r.numel * r.element_bytes(), specs[t].nbytes());
    void* d = dev->alloc(specs[t].nbytes());
    std::vector<cuda::RandomJob> jobs;
    for (uint64_t c = 0; c < r.chunks(); ++c) jobs.push_back({r, d, c});
    dev->fill_random(jobs.data(), jobs.size());
    dev->sync();
    std::vector<uint8_t> host(specs[t].nbytes()), back(specs[t].nbytes());
    for (uint64_t c = 0; c < r.chunks(); ++c) fill_random_chunk(r, c, host.data());
    dev->copy(back.data(), d, back.size());
    dev->sync();
    EXPECT_EQ(std::memcmp(host.data(), back.data(), host.size()), 0);
    dev->free(d);
  }
}

// Decodes a few greedy steps of 3 sequences on a CUDA executor; returns every step's logits.
std::vector<float> decode(Model& m, ExecutorKind kind, CudaTarget target) {
  CudaExecutor ex(m, 3, kind, target);
  const int64_t V = m.config().vocab_size;
  std::vector<SequenceState> seqs;
  std::vector<SequenceState*> ptrs;
  for (int b = 0; b < 3; ++b) seqs.push_back(ex.new_sequence());
  for (auto& s : seqs) ptrs.push_back(&s);
  std::vector<int32_t> tokens = {5, 77, 300};
  std::vector<float> all, logits(size_t(3 * V));
  for (int step = 0; step < 3; ++step) {
    ex.step(ptrs, tokens, logits.data());
    all.insert(all.end(), logits.begin(), logits.end());
    for (int b = 0; b < 3; ++b) {
      const float* l = logits.data() + size_t(b) * size_t(V);
      tokens[size_t(b)] = int32_t(std::max_element(l, l + V) - l);
    }
  }
  return all;
}

void expect_device_generated_model_matches_files(const std::string& preset, ExecutorKind kind,
                                                  CudaTarget target = CudaTarget::kSim) {
  SCOPED_TRACE(preset);
  const uint64_t seed = 41;
  Model files(test::shared_checkpoint(preset, seed), opts(Precision::BF16));
  Model generated(preset_config(preset), seed, opts(Precision::BF16));
  ASSERT_FALSE(generated.weights_on_host());
  const std::vector<float> a = decode(files, kind, target),
                           b = decode(generated, kind, target);
  ASSERT_EQ(a.size(), b.size());
  test::expect_same_bits(a.data(), b.data(), a.size(), preset + " logits");
}

TEST(CudaRandomWeights, ExecutorOnDeviceGeneratedWeightsMatchesTheCheckpoint) {
  expect_device_generated_model_matches_files("tiny", ExecutorKind::kMegakernel);
  expect_device_generated_model_matches_files("k3-tiny", ExecutorKind::kOpByOp);  // MXFP4
}

}  // namespace
}  // namespace md

namespace md {
namespace {

TEST(CudaGpu, DeviceGeneratedWeightsMatchTheCheckpoint) {
  MD_NEED_GPU();
  expect_device_generated_model_matches_files("tiny", ExecutorKind::kMegakernel, CudaTarget::kGpu);
  expect_device_generated_model_matches_files("k3-tiny", ExecutorKind::kOpByOp, CudaTarget::kGpu);
}

}  // namespace
}  // namespace md
