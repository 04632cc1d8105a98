// Quantized weights on the CUDA executors (gemv.cuh's int4 / int8 / FP8 / MXFP4 units; the GEMV
// itself is pinned against float64 in test_cuda_gemv.cpp): whole models quantized at load
// (--quantize int4 | int8 | mxfp4, groups and per-row scales, lm_head included), stepped in
// batches of 1, 3 and 2 on both executors. They must agree bit for bit with each other and, in
// FP32 precision, with Model::forward of the same quantized model (the CPU kernels, which match
// their float64 references and the dequantized-fp32 model) within the fp32-reordering bound
// test_cuda_sim.cpp derives: both sides multiply the same exact weight values, only the
// summation order differs, so 1e-4 of the logits' scale. A code offset off by one, swapped
// nibbles or a neighbouring group's scale each fail every case of their format here (checked by
// breaking each on purpose). FP8 checkpoints: tests/model/test_fp8_checkpoint.cpp runs its model
// on the simulation too.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../exec/exec_test_util.h"
#include "cuda_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/engine/quantize.h"
#include "megadecode/exec/cuda_executor.h"
#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

ModelOptions quantized(Precision p, QuantScheme scheme, int group, bool lm_head = false) {
  ModelOptions o = test::opts(p);
  o.quantize.scheme = scheme;
  o.quantize.group = group;
  o.quantize.lm_head = lm_head;
  return o;
}

struct Case {
  const char* preset;
  QuantScheme scheme;
  int group;
  bool lm_head;
};

std::string describe(const Case& c) {
  return std::string(c.preset) + " " + std::string(quant_scheme_name(c.scheme)) + " group " +
         std::to_string(c.group) + (c.lm_head ? " with lm_head" : "");
}

// Five steps over three sequences (batches {0}, {1, 2, 0}, {2, 1}), both executors against each
// other and against Model::forward.
void check_quantized(const Case& c, Precision prec, CudaTarget target) {
  const std::string what = describe(c) + (prec == Precision::FP32 ? " fp32" : " bf16");
  Model m(test::shared_checkpoint(c.preset, 31), quantized(prec, c.scheme, c.group, c.lm_head));
  ASSERT_GT(m.quantize_report().matrices, 0) << what;
  const int64_t V = m.config().vocab_size;
  CudaExecutor emk(m, 3, ExecutorKind::kMegakernel, target);
  CudaExecutor eob(m, 3, ExecutorKind::kOpByOp, target);
  std::vector<SequenceState> ref, mk, ob;
  for (int i = 0; i < 3; ++i) {
    ref.push_back(m.new_sequence());
    mk.push_back(emk.new_sequence());
    ob.push_back(eob.new_sequence());
  }
  const std::vector<std::vector<int>> batches = {{0}, {1, 2, 0}, {2, 1}, {0, 1, 2}, {1}};
  std::vector<float> want(static_cast<size_t>(V));
  test::step_in_lockstep(
      emk, eob, mk, ob, batches, V,
      [&](int id, int step) { return int32_t((id * 53 + step * 97 + 3) % (V - 1)); },
      [&](const test::LockstepStep& t) {
        for (size_t b = 0; b < t.ids.size(); ++b) {
          m.forward(ref[size_t(t.ids[b])], std::span(&t.tokens[b], 1), want.data(), false);
          test::expect_cuda_row(
              t, b, V, want, prec == Precision::FP32,
              what + " step " + std::to_string(t.step) + " seq " + std::to_string(t.ids[b]));
        }
      });
}

// Each scheme with groups of 32, a larger group or one scale per row; K3 (MXFP4 routed experts
// as loaded, int4 / int8 everywhere else) as well.
void quantized_models_match_reference(CudaTarget target) {
  const Case cases[] = {
      {"tiny", QuantScheme::kInt4, 32, false},  {"tiny", QuantScheme::kInt4, 0, true},
      {"tiny", QuantScheme::kInt8, 64, true},   {"tiny", QuantScheme::kInt8, 0, false},
      {"tiny", QuantScheme::kMxfp4, -1, true},  {"k3-tiny", QuantScheme::kInt4, 32, false},
      {"k3-tiny", QuantScheme::kInt8, 0, true},
  };
  for (const Case& c : cases) check_quantized(c, Precision::FP32, target);
}
SIM_AND_GPU_TEST(QuantizedModelsMatchReference, 4, quantized_models_match_reference)

// In BF16 precision (rounding points where a reordering can flip a bf16 value) the executors
// still agree bit for bit.
void quantized_bf16_executors_agree(CudaTarget target) {
  check_quantized({"small", QuantScheme::kInt4, 32, true}, Precision::BF16, target);
  check_quantized({"k3-tiny", QuantScheme::kMxfp4, -1, false}, Precision::BF16, target);
}
SIM_AND_GPU_TEST(QuantizedBf16ExecutorsAgree, 3, quantized_bf16_executors_agree)

// Integer activations (--act-quant int8) are CPU kernels only: a clear error naming the way out.
TEST(CudaSim, IntegerActivationsAreRefusedNamingTheCpuDevice) {
  ModelOptions o = quantized(Precision::BF16, QuantScheme::kInt4, 32);
  o.quantize.int_act_bits = 8;
  Model m(test::shared_checkpoint("tiny", 31), o);
  try {
    CudaExecutor ex(m, 1, ExecutorKind::kMegakernel, CudaTarget::kSim);
    FAIL() << "a model with int8 activations ran on the CUDA simulation";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("int8 / int16 runs with --device cpu"));
  }
}

}  // namespace
}  // namespace md
