// Random weights generated on the device (Device::fill_random, through the simulation): the
// device's bytes are the host generator's for every recipe kind and across chunk boundaries, and
// a CUDA executor on a Model of device-generated weights (Checkpoint::random) computes bit for
// bit what it computes on the make-model checkpoint of the same seed; with --quantize, the
// matrices are drawn in the format as device recipes of their own.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "../../src/kernels/cuda/device.h"
#include "../exec/exec_test_util.h"
#include "cuda_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/engine/quantize.h"
#include "megadecode/kernels/cpu/int4.h"
#include "megadecode/kernels/cpu/int8.h"
#include "megadecode/kernels/cpu/mxfp4.h"
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

// Every linear matrix of a Kimi Linear model, in a fixed order.
std::vector<Mat*> linears(ModelWeights& w) {
  std::vector<Mat*> out;
  for (LayerWeights& L : w.layers) {
    for (Mat* m : {&L.kda.q, &L.kda.k, &L.kda.v, &L.kda.f_a, &L.kda.f_b, &L.kda.b, &L.kda.g_a,
                   &L.kda.g_b, &L.kda.o, &L.mla.q, &L.mla.q_a, &L.mla.q_b, &L.mla.kv_a,
                   &L.mla.o})
      out.push_back(m);
    for (FfnWeights* f : {&L.dense, &L.moe.shared}) out.insert(out.end(), {&f->gate, &f->up, &f->down});
    for (FfnWeights& f : L.moe.experts) out.insert(out.end(), {&f.gate, &f.up, &f.down});
  }
  out.push_back(&w.lm_head);
  return out;
}

// --quantize on random weights generated on the device (no values in host memory to quantize):
// each matrix is drawn in the format as device recipes of its codes and scales. Both CUDA
// executors decode such a model bit for bit as the same model with those codes and scales
// materialised on the host from the recipes (then uploaded, not generated), and the drawn
// weights keep their bf16 recipe's rms: within 5% and the sampling noise of the matrix's size for
// int4 / int8 (bf16 scales near the target), and a factor 1.1 sqrt(2) more for MXFP4 (its scales
// are powers of two, and its codes' rms constant is approximate).
TEST(CudaRandomWeights, QuantizedDeviceWeightsAreDrawnInTheFormat) {
  const ModelConfig cfg = preset_config("tiny");
  const uint64_t seed = 43;
  for (QuantScheme scheme : {QuantScheme::kInt4, QuantScheme::kInt8, QuantScheme::kMxfp4}) {
    SCOPED_TRACE(std::string(quant_scheme_name(scheme)));
    ModelOptions o = opts(Precision::BF16);
    o.quantize.scheme = scheme;
    o.quantize.group = scheme == QuantScheme::kMxfp4 ? -1 : 32;
    o.quantize.lm_head = true;
    Model plain(cfg, seed, opts(Precision::BF16)), drawn(cfg, seed, o), host(cfg, seed, o);
    const QuantizeReport& rep = drawn.quantize_report();
    ASSERT_GT(rep.drawn, 0);
    EXPECT_EQ(rep.drawn, rep.matrices);
    const std::vector<Mat*> pm = linears(plain.mutable_weights()), hm = linears(host.mutable_weights());
    ASSERT_EQ(pm.size(), hm.size());
    std::vector<std::unique_ptr<std::vector<uint8_t>>> keep;
    int materialised = 0;
    for (size_t i = 0; i < hm.size(); ++i) {
      Mat& m = *hm[i];
      if (!m.data || !m.quantized()) continue;
      const RandomInit* rc = host.checkpoint().device_only(m.data);
      const RandomInit* rs = host.checkpoint().device_only(m.scales);
      ASSERT_TRUE(rc && rs) << "matrix " << i;
      auto materialise = [&](const RandomInit& r) {
        keep.push_back(std::make_unique<std::vector<uint8_t>>(r.numel * r.element_bytes()));
        for (uint64_t c = 0; c < r.chunks(); ++c) fill_random_chunk(r, c, keep.back()->data());
        return keep.back()->data();
      };
      ASSERT_EQ(rc->numel * rc->element_bytes(), size_t(m.rows) * m.code_row_bytes());
      ASSERT_EQ(rs->numel * rs->element_bytes(), size_t(m.rows) * m.scale_row_bytes());
      m.data = materialise(*rc);
      m.scales = materialise(*rs);
      ++materialised;
      // The dequantized weights' rms against the bf16 recipe's.
      const RandomInit* src = plain.checkpoint().device_only(pm[i]->data);
      ASSERT_TRUE(src) << "matrix " << i;
      std::vector<float> row(size_t(m.cols));
      double ss = 0;
      for (int64_t r = 0; r < m.rows; ++r) {
        const uint8_t* c = m.packed_data() + size_t(r) * m.code_row_bytes();
        const uint8_t* sc = m.scales + size_t(r) * m.scale_row_bytes();
        if (m.int4())
          cpu::dequantize_int4_row(c, reinterpret_cast<const bf16*>(sc), m.cols, m.group, row.data());
        else if (m.int8())
          cpu::dequantize_int8_row(c, reinterpret_cast<const bf16*>(sc), m.cols, m.group, row.data());
        else
          cpu::dequantize_mxfp4_row(c, sc, m.cols, row.data());
        for (float v : row) ss += double(v) * v;
      }
      const double ratio = std::sqrt(ss / double(m.rows * m.cols)) / random_init_rms(*src);
      // (Sampling: the rms of n draws moves by about 0.5 / sqrt(n) relative; 5 of those.)
      const double n = double(m.rows * m.cols), sampling = 1.05 + 2.5 / std::sqrt(n);
      const double tol = scheme == QuantScheme::kMxfp4 ? 1.1 * sampling * std::sqrt(2.0) : sampling;
      EXPECT_LT(ratio, tol) << "matrix " << i;
      EXPECT_GT(ratio, 1.0 / tol) << "matrix " << i;
    }
    EXPECT_EQ(materialised, rep.matrices);
    const ExecutorKind kind =
        scheme == QuantScheme::kInt8 ? ExecutorKind::kOpByOp : ExecutorKind::kMegakernel;
    const std::vector<float> a = decode(drawn, kind, CudaTarget::kSim),
                             b = decode(host, kind, CudaTarget::kSim);
    test::expect_same_bits(a.data(), b.data(), a.size(), "drawn on the device vs materialised");
  }
}

// int4-asym quantizes values; device-generated weights have none on the host, and drawing them
// symmetric would silently give another scheme: an error naming the matrix and the way out.
TEST(CudaRandomWeights, AsymmetricInt4OfDeviceWeightsIsAnError) {
  ModelOptions o = opts(Precision::BF16);
  o.quantize.scheme = QuantScheme::kInt4Asym;
  o.quantize.group = 32;
  try {
    Model m(preset_config("tiny"), 43, o);
    ADD_FAILURE() << "int4-asym of device-generated weights loaded";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("model.layers.0."));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("use --quantize int4"));
  }
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
