// The CUDA executors through the host simulation of the CUDA execution model: cuda-megakernel
// and cuda-opbyop agree bit for bit with each other (same tiles, same blocks) under every
// scheduling seed, and with the CPU reference path within fp32 reordering; batches of 1, 3 and 8
// with sequences joining and leaving; multi-row steps; the watchdog. Then the simulation itself:
// barriers, warp collectives, bulk copies with byte checks, the deadlock detector.
//
// Tolerance against the reference (FP32 precision, where no bf16 rounding point can flip): the
// tiles sum every dot product of length n in another order than the CPU kernels, an error of at
// most n * 2^-24 of the sum of the products' magnitudes per matrix (Higham's bound); with n up to
// 512 here and a handful of layers that is below 1e-4 of the logits' scale, the bound the test
// uses. In BF16 precision a reordering can move a value across a bf16 rounding boundary (2^-8
// relative) and the difference propagates; there the test checks the greedy tokens where the
// reference's top two logits are further apart than 2^-6 of their scale, and bit-identity between
// the two CUDA executors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../exec/exec_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cuda/sim.h"
#include "test_util.h"

namespace md {
namespace {

using test::expect_same_bits;
using test::opts;
using ::testing::HasSubstr;

std::string model(const std::string& name) {
  const int seed = name == "tiny" ? 21 : name == "small" ? 22 : name == "k3-tiny" ? 23 : 24;
  return test::shared_checkpoint(name, uint64_t(seed));
}

// The simulation's configuration for one test (restored after).
struct SimConfig {
  cuda::sim::Config saved = cuda::sim::config();
  explicit SimConfig(int sms, uint64_t seed = 0) {
    cuda::sim::config().sm_count = sms;
    cuda::sim::config().seed = seed;
  }
  ~SimConfig() { cuda::sim::config() = saved; }
};

std::vector<SequenceState> prefilled(Model& m, int n) {
  const int64_t V = m.config().vocab_size;
  std::vector<SequenceState> out;
  for (int i = 0; i < n; ++i) {
    SequenceState s = m.new_sequence();
    const int len = (i * 7 + 3) % 19;
    std::vector<int32_t> ids(static_cast<size_t>(len));
    for (int t = 0; t < len; ++t) ids[size_t(t)] = int32_t((i * 131 + t * 17 + 1) % (V - 1));
    if (len > 0) m.forward(s, ids, nullptr, false);
    out.push_back(std::move(s));
  }
  return out;
}

double max_abs(const float* x, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, double(std::fabs(x[i])));
  return m;
}

// Both CUDA executors step batches of 1, 3 and 8 with sequences joining and leaving; they must
// agree bit for bit, and with Model::forward within the tolerance above.
void check_executors(const std::string& name, Precision prec, int sms, uint64_t seed) {
  SimConfig sc(sms, seed);
  Model m(model(name), opts(prec));
  const int64_t V = m.config().vocab_size;
  std::vector<SequenceState> ref = prefilled(m, 9);
  CudaExecutor emk(m, 8, ExecutorKind::kMegakernel, CudaTarget::kSim);
  CudaExecutor eob(m, 8, ExecutorKind::kOpByOp, CudaTarget::kSim);
  EXPECT_EQ(emk.workers(), sms);
  std::vector<SequenceState> mk = test::copies(emk, ref), ob = test::copies(eob, ref);
  const std::vector<std::vector<int>> batches = {{0}, {1, 2, 0}, {0, 1, 2, 3, 4, 5, 6, 7}, {8, 5, 2}, {3}};
  std::vector<float> want(static_cast<size_t>(V));
  for (size_t step = 0; step < batches.size(); ++step) {
    const auto& ids = batches[step];
    const int B = int(ids.size());
    std::vector<int32_t> tokens;
    std::vector<SequenceState*> pm, po;
    for (int id : ids) {
      tokens.push_back(int32_t((id * 37 + int(step) * 101 + 7) % (V - 1)));
      pm.push_back(&mk[size_t(id)]);
      po.push_back(&ob[size_t(id)]);
    }
    std::vector<float> lm(size_t(B) * size_t(V)), lo(size_t(B) * size_t(V));
    std::vector<int32_t> nm(size_t(B), -1), no(size_t(B), -1);
    emk.step(pm, tokens, lm.data(), nm.data());
    eob.step(po, tokens, lo.data(), no.data());
    for (int b = 0; b < B; ++b) {
      const std::string what = name + " step " + std::to_string(step) + " seq " +
                               std::to_string(ids[size_t(b)]) + " seed " + std::to_string(seed);
      const float* got = lm.data() + size_t(b) * size_t(V);
      expect_same_bits(lo.data() + size_t(b) * size_t(V), got, size_t(V), "opbyop vs megakernel " + what);
      EXPECT_EQ(nm[size_t(b)], no[size_t(b)]) << what;
      m.forward(ref[size_t(ids[size_t(b)])], std::span(&tokens[size_t(b)], 1), want.data(), false);
      const double scale = max_abs(want.data(), size_t(V));
      const int32_t greedy = int32_t(std::max_element(got, got + V) - got);
      EXPECT_EQ(nm[size_t(b)], greedy) << "the device argmax, " << what;
      if (prec == Precision::FP32) {
        double err = 0;
        for (int64_t i = 0; i < V; ++i) err = std::max(err, double(std::fabs(got[i] - want[size_t(i)])));
        EXPECT_LE(err, 1e-4 * scale) << "vs the reference, " << what;
      }
      // Greedy token where the reference's choice is clear.
      std::vector<float> sorted(want);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      if (sorted[0] - sorted[1] > scale / 64) {
        const int32_t rg = int32_t(std::max_element(want.begin(), want.end()) - want.begin());
        EXPECT_EQ(nm[size_t(b)], rg) << "greedy token vs the reference, " << what;
      }
    }
  }
}

TEST(CudaSim, TinyFp32BothExecutorsAgreeAndMatchReference) {
  check_executors("tiny", Precision::FP32, 4, 0);
}
TEST(CudaSim, TinyBf16BothExecutorsAgree) {
  check_executors("tiny", Precision::BF16, 3, 0);
}
TEST(CudaSim, SmallFp32BothExecutorsAgreeAndMatchReference) {
  check_executors("small", Precision::FP32, 8, 0);
}
TEST(CudaSim, SmallBf16BothExecutorsAgree) {
  check_executors("small", Precision::BF16, 4, 0);
}
// Random scheduling of the simulated threads and blocks: a missing wait or barrier shows up as a
// different result (or a TSan report) under some order.
TEST(CudaSim, RandomSchedulesGiveTheSameBits) {
  for (uint64_t seed : {1, 2, 3}) check_executors("tiny", Precision::FP32, 5, seed);
}

// A prefill of several rows per step (the plan's multi-row steps) leaves the same state and
// last-row logits as one row at a time, within the tolerance.
TEST(CudaSim, MultiRowPrefillMatchesReference) {
  SimConfig sc(4);
  Model m(model("tiny"), opts(Precision::FP32));
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 13; ++i) prompt.push_back(int32_t((i * 29 + 5) % (V - 1)));
  std::vector<float> want(static_cast<size_t>(V)), got(static_cast<size_t>(V));
  SequenceState r = m.new_sequence();
  m.forward(r, prompt, want.data(), false);
  for (ExecutorKind k : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
    CudaExecutor ex(m, 2, k, CudaTarget::kSim);
    SequenceState s = ex.new_sequence();
    ex.prefill(s, prompt, got.data(), 5);  // 5 + 5 + 3 rows
    EXPECT_EQ(s.pos, 13);
    double err = 0;
    for (int64_t i = 0; i < V; ++i) err = std::max(err, double(std::fabs(got[size_t(i)] - want[size_t(i)])));
    EXPECT_LE(err, 1e-4 * max_abs(want.data(), size_t(V))) << executor_name(k);
  }
}

