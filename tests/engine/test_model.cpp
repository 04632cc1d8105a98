// Whole-model self-consistency on a random tiny checkpoint: prefill vs decode, thread counts,
// bad input. (Agreement with the official implementation is in test_golden.cpp.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/model/presets.h"
#include "test_util.h"

namespace md {
namespace {

class ModelTest : public ::testing::Test {
 protected:
  static std::string dir() { return test::shared_checkpoint("tiny", 11); }

  // Logits for ids: the first p through one prefill call, the rest decoded one at a time.
  static std::vector<float> run(Model& m, const std::vector<int32_t>& ids, int p) {
    const int64_t V = m.config().vocab_size;
    std::vector<float> out(ids.size() * size_t(V));
    SequenceState s = m.new_sequence();
    if (p > 0) m.forward(s, std::span(ids.data(), size_t(p)), out.data(), true);
    for (size_t i = size_t(p); i < ids.size(); ++i)
      m.forward(s, std::span(ids.data() + i, 1), out.data() + i * size_t(V), false);
    EXPECT_EQ(s.pos, int64_t(ids.size()));
    return out;
  }
};

std::vector<int32_t> prompt(int n) {
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = (i * 37 + 11) % 700;
  return ids;
}

TEST_F(ModelTest, PrefillEqualsDecodeInFp32) {
  // 70 tokens cross the 64-token KDA chunk: the chunked form and the recurrence, and the
  // explicit and weight-absorbed MLA, agree up to fp32 reassociation.
  ModelOptions o;
  o.precision = Precision::FP32;
  Model m(dir(), o);
  auto ids = prompt(70);
  auto a = run(m, ids, 70), b = run(m, ids, 0), c = run(m, ids, 33);
  double ss = 0;
  for (float x : a) ss += double(x) * x;
  const double rms = std::sqrt(ss / double(a.size()));
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max({worst, std::abs(double(a[i]) - b[i]), std::abs(double(a[i]) - c[i])});
  }
  // fp32 accumulations over <= a few hundred terms per layer, 4 layers: ~1e-6 relative per op;
  // 1e-4 of the logit RMS leaves room for growth through the layers and catches any real bug
  // (a wrong formula moves logits by O(RMS)).
  EXPECT_LT(worst, 1e-4 * rms) << "rms " << rms;
}

TEST_F(ModelTest, ThreadCountDoesNotChangeBits) {
  for (Precision prec : {Precision::BF16, Precision::FP32}) {
    ModelOptions o1, o2;
    o1.precision = o2.precision = prec;
    o1.threads = 1;
    o2.threads = 2;
    Model m1(dir(), o1), m2(dir(), o2);
    auto ids = prompt(20);
    auto a = run(m1, ids, 12), b = run(m2, ids, 12);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  }
}

TEST_F(ModelTest, OutOfRangeIdIsAnErrorAndLeavesStateUnchanged) {
  Model m(dir());
  SequenceState s = m.new_sequence();
  std::vector<int32_t> ids = {1, 2, 5000};
  std::vector<float> logits(size_t(m.config().vocab_size));
  EXPECT_THROW(m.forward(s, ids, logits.data(), false), Error);
  EXPECT_EQ(s.pos, 0);
  std::vector<int32_t> none;
  EXPECT_THROW(m.forward(s, none, logits.data(), false), Error);
}

}  // namespace
}  // namespace md
