// Multi-row steps: every sequence feeds R consecutive token rows in one plan step (a prefill
// chunk, a speculative verify). Checked on the golden models (Kimi Linear tiny and small, Kimi K3
// tiny), both precisions and both executors:
//  * a prompt fed in chunks of R = 1, 3, 8, 16 gives, at every position, bit for bit the logits
//    (and at the end the states) of the reference path fed one token at a time; chunks of 32
//    (the KDA cores' chunked form) and every chunking agree with the reference path's one-call
//    prefill within the golden fp32 bound (1e-4 of the logits' RMS) in FP32;
//  * R-row steps of several sequences at once equal their single-sequence runs;
//  * after an 8-row step, committing to k = 0..8 rows and decoding on gives exactly what a run
//    that fed only those k tokens gives (states and greedy tokens);
//  * bad step shapes and commits are md::Errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "exec/exec_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/cpu_executor.h"
#include "test_util.h"

namespace md {
namespace {

using test::expect_same_state;
using test::opts;
using test::same_bits;
using ::testing::HasSubstr;

std::string golden(const std::string& name) {
  return test::data_dir() + "/data/golden/" + name;
}

std::vector<int32_t> prompt(const Model& m, int n, int salt) {
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) ids[size_t(t)] = int32_t((salt * 131 + t * 17 + 5) % (V - 1));
  return ids;
}

// The reference path one token at a time: [T][V] logits and the final state.
std::vector<float> reference_stepwise(Model& m, const std::vector<int32_t>& ids,
                                      SequenceState* out = nullptr) {
  const int64_t V = m.config().vocab_size;
  SequenceState s = m.new_sequence();
  std::vector<float> logits(ids.size() * size_t(V));
  for (size_t t = 0; t < ids.size(); ++t)
    m.forward(s, std::span(&ids[t], 1), logits.data() + t * size_t(V), false);
  if (out) *out = std::move(s);
  return logits;
}

// The plan in chunks of R rows (the last chunk shorter), logits of every row.
std::vector<float> plan_chunks(CpuExecutor& ex, Model& m, const std::vector<int32_t>& ids, int R,
                               SequenceState* out = nullptr) {
  const int64_t V = m.config().vocab_size;
  SequenceState s = ex.new_sequence();
  std::vector<float> logits(ids.size() * size_t(V));
  for (size_t t = 0; t < ids.size(); t += size_t(R)) {
    const size_t n = std::min(ids.size() - t, size_t(R));
    const StepSeq q{&s, std::span(ids).subspan(t, n), LogitRows::kAll};
    ex.step(std::span(&q, 1), logits.data() + t * size_t(V));
  }
  EXPECT_EQ(s.pos, int64_t(ids.size()));
  if (out) *out = std::move(s);
  return logits;
}

// Worst |a - b| per position over 1e-4 x the position's RMS of b (<= 1: within the bound).
double worst_over_bound(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  double worst = 0;
  for (size_t p = 0; p < b.size() / size_t(V); ++p) {
    double ss = 0, d = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double x = b[p * size_t(V) + size_t(v)];
      ss += x * x;
      d = std::max(d, std::fabs(double(a[p * size_t(V) + size_t(v)]) - x));
    }
    worst = std::max(worst, d / (1e-4 * std::sqrt(ss / double(V))));
  }
  return worst;
}

struct Case {
  std::string model;
  Precision precision;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << (c.precision == Precision::BF16 ? " bf16" : " fp32");
}

class MultiRow : public ::testing::TestWithParam<Case> {};

