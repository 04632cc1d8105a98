// The acceptance rule (spec/acceptance.h) and the sampler's distribution it shares with plain
// sampling (engine/sampler.h): sample_row is draw_from(sample_distribution), the distribution's
// probabilities are those sample_row's draws follow, and speculative rejection sampling over
// synthetic rows emits tokens with exactly those probabilities (G-tests whose false-failure
// probability is below 1e-6 each; the seeds are fixed, so every run is the same run).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/base/xoshiro.h"
#include "megadecode/engine/sampler.h"
#include "megadecode/spec/acceptance.h"
#include "spec/stat_test.h"

namespace md {
namespace {

constexpr double kFalseFailure = 1e-6;

std::vector<float> random_logits(int rows, int V, uint64_t seed, float spread = 2.0f) {
  Xoshiro256 rng(seed);
  std::vector<float> l(size_t(rows) * size_t(V));
  for (float& x : l) x = float(rng.uniform(-spread, spread));
  return l;
}

std::map<int32_t, double> probabilities(const SampleDistribution& d) {
  std::map<int32_t, double> p;
  for (const auto& c : d.support) p[c.id] = d.probability(c.id);
  return p;
}

TEST(ChiSquare, TailMatchesKnownQuantiles) {
  // chi-square quantiles: (df 1, 3.841) -> 0.05; (df 10, 23.209) -> 0.01; (df 15, 30.578) ->
  // 0.01; (df 4, 0.711) -> 0.95.
  EXPECT_NEAR(test::chi_square_tail(3.841, 1), 0.05, 1e-4);
  EXPECT_NEAR(test::chi_square_tail(23.209, 10), 0.01, 1e-4);
  EXPECT_NEAR(test::chi_square_tail(30.578, 15), 0.01, 1e-4);
  EXPECT_NEAR(test::chi_square_tail(0.711, 4), 0.95, 1e-3);
}

TEST(SampleDistribution, SampleRowDrawsFromIt) {
  const int V = 300;
  const std::vector<float> logits = random_logits(1, V, 3);
  SampleScratch sc, sc2;
  std::vector<PenaltyCount> pen = {{5, 2}, {17, 0}, {250, 1}};
  for (int variant = 0; variant < 5; ++variant) {
    SampleRow row;
    row.temperature = variant == 0 ? 0.0f : 0.8f;
    row.top_k = variant == 2 ? 20 : variant == 4 ? 2000 : 0;
    row.top_p = variant == 3 ? 0.7f : 1.0f;
    row.min_p = variant == 4 ? 0.05f : 0.0f;
    row.repetition_penalty = 1.3f;
    row.presence_penalty = 0.5f;
    row.penalties = pen.data();
    row.num_penalties = uint32_t(pen.size());
    const SampleDistribution d = sample_distribution(row, logits, sc);
    double sum = 0;
    for (const auto& c : d.support) sum += d.probability(c.id);
    EXPECT_NEAR(sum, 1.0, 1e-12) << variant;
    Xoshiro256 rng(uint64_t(variant) + 10);
    for (int i = 0; i < 2000; ++i) {
      row.uniform = rng.uniform();
      const int32_t t = sample_row(row, logits, sc2);
      EXPECT_EQ(t, draw_from(d, row.uniform)) << variant;
      EXPECT_GT(d.probability(t), 0.0);
      const int32_t r = draw_from(d, row.uniform, t);
      if (d.support.size() > 1) {
        EXPECT_NE(r, t);
      }
    }
  }
}

TEST(SampleDistribution, DrawFrequenciesFollowTheProbabilities) {
  const int V = 50;
  const std::vector<float> logits = random_logits(1, V, 4);
  SampleScratch sc;
  SampleRow row;
  row.temperature = 1.0f;
  row.top_p = 0.9f;
  const SampleDistribution d = sample_distribution(row, logits, sc);
  const std::map<int32_t, double> p = probabilities(d);
  // The residual with the most likely token removed, renormalised.
  int32_t top = d.support[0].id;
  for (const auto& c : d.support)
    if (d.probability(c.id) > d.probability(top)) top = c.id;
  std::map<int32_t, double> residual;
  for (const auto& [id, q] : p)
    if (id != top) residual[id] = q / (1.0 - p.at(top));
  std::map<int32_t, long> seen, seen_residual;
  Xoshiro256 rng(5);
  for (int i = 0; i < 200000; ++i) {
    ++seen[draw_from(d, rng.uniform())];
    ++seen_residual[draw_from(d, rng.uniform(), top)];
  }
  const test::FitResult a = test::g_test(seen, p), b = test::g_test(seen_residual, residual);
  EXPECT_GT(a.p_value, kFalseFailure) << "G " << a.g << " df " << a.df << " " << a.problem;
  EXPECT_GT(b.p_value, kFalseFailure) << "G " << b.g << " df " << b.df << " " << b.problem;
}

TEST(Acceptance, GreedyAcceptsTheLeadingAgreeingDrafts) {
  const std::vector<int32_t> drafts = {4, 5, 6};
  EXPECT_EQ(accept_greedy(drafts, std::vector<int32_t>{4, 5, 6, 7}).accepted, 3);
  EXPECT_EQ(accept_greedy(drafts, std::vector<int32_t>{4, 5, 6, 7}).token, 7);
  const Acceptance a = accept_greedy(drafts, std::vector<int32_t>{4, 9, 6, 7});
  EXPECT_EQ(a.accepted, 1);
  EXPECT_EQ(a.token, 9);
  EXPECT_EQ(accept_greedy(drafts, std::vector<int32_t>{1, 5, 6, 7}).accepted, 0);
  // Forced: the count whatever the choices; the token is the choice after them.
  const Acceptance f = accept_greedy(drafts, std::vector<int32_t>{1, 2, 3, 8}, 2);
  EXPECT_EQ(f.accepted, 2);
  EXPECT_EQ(f.token, 3);
  EXPECT_THROW(accept_greedy(drafts, std::vector<int32_t>{1, 2}), Error);
  EXPECT_THROW(accept_greedy(drafts, std::vector<int32_t>{1, 2, 3, 4}, 4), Error);
}

TEST(Acceptance, SampledGreedyRowsMatchAcceptGreedy) {
  const int V = 64, K = 4;
  const std::vector<float> logits = random_logits(K + 1, V, 6);
  std::vector<int32_t> choices(K + 1);
  SampleScratch sc;
  for (int i = 0; i <= K; ++i)
    choices[size_t(i)] = sample_row(SampleRow{}, std::span(logits).subspan(size_t(i * V), V), sc);
  for (int agree = 0; agree <= K; ++agree) {
    std::vector<int32_t> drafts(choices.begin(), choices.begin() + K);
    if (agree < K) drafts[size_t(agree)] = (drafts[size_t(agree)] + 1) % V;
    int draws = 0;
    const Acceptance a = accept_sampled(
        drafts, logits, [](int) { return SampleRow{}; },
        [&] {
          ++draws;
          return 0.5;
        },
        sc);
    const Acceptance g = accept_greedy(drafts, choices);
    EXPECT_EQ(a.accepted, g.accepted);
    EXPECT_EQ(a.token, g.token);
    EXPECT_EQ(draws, 0) << "greedy rows take no uniforms";
  }
}

// Rejection sampling over synthetic rows: the first emitted token follows p_0; given that the
// first draft was accepted, the second follows p_1; with everything accepted the bonus follows
// p_2. A wrong rule (accepting drafts always, or drawing the correction from p without removing
// the draft) moves these frequencies far beyond the bound.
TEST(Acceptance, RejectionSamplingEmitsThePlainDistribution) {
  const int V = 12, K = 2;
  const std::vector<float> logits = random_logits(K + 1, V, 7, 1.5f);
  SampleRow row;
  row.temperature = 0.9f;
  row.top_k = 6;
  SampleScratch sc;
  std::vector<std::map<int32_t, double>> p;
  std::vector<int32_t> best;
  for (int i = 0; i <= K; ++i) {
    const SampleDistribution d =
        sample_distribution(row, std::span(logits).subspan(size_t(i * V), V), sc);
    p.push_back(probabilities(d));
    int32_t b = d.support[0].id;
    for (const auto& c : d.support)
      if (d.probability(c.id) > d.probability(b)) b = c.id;
    best.push_back(b);
  }
  // Drafts: row 0's most likely token, then a token row 1 gives some mass but not the most.
  int32_t second = -1;
  for (const auto& [id, q] : p[1])
    if (id != best[1] && (second < 0 || q > p[1].at(second))) second = id;
  const std::vector<int32_t> drafts = {best[0], second};
  std::map<int32_t, long> first, after_accept, bonus;
  Xoshiro256 rng(8);
  for (int i = 0; i < 150000; ++i) {
    const Acceptance a = accept_sampled(
        drafts, logits, [&](int) { return row; }, [&] { return rng.uniform(); }, sc);
    ++first[a.accepted >= 1 ? drafts[0] : a.token];
    if (a.accepted >= 1) ++after_accept[a.accepted >= 2 ? drafts[1] : a.token];
    if (a.accepted == 2) ++bonus[a.token];
  }
  for (const auto& [name, seen, want] :
       {std::tuple{"first", &first, &p[0]}, std::tuple{"second", &after_accept, &p[1]},
        std::tuple{"bonus", &bonus, &p[2]}}) {
    const test::FitResult f = test::g_test(*seen, *want);
    EXPECT_GT(f.p_value, kFalseFailure)
        << name << ": G " << f.g << " df " << f.df << " " << f.problem;
  }
}

TEST(Acceptance, ForcedLengthSamplesTheTokenAfterTheForcedDrafts) {
  const int V = 20, K = 3;
  const std::vector<float> logits = random_logits(K + 1, V, 9);
  SampleRow row;
  row.temperature = 1.0f;
  SampleScratch sc;
  const std::vector<int32_t> drafts = {1, 2, 3};
  for (int f = 0; f <= K; ++f) {
    const Acceptance a = accept_sampled(
        drafts, logits, [&](int) { return row; }, [] { return 0.25; }, sc, f);
    EXPECT_EQ(a.accepted, f);
    const SampleDistribution d =
        sample_distribution(row, std::span(logits).subspan(size_t(f * V), V), sc);
    EXPECT_EQ(a.token, draw_from(d, 0.25));
  }
}

}  // namespace
}  // namespace md
