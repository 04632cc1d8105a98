// Kimi K3 through the reference forward path on a random k3-small checkpoint: prefill vs decode,
// thread counts, bf16 vs fp32. (Agreement with the float64 reference is in test_golden_k3.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "megadecode/engine/model.h"
#include "megadecode/model/presets.h"
#include "test_util.h"

namespace md {
namespace {

class ModelK3Test : public ::testing::Test {
 protected:
  static std::string dir() { return test::shared_checkpoint("k3-small", 7, 2); }

  static std::vector<float> run(Model& m, const std::vector<int32_t>& ids, int p) {
    const int64_t V = m.config().vocab_size;
    std::vector<float> out(ids.size() * size_t(V));
    SequenceState s = m.new_sequence();
    if (p > 0) m.forward(s, std::span(ids.data(), size_t(p)), out.data(), true);
    for (size_t i = size_t(p); i < ids.size(); ++i)
      m.forward(s, std::span(ids.data() + i, 1), out.data() + i * size_t(V), false);
    return out;
  }
};

std::vector<int32_t> prompt(int n) {
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = (i * 53 + 7) % 1700;
  return ids;
}

double rms(const std::vector<float>& v) {
  double ss = 0;
  for (float x : v) ss += double(x) * x;
  return std::sqrt(ss / double(v.size()));
}

TEST_F(ModelK3Test, PrefillEqualsDecodeInFp32) {
  // 70 tokens cross the 64-token KDA chunk and 8 layers with block size 3 take snapshots at
  // layers 0, 3, 6: the chunked and recurrent KDA, explicit and absorbed MLA, and the
  // per-position attention-residual mixes agree up to fp32 reassociation (same bound and
  // reasoning as the Kimi Linear test: 1e-4 of the logit RMS).
  ModelOptions o;
  o.precision = Precision::FP32;
  Model m(dir(), o);
  auto ids = prompt(70);
  auto a = run(m, ids, 70), b = run(m, ids, 0), c = run(m, ids, 33);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max({worst, std::abs(double(a[i]) - b[i]), std::abs(double(a[i]) - c[i])});
  EXPECT_LT(worst, 1e-4 * rms(a));
}

TEST_F(ModelK3Test, ThreadCountDoesNotChangeBits) {
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

TEST_F(ModelK3Test, Bf16LogitsAreFiniteBf16Values) {
  // No distance bound between bf16 and fp32 here: random K3 checkpoints are ill-conditioned
  // (KDA outputs of nearly orthogonal q and k fall below the gated norm's sqrt(eps)), so bf16
  // rounding alone moves their logits by tens of percent; see test_golden_k3.cpp, which bounds
  // the bf16 error through the measured conditioning of the golden checkpoint.
  ModelOptions o16;
  Model m16(dir(), o16);
  auto ids = prompt(24);
  auto b = run(m16, ids, 16);
  for (float x : b) {
    ASSERT_TRUE(std::isfinite(x));
    ASSERT_EQ(x, round_bf16(x));
  }
}

}  // namespace
}  // namespace md