// The megakernel's watchdog: a stalled tile becomes an md::Error naming the instruction; the
// executor recovers for the next step.
TEST(CudaSim, WatchdogReportsAStalledTile) {
  SimConfig sc(3);
  Model m(model("tiny"), opts(Precision::BF16));
  CudaExecutor ex(m, 1, ExecutorKind::kMegakernel, CudaTarget::kSim);
  ex.set_watchdog_seconds(0.01);
  const plan::Plan& p = ex.plan(1);
  const uint32_t id = uint32_t(p.instrs.size() / 2);
  ex.edit_instr_for_testing(1, id, [](plan::Instr& in) { in.flags |= plan::kFlagTestStall; });
  SequenceState s = ex.new_sequence();
  std::vector<float> logits(static_cast<size_t>(m.config().vocab_size));
  SequenceState* seqs[] = {&s};
  const int32_t tok = 3;
  try {
    ex.step(seqs, std::span(&tok, 1), logits.data());
    FAIL() << "the stalled step did not fail";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("stuck"));
    EXPECT_THAT(e.what(), HasSubstr("stalled (test hook)"));
  }
  ex.edit_instr_for_testing(1, id, [](plan::Instr& in) { in.flags &= ~plan::kFlagTestStall; });
  SequenceState s2 = ex.new_sequence();
  SequenceState* seqs2[] = {&s2};
  EXPECT_NO_THROW(ex.step(seqs2, std::span(&tok, 1), logits.data()));
}

TEST(CudaSim, GpuTargetWithoutAGpuIsAClearError) {
  Model m(model("tiny"), opts(Precision::BF16));
  try {
    CudaExecutor ex(m, 1, ExecutorKind::kOpByOp, CudaTarget::kGpu);
    GTEST_SKIP() << "a CUDA device is present: " << ex.device_name();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("no CUDA device"));
  }
}

}  // namespace
}  // namespace md
