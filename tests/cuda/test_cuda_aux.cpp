// The aux capture on the CUDA executors (StepOptions::aux: the residual stream entering each
// listed layer, for every token row of a step, copied back from the device arena). The CUDA
// tiles sum in another order than the CPU kernels, so the rows cannot be Model::forward's bits;
// what is checked instead, on the golden Kimi Linear tiny and Kimi K3 tiny models (K3: blocks of
// 2 layers, so ids 2 and 4 are a block's partial sum at its boundary), in both precisions, for
// batches of 3 sequences feeding different row counts:
//  * cuda-megakernel and cuda-opbyop capture the same bits;
//  * a batched multi-row step captures, bit for bit, what the same executor captures feeding
//    each sequence alone one token at a time (its own decode path; the MLA attention unsplit,
//    so that the batch does not change the split count and with it the fp32 order);
//  * FP32: every captured row is within 1e-4 of the row's scale of Model::forward's AuxCapture
//    (the fp32 reordering bound of test_cuda_sim.cpp; a wrong layer or row is off by far more);
//  * a bad capture is an md::Error before anything changes.
// CudaGpu.AuxCapture* are the same on a GPU (skipped, saying why, without one).
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
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cuda/sim.h"
#include "test_util.h"

namespace md {
namespace {

using test::expect_same_bits;
using test::opts;

using test::SimConfig;

std::vector<int32_t> tokens(const Model& m, int n, int salt) {
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) ids[size_t(t)] = int32_t((salt * 131 + t * 17 + 5) % (V - 1));
  return ids;
}

// Steps of `mk` (and the same on `ob`) with the capture, each sequence also fed alone, one token
// at a time, through `mk` and through Model::forward.
void check_model(const std::string& name, Precision prec, CudaTarget target) {
  SCOPED_TRACE(name + (prec == Precision::BF16 ? " bf16" : " fp32"));
  Model m(test::data_dir() + "/data/golden/" + name, opts(prec));
  const int64_t V = m.config().vocab_size, D = m.config().hidden_size;
  const int L = m.config().num_layers, B = 3;
  std::vector<int> layers = {L - 1};
  for (int l = 1; l < L - 1; ++l) layers.push_back(l);
  const size_t width = layers.size() * size_t(D);
  ExecutorOptions eo;
  eo.plan.mla_kv_splits = 1;
  CudaExecutor mk(m, B, ExecutorKind::kMegakernel, target, eo);
  CudaExecutor ob(m, B, ExecutorKind::kOpByOp, target, eo);
  std::vector<SequenceState> ref, in_mk, in_ob, alone;
  for (int b = 0; b < B; ++b) {
    SequenceState s = m.new_sequence();
    m.forward(s, tokens(m, 1 + 5 * b, 70 + b), nullptr, false);
    in_mk.push_back(test::copy_of(mk, s));
    in_ob.push_back(test::copy_of(ob, s));
    alone.push_back(test::copy_of(mk, s));
    ref.push_back(std::move(s));
  }
  const std::vector<std::vector<int>> mixes = {{1, 5, 3}, {8, 1, 2}};
  double worst = 0;  // FP32: the largest |engine - reference| / (1e-4 x row scale)
  for (size_t step = 0; step < mixes.size(); ++step) {
    std::vector<std::vector<int32_t>> feed;
    std::vector<StepSeq> qm, qo;
    int n = 0;
    for (int b = 0; b < B; ++b) {
      feed.push_back(tokens(m, mixes[step][size_t(b)], 80 + b + 3 * int(step)));
      n += mixes[step][size_t(b)];
    }
    for (int b = 0; b < B; ++b) {
      const LogitRows lr = b == 0 ? LogitRows::kAll : LogitRows::kLast;
      qm.push_back(StepSeq{&in_mk[size_t(b)], feed[size_t(b)], lr});
      qo.push_back(StepSeq{&in_ob[size_t(b)], feed[size_t(b)], lr});
    }
    std::vector<float> am(size_t(n) * width, std::nanf("")), ao(am.size(), std::nanf(""));
    std::vector<float> logits(size_t(logit_row_count(qm)) * size_t(V));
    StepOptions so;
    so.aux = {layers, am.data()};
    mk.step(qm, logits.data(), nullptr, {}, so);
    so.aux.out = ao.data();
    ob.step(qo, logits.data(), nullptr, {}, so);
    expect_same_bits(am.data(), ao.data(), am.size(),
                     "megakernel vs opbyop, step " + std::to_string(step));
    size_t row = 0;
    for (int b = 0; b < B; ++b)
      for (size_t i = 0; i < feed[size_t(b)].size(); ++i, ++row) {
        const std::string what = "step " + std::to_string(step) + " sequence " + std::to_string(b) +
                                 " row " + std::to_string(i);
        std::vector<float> one(width, std::nanf("")), want(width), l(static_cast<size_t>(V));
        SequenceState* sp = &alone[size_t(b)];
        StepOptions o1;
        o1.aux = {layers, one.data()};
        const StepSeq q1{sp, std::span(feed[size_t(b)]).subspan(i, 1)};
        mk.step(std::span(&q1, 1), l.data(), nullptr, {}, o1);
        expect_same_bits(am.data() + row * width, one.data(), width, "batched vs alone, " + what);
        const AuxCapture cap{layers, want.data()};
        m.forward(ref[size_t(b)], std::span(feed[size_t(b)]).subspan(i, 1), l.data(), false, &cap);
        if (prec != Precision::FP32) continue;
        for (size_t a = 0; a < layers.size(); ++a) {
          const float* g = am.data() + row * width + a * size_t(D);
          const float* w = want.data() + a * size_t(D);
          double scale = 0, err = 0;
          for (int64_t j = 0; j < D; ++j) {
            scale = std::max(scale, double(std::fabs(w[j])));
            err = std::max(err, std::fabs(double(g[j]) - double(w[j])));
          }
          worst = std::max(worst, err / (1e-4 * scale));
          EXPECT_LE(err, 1e-4 * scale) << "vs Model::forward, " << what << " layer " << layers[a];
        }
      }
  }
  if (prec == Precision::FP32) {
    ::testing::Test::RecordProperty("worst_over_bound_" + name, std::to_string(worst));
  }
}

void aux_capture_matches(CudaTarget target) {
  for (const char* name : {"tiny", "k3-tiny"})
    for (Precision p : {Precision::FP32, Precision::BF16}) check_model(name, p, target);
}

// Bad captures are md::Errors naming the problem before anything changes.
void aux_capture_errors(CudaTarget target) {
  Model m(test::data_dir() + "/data/golden/tiny", opts(Precision::BF16));
  const int64_t V = m.config().vocab_size;
  const int L = m.config().num_layers;
  CudaExecutor ex(m, 1, ExecutorKind::kMegakernel, target);
  SequenceState s = ex.new_sequence();
  const std::vector<int32_t> ids = {3, 9};
  const StepSeq q{&s, ids};
  std::vector<float> logits(static_cast<size_t>(V)), aux(2 * 64, 1.0f);
  const std::vector<int> bad = {1, L}, good = {1};
  StepOptions so;
  so.aux = {bad, aux.data()};
  EXPECT_THAT(
      [&] {
        try {
          ex.step(std::span(&q, 1), logits.data(), nullptr, {}, so);
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string("no error");
      }(),
      ::testing::HasSubstr("aux layer id " + std::to_string(L) + " is out of range"));
  so.aux = {good, nullptr};
  EXPECT_THROW(ex.step(std::span(&q, 1), logits.data(), nullptr, {}, so), Error);
  EXPECT_EQ(s.pos, 0);
  for (float x : aux) EXPECT_EQ(x, 1.0f);
}

TEST(CudaSim, AuxCaptureMatchesTheDecodePath) {
  SimConfig sc(4);
  aux_capture_matches(CudaTarget::kSim);
}
TEST(CudaGpu, AuxCaptureMatchesTheDecodePath) {
  MD_NEED_GPU();
  aux_capture_matches(CudaTarget::kGpu);
}
TEST(CudaSim, AuxCaptureErrors) {
  SimConfig sc(3);
  aux_capture_errors(CudaTarget::kSim);
}
TEST(CudaGpu, AuxCaptureErrors) {
  MD_NEED_GPU();
  aux_capture_errors(CudaTarget::kGpu);
}

}  // namespace
}  // namespace md