TEST_P(MultiRow, ChunksEqualTheReferenceAtEveryPosition) {
  const Case& c = GetParam();
  Model m(golden(c.model), opts(c.precision));
  const int64_t V = m.config().vocab_size;
  const std::vector<int32_t> ids = prompt(m, 37, 1);
  SequenceState ref_state;
  const std::vector<float> ref = reference_stepwise(m, ids, &ref_state);
  // The reference's one-call prefill (chunked KDA form, explicit-key MLA): same math, other
  // fp32 order.
  std::vector<float> pre(ids.size() * size_t(V));
  {
    SequenceState s = m.new_sequence();
    m.forward(s, ids, pre.data(), true);
  }
  for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
    CpuExecutor ex(m, 4, 2, kind);
    for (int R : {1, 3, 8, 16, 32}) {
      SCOPED_TRACE(std::string(executor_name(kind)) + " R=" + std::to_string(R));
      SequenceState st;
      const std::vector<float> got = plan_chunks(ex, m, ids, R, &st);
      if (R <= 16) {
        for (size_t t = 0; t < ids.size(); ++t)
          EXPECT_TRUE(same_bits(got.data() + t * size_t(V), ref.data() + t * size_t(V), size_t(V)))
              << "position " << t;
        expect_same_state(st, ref_state, "final state");
      }
      if (c.precision == Precision::FP32) {
        EXPECT_LE(worst_over_bound(got, pre, V), 1.0);
      }
    }
  }
  // Three workers with the MLA attention split over the cache rows (flash-decoding partials and
  // a merge per row): the executors agree bit for bit; with the reference, fp32 order only.
  ExecutorOptions eo;
  eo.workers = 3;
  eo.plan.mla_kv_splits = 2;
  CpuExecutor mk(m, 1, ExecutorKind::kMegakernel, eo), ob(m, 1, ExecutorKind::kOpByOp, eo);
  const std::vector<float> a = plan_chunks(mk, m, ids, 8), b = plan_chunks(ob, m, ids, 8);
  EXPECT_TRUE(same_bits(a.data(), b.data(), a.size()));
  if (c.precision == Precision::FP32) {
    EXPECT_LE(worst_over_bound(a, ref, V), 1.0);
  }
}

TEST_P(MultiRow, SeveralSequencesEqualTheirSingleRuns) {
  const Case& c = GetParam();
  Model m(golden(c.model), opts(c.precision));
  const int64_t V = m.config().vocab_size;
  const int R = 4, B = 3;
  CpuExecutor ex(m, B, 2, ExecutorKind::kMegakernel);
  // Sequences at different positions (prefilled on the reference path), then two R-row steps.
  std::vector<SequenceState> batch, alone;
  std::vector<std::vector<int32_t>> feed;
  for (int b = 0; b < B; ++b) {
    SequenceState s = m.new_sequence();
    const std::vector<int32_t> p = prompt(m, 3 + 5 * b, 10 + b);
    m.forward(s, p, nullptr, false);
    batch.push_back(test::copy_of(ex, s));
    alone.push_back(test::copy_of(ex, s));
    feed.push_back(prompt(m, 2 * R, 20 + b));
  }
  for (int step = 0; step < 2; ++step) {
    std::vector<StepSeq> q;
    for (int b = 0; b < B; ++b)
      q.push_back(StepSeq{&batch[size_t(b)],
                          std::span(feed[size_t(b)]).subspan(size_t(step * R), R),
                          b == 1 ? LogitRows::kLast : LogitRows::kAll});
    ASSERT_EQ(logit_row_count(q), R + 1 + R);
    std::vector<float> lb(size_t(logit_row_count(q)) * size_t(V));
    std::vector<int32_t> next(size_t(logit_row_count(q)));
    ex.step(q, lb.data(), next.data());
    size_t row = 0;
    for (int b = 0; b < B; ++b) {
      const StepSeq one{&alone[size_t(b)], q[size_t(b)].tokens, q[size_t(b)].logits};
      std::vector<float> la(size_t(logit_row_count(std::span(&one, 1))) * size_t(V));
      ex.step(std::span(&one, 1), la.data());
      for (size_t j = 0; j < la.size() / size_t(V); ++j, ++row) {
        EXPECT_TRUE(same_bits(la.data() + j * size_t(V), lb.data() + row * size_t(V), size_t(V)))
            << "step " << step << " sequence " << b << " logit row " << j;
        // The in-plan greedy sample of each logit row is its argmax (ties to the lowest id).
        const float* r = lb.data() + row * size_t(V);
        EXPECT_EQ(next[row], int32_t(std::max_element(r, r + V) - r));
      }
    }
  }
  for (int b = 0; b < B; ++b)
    expect_same_state(batch[size_t(b)], alone[size_t(b)], "sequence " + std::to_string(b));
}

