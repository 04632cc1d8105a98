// The aux capture of the plan executors (StepOptions::aux, what a speculative verify hands the
// draft): for every token row of a step, the residual stream entering each listed layer. On the
// golden models (Kimi Linear tiny and small, Kimi K3 tiny with its block attention residuals:
// blocks of 2 layers, so ids 2 and 4 capture a block's partial sum at the boundary), BF16 and
// FP32, both CPU executors, batches of 3 sequences at different positions feeding
// different row counts per step: the captured rows equal, bit for bit, Model::forward's
// AuxCapture of the same tokens fed one token at a time. Then the checks made before anything
// changes (bad layer ids, no output buffer), a capture of no layers, the reference executor, and
// validate_plan's check of the residual-stream buffers the capture reads.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "exec/exec_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/exec/reference_executor.h"
#include "test_util.h"

namespace md {
namespace {

using test::opts;
using ::testing::HasSubstr;

std::string golden(const std::string& name) {
  return test::data_dir() + "/data/golden/" + name;
}

std::vector<int32_t> tokens(const Model& m, int n, int salt) {
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) ids[size_t(t)] = int32_t((salt * 131 + t * 17 + 5) % (V - 1));
  return ids;
}

// Every layer id 1 .. L - 1, not in ascending order (the capture keeps the order given), the
// last layer's input first as in the seed's draft configs.
std::vector<int> all_aux_layers(const Model& m) {
  const int L = m.config().num_layers;
  std::vector<int> ids = {L - 1};
  for (int l = 1; l < L - 1; ++l) ids.push_back(l);
  return ids;
}

// Model::forward one token at a time with its AuxCapture: [tokens][layers * hidden].
std::vector<float> forward_aux(Model& m, SequenceState& s, std::span<const int32_t> ids,
                               std::span<const int> layers) {
  const size_t width = layers.size() * size_t(m.config().hidden_size);
  std::vector<float> out(ids.size() * width);
  std::vector<float> logits(static_cast<size_t>(m.config().vocab_size));
  for (size_t t = 0; t < ids.size(); ++t) {
    const AuxCapture cap{layers, out.data() + t * width};
    m.forward(s, ids.subspan(t, 1), logits.data(), false, &cap);
  }
  return out;
}

struct Case {
  std::string model;
  Precision precision;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << (c.precision == Precision::BF16 ? " bf16" : " fp32");
}

class AuxCaptureTest : public ::testing::TestWithParam<Case> {};

TEST_P(AuxCaptureTest, MixedRowStepsEqualTokenByTokenForward) {
  const Case& c = GetParam();
  Model m(golden(c.model), opts(c.precision));
  const int64_t V = m.config().vocab_size, D = m.config().hidden_size;
  const std::vector<int> layers = all_aux_layers(m);
  const size_t width = layers.size() * size_t(D);
  const int B = 3;
  // Per step, each sequence's rows: decode rows beside a verify's 8 and a prefill chunk's 16.
  const std::vector<std::vector<int>> mixes = {{1, 5, 3}, {8, 1, 2}, {2, 16, 1}};
  const LogitRows kinds[B] = {LogitRows::kAll, LogitRows::kLast, LogitRows::kNone};
  for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
    SCOPED_TRACE(executor_name(kind));
    CpuExecutor ex(m, B, 2, kind);
    std::vector<SequenceState> ref, run;
    for (int b = 0; b < B; ++b) {
      SequenceState s = m.new_sequence();
      m.forward(s, tokens(m, 2 + 6 * b, 50 + b), nullptr, false);
      run.push_back(test::copy_of(ex, s));
      ref.push_back(std::move(s));
    }
    for (size_t step = 0; step < mixes.size(); ++step) {
      std::vector<std::vector<int32_t>> feed;
      std::vector<StepSeq> q;
      for (int b = 0; b < B; ++b)
        feed.push_back(tokens(m, mixes[step][size_t(b)], 60 + b + 5 * int(step)));
      for (int b = 0; b < B; ++b) q.push_back(StepSeq{&run[size_t(b)], feed[size_t(b)], kinds[b]});
      int n = 0;
      for (int r : mixes[step]) n += r;
      // NaN-filled: a row the executor does not write cannot pass for a reference row.
      std::vector<float> aux(size_t(n) * width, std::nanf(""));
      std::vector<float> logits(size_t(logit_row_count(q)) * size_t(V));
      StepOptions so;
      so.aux = {layers, aux.data()};
      so.keep_for_commit = step == 1;  // (the capture does not depend on it)
      ex.step(q, logits.data(), nullptr, {}, so);
      size_t row = 0;
      for (int b = 0; b < B; ++b) {
        const std::vector<float> want = forward_aux(m, ref[size_t(b)], feed[size_t(b)], layers);
        for (size_t i = 0; i < feed[size_t(b)].size(); ++i, ++row)
          for (size_t a = 0; a < layers.size(); ++a)
            test::expect_same_bits(aux.data() + row * width + a * size_t(D),
                                   want.data() + i * width + a * size_t(D), size_t(D),
                                   "step " + std::to_string(step) + " sequence " +
                                       std::to_string(b) + " row " + std::to_string(i) + " layer " +
                                       std::to_string(layers[a]));
      }
      ASSERT_EQ(row, size_t(n));
      // The rows say something: no two layers' captures of a row are the same stream.
      for (size_t a = 0; a + 1 < layers.size(); ++a)
        EXPECT_FALSE(test::same_bits(aux.data() + a * size_t(D), aux.data() + (a + 1) * size_t(D),
                                     size_t(D)))
            << "layers " << layers[a] << " and " << layers[a + 1] << " captured the same row";
    }
    for (int b = 0; b < B; ++b)
      test::expect_same_state(run[size_t(b)], ref[size_t(b)], "sequence " + std::to_string(b));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Golden, AuxCaptureTest,
    ::testing::Values(Case{"tiny", Precision::BF16}, Case{"tiny", Precision::FP32},
                      Case{"small", Precision::BF16}, Case{"small", Precision::FP32},
                      Case{"k3-tiny", Precision::BF16}, Case{"k3-tiny", Precision::FP32}),
    [](const auto& info) {
      std::string n =
          info.param.model + "_" + (info.param.precision == Precision::BF16 ? "bf16" : "fp32");
      for (char& ch : n)
        if (ch == '-') ch = '_';
      return n;
    });

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// Bad captures are md::Errors before anything changes (no sequence moves, the output buffer is
// untouched), on every executor behind the interface; a capture of no layers writes nothing.
TEST(AuxCaptureErrors, BadLayersOrNoBufferChangeNothing) {
  Model m(golden("tiny"), opts(Precision::BF16));
  const int64_t V = m.config().vocab_size, D = m.config().hidden_size;
  const int L = m.config().num_layers;
  std::vector<std::unique_ptr<Executor>> exs;
  ExecutorOptions eo;
  eo.workers = 2;
  exs.push_back(make_executor(m, ExecutorKind::kMegakernel, 2, eo));
  exs.push_back(make_executor(m, ExecutorKind::kOpByOp, 2, eo));
  exs.push_back(std::make_unique<ReferenceExecutor>(m, 2));
  const std::vector<int32_t> ids = tokens(m, 3, 7);
  for (auto& ex : exs) {
    SCOPED_TRACE(std::string(ex->name()));
    SequenceState a = ex->new_sequence(), b = ex->new_sequence();
    const StepSeq q[2] = {{&a, std::span(ids).subspan(0, 1)}, {&b, ids}};
    std::vector<float> logits(2 * size_t(V)), aux(4 * 2 * size_t(D), 7.0f);
    const std::vector<float> untouched = aux;
    const std::vector<std::vector<int>> bads = {{0}, {L}, {1, -1}, {2, L + 3}};
    for (const std::vector<int>& bad : bads) {
      StepOptions so;
      so.aux = {bad, aux.data()};
      EXPECT_THAT(error_of([&] { ex->step(q, logits.data(), nullptr, {}, so); }),
                  HasSubstr("is out of range 1 .. " + std::to_string(L - 1)));
    }
    const std::vector<int> good = {1, 2};
    StepOptions null_out;
    null_out.aux = {good, nullptr};
    EXPECT_THAT(error_of([&] { ex->step(q, logits.data(), nullptr, {}, null_out); }),
                HasSubstr("without an output buffer"));
    EXPECT_EQ(a.pos, 0);
    EXPECT_EQ(b.pos, 0);
    EXPECT_TRUE(test::same_bits(aux.data(), untouched.data(), aux.size()));
    // No layers: nothing captured, with or without a buffer.
    StepOptions none;
    none.aux = {{}, aux.data()};
    ex->step(q, logits.data(), nullptr, {}, none);
    EXPECT_TRUE(test::same_bits(aux.data(), untouched.data(), aux.size()));
    none.aux.out = nullptr;
    ex->step(q, logits.data(), nullptr, {}, none);
    EXPECT_EQ(b.pos, 6);
  }
}

// The reference executor (Model::forward behind the interface) captures the same rows as its
// Model::forward calls: decode rows of two sequences, in step order, equal the CPU executor's.
TEST(AuxCaptureReference, DecodeRowsEqualThePlanExecutors) {
  Model m(golden("k3-tiny"), opts(Precision::BF16));
  const int64_t V = m.config().vocab_size, D = m.config().hidden_size;
  const std::vector<int> layers = all_aux_layers(m);
  const size_t width = layers.size() * size_t(D);
  ReferenceExecutor re(m, 2);
  CpuExecutor ce(m, 2, 2, ExecutorKind::kMegakernel);
  Executor* exs[2] = {&re, &ce};
  std::vector<std::vector<float>> got;
  for (Executor* ex : exs) {
    // (Fresh sequences: a prefill of several rows is Model::forward's one-call prefill there,
    // another fp32 order.)
    SequenceState a = ex->new_sequence(), b = ex->new_sequence();
    std::vector<float> aux(2 * width * 3);
    for (int step = 0; step < 3; ++step) {
      const std::vector<int32_t> t = {int32_t(3 + step), int32_t(40 + step)};
      const StepSeq q[2] = {{&a, std::span(t).subspan(0, 1)}, {&b, std::span(t).subspan(1, 1)}};
      std::vector<float> logits(2 * size_t(V));
      StepOptions so;
      so.aux = {layers, aux.data() + size_t(step) * 2 * width};
      ex->step(q, logits.data(), nullptr, {}, so);
    }
    got.push_back(std::move(aux));
  }
  test::expect_same_bits(got[0].data(), got[1].data(), got[0].size(), "reference vs megakernel");
}

// validate_plan checks that the buffers the capture reads are the residual stream's.
TEST(AuxCapturePlan, ResidualBuffersAreValidated) {
  Model m(golden("k3-tiny"), opts(Precision::BF16));
  CpuExecutor ex(m, 2, 2, ExecutorKind::kMegakernel);
  plan::Plan p = ex.plan(2, 3);
  ASSERT_EQ(p.residual_buffer.size(), size_t(m.config().num_layers));
  EXPECT_THAT(plan::validate_plan(p), ::testing::IsEmpty());
  std::swap(p.residual_buffer[2], p.residual_buffer[3]);
  const std::vector<std::string> errs = plan::validate_plan(p);
  ASSERT_FALSE(errs.empty());
  EXPECT_THAT(errs[0], HasSubstr("layer 2: the residual-stream buffer is not what"));
  p.residual_buffer.pop_back();
  EXPECT_THAT(plan::validate_plan(p)[0], HasSubstr("residual-stream buffers for"));
}

}  // namespace
}  // namespace md