// Sequences feeding different row counts in one step (decode rows beside prefill chunks, a
// verify, the chunked KDA form above 16 rows): each equals its single-sequence run bit for bit,
// and a kept mixed step commits each sequence to its own prefix.
TEST_P(MultiRow, MixedRowCountsEqualTheirSingleRuns) {
  const Case& c = GetParam();
  Model m(golden(c.model), opts(c.precision));
  const int64_t V = m.config().vocab_size;
  const int B = 4;
  CpuExecutor ex(m, B, 2, ExecutorKind::kMegakernel);
  CpuExecutor ob(m, B, 2, ExecutorKind::kOpByOp);
  std::vector<SequenceState> batch, alone, batch_ob;
  for (int b = 0; b < B; ++b) {
    SequenceState s = m.new_sequence();
    m.forward(s, prompt(m, 2 + 7 * b, 30 + b), nullptr, false);
    batch.push_back(test::copy_of(ex, s));
    alone.push_back(test::copy_of(ex, s));
    batch_ob.push_back(test::copy_of(ob, s));
  }
  const std::vector<std::vector<int>> mixes = {{1, 5, 16, 3}, {24, 1, 1, 8}, {2, 1, 9, 1}};
  for (size_t step = 0; step < mixes.size(); ++step) {
    const bool keep = step == 2;  // the last step is kept and committed
    std::vector<std::vector<int32_t>> feed;
    std::vector<StepSeq> q, qo;
    for (int b = 0; b < B; ++b)
      feed.push_back(prompt(m, mixes[step][size_t(b)], 40 + b + 7 * int(step)));
    for (int b = 0; b < B; ++b) {
      const LogitRows lr = b % 2 ? LogitRows::kLast : LogitRows::kAll;
      q.push_back(StepSeq{&batch[size_t(b)], feed[size_t(b)], lr});
      qo.push_back(StepSeq{&batch_ob[size_t(b)], feed[size_t(b)], lr});
    }
    StepOptions so;
    so.keep_for_commit = keep;
    std::vector<float> lb(size_t(logit_row_count(q)) * size_t(V)), lo(lb.size());
    std::vector<int32_t> next(size_t(logit_row_count(q)));
    ex.step(q, lb.data(), next.data(), {}, so);
    ob.step(qo, lo.data(), nullptr, {}, so);
    EXPECT_TRUE(same_bits(lb.data(), lo.data(), lb.size()))
        << "megakernel vs opbyop, step " << step;
    EXPECT_EQ(ex.last_step_stats().token_rows,
              std::accumulate(mixes[step].begin(), mixes[step].end(), 0));
    size_t row = 0;
    for (int b = 0; b < B; ++b) {
      const StepSeq one{&alone[size_t(b)], feed[size_t(b)], q[size_t(b)].logits};
      std::vector<float> la(size_t(logit_row_count(std::span(&one, 1))) * size_t(V));
      ex.step(std::span(&one, 1), la.data(), nullptr, {}, so);
      for (size_t j = 0; j < la.size() / size_t(V); ++j, ++row) {
        EXPECT_TRUE(same_bits(la.data() + j * size_t(V), lb.data() + row * size_t(V), size_t(V)))
            << "step " << step << " sequence " << b << " logit row " << j;
        const float* r = lb.data() + row * size_t(V);
        EXPECT_EQ(next[row], int32_t(std::max_element(r, r + V) - r));
      }
      if (keep) {
        const int k = (b * 3) % (mixes[step][size_t(b)] + 1);
        ex.commit(batch[size_t(b)], k);
        ex.commit(alone[size_t(b)], k);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    expect_same_state(batch[size_t(b)], alone[size_t(b)], "sequence " + std::to_string(b));
    // One more decode row each, batched vs alone, after the commits.
    int32_t t = 5;
    std::vector<float> x(static_cast<size_t>(V)), y(static_cast<size_t>(V));
    SequenceState* pa = &batch[size_t(b)];
    SequenceState* pb = &alone[size_t(b)];
    ex.step(std::span(&pa, 1), std::span(&t, 1), x.data());
    ex.step(std::span(&pb, 1), std::span(&t, 1), y.data());
    EXPECT_TRUE(same_bits(x.data(), y.data(), x.size())) << "after the commit, sequence " << b;
  }
}

TEST_P(MultiRow, CommitToEveryPrefix) {
  const Case& c = GetParam();
  Model m(golden(c.model), opts(c.precision));
  const int64_t V = m.config().vocab_size;
  const int R = 8;
  const std::vector<int32_t> ctx = prompt(m, 11, 2), draft = prompt(m, R, 3);
  for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
    CpuExecutor ex(m, 1, 2, kind);
    SequenceState base = m.new_sequence();
    m.forward(base, ctx, nullptr, false);
    for (int k = 0; k <= R; ++k) {
      SCOPED_TRACE(std::string(executor_name(kind)) + " k=" + std::to_string(k));
      // The verify step, then the commit.
      SequenceState s = test::copy_of(ex, base);
      const StepSeq q{&s, draft, LogitRows::kAll};
      std::vector<float> logits(size_t(R) * size_t(V));
      StepOptions so;
      so.keep_for_commit = true;
      ex.step(std::span(&q, 1), logits.data(), nullptr, {}, so);
      ex.commit(s, k);
      // A run that fed only the k tokens (through the plan, one row per step).
      SequenceState want = test::copy_of(ex, base);
      for (int i = 0; i < k; ++i) {
        std::vector<float> l(static_cast<size_t>(V));
        SequenceState* p = &want;
        ex.step(std::span(&p, 1), std::span(&draft[size_t(i)], 1), l.data());
      }
      expect_same_state(s, want, "after the commit");
      // Decoding on: the same greedy tokens and logits.
      int32_t ta = draft[0], tb = draft[0];
      for (int t = 0; t < 4; ++t) {
        std::vector<float> la(static_cast<size_t>(V)), lb(static_cast<size_t>(V));
        int32_t na = -1, nb = -1;
        SequenceState* pa = &s;
        SequenceState* pb = &want;
        ex.step(std::span(&pa, 1), std::span(&ta, 1), la.data(), &na);
        ex.step(std::span(&pb, 1), std::span(&tb, 1), lb.data(), &nb);
        ASSERT_TRUE(same_bits(la.data(), lb.data(), size_t(V))) << "decode step " << t;
        ASSERT_EQ(na, nb);
        ta = na;
        tb = nb;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Golden, MultiRow,
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

TEST(MultiRowErrors, BadShapesAndCommits) {
  Model m(golden("tiny"), opts(Precision::BF16));
  CpuExecutor ex(m, 2, 1, ExecutorKind::kMegakernel);
  const int64_t V = m.config().vocab_size;
  std::vector<float> logits(size_t(80) * size_t(V));
  SequenceState a = ex.new_sequence(), b = ex.new_sequence();
  const std::vector<int32_t> ids = prompt(m, 70, 4);
  auto error_of = [&](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  // A sequence with no rows beside one with rows.
  {
    const StepSeq q[2] = {{&a, std::span(ids).subspan(0, 3)}, {&b, {}}};
    EXPECT_THAT(error_of([&] { ex.step(q, logits.data()); }), HasSubstr("sequence 1 feeds no"));
  }
  // Too many rows; no rows.
  {
    const StepSeq q{&a, std::span(ids).subspan(0, 65)};
    EXPECT_THAT(error_of([&] { ex.step(std::span(&q, 1), logits.data()); }),
                HasSubstr("outside 1..64"));
    const StepSeq e{&a, {}};
    EXPECT_THAT(error_of([&] { ex.step(std::span(&e, 1), logits.data()); }),
                HasSubstr("outside 1..64"));
  }
  // A kept step takes at most 16 rows.
  {
    const StepSeq q{&a, std::span(ids).subspan(0, 17)};
    StepOptions so;
    so.keep_for_commit = true;
    EXPECT_THAT(error_of([&] { ex.step(std::span(&q, 1), logits.data(), nullptr, {}, so); }),
                HasSubstr("at most 16 rows"));
  }
  EXPECT_EQ(a.pos, 0);  // nothing ran
  // Commits: without a kept step, beyond its rows, twice, after the sequence moved on.
  EXPECT_THAT(error_of([&] { ex.commit(a, 0); }), HasSubstr("kept no row log"));
  {
    const StepSeq q{&a, std::span(ids).subspan(0, 4), LogitRows::kNone};
    StepOptions so;
    so.keep_for_commit = true;
    ex.step(std::span(&q, 1), nullptr, nullptr, {}, so);
    EXPECT_THAT(error_of([&] { ex.commit(a, 5); }), HasSubstr("5 rows of a step of 4"));
    ex.commit(a, 2);
    EXPECT_EQ(a.pos, 2);
    EXPECT_THAT(error_of([&] { ex.commit(a, 1); }), HasSubstr("already committed"));
  }
  // Sampling specs must match the logit rows.
  {
    const StepSeq q{&b, std::span(ids).subspan(0, 3), LogitRows::kAll};
    const SampleRow spec{};
    EXPECT_THAT(
        error_of([&] { ex.step(std::span(&q, 1), logits.data(), nullptr, std::span(&spec, 1)); }),
        HasSubstr("1 sampling specs for 3 logit rows"));
  }
  // A prefill chunk size out of range.
  EXPECT_THAT(error_of([&] { ex.prefill(b, ids, logits.data(), 65); }), HasSubstr("chunk 65"));
}

}  // namespace
}  // namespace md
