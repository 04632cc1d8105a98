// Sampler and StopMatcher. The statistical tests compare sampled frequencies with probabilities
// computed independently here (full sort, double precision) and accept each bin with a Bernstein
// bound whose union over all bins fails with probability <= 1e-6 for a random seed; the seeds are
// fixed, so every run is the same run.
#include "megadecode/engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "megadecode/base/error.h"

namespace md {
namespace {

constexpr double kFalseFailure = 1e-6;

// Exact sampling distribution under the documented semantics: temperature, top-k, top-p (smallest
// sorted prefix reaching top_p), min-p (p >= min_p * p_max), renormalised.
std::vector<double> expected_probs(const std::vector<float>& logits, const SamplingParams& p) {
  const size_t V = logits.size();
  std::vector<size_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::vector<double> x(V);
  for (size_t i = 0; i < V; ++i) x[i] = double(logits[i]) / double(p.temperature);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return x[a] > x[b]; });
  size_t n = p.top_k > 0 ? std::min(V, size_t(p.top_k)) : V;
  double mx = x[order[0]], z = 0;
  for (size_t i = 0; i < n; ++i) z += std::exp(x[order[i]] - mx);
  if (p.top_p < 1.0f) {
    double cum = 0;
    for (size_t i = 0; i < n; ++i) {
      cum += std::exp(x[order[i]] - mx) / z;
      if (cum >= double(p.top_p)) {
        n = i + 1;
        break;
      }
    }
  }
  size_t m = 1;
  while (m < n && std::exp(x[order[m]] - mx) >= double(p.min_p)) ++m;
  n = m;
  std::vector<double> probs(V, 0.0);
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += std::exp(x[order[i]] - mx);
  for (size_t i = 0; i < n; ++i) probs[order[i]] = std::exp(x[order[i]] - mx) / s;
  return probs;
}

std::vector<int64_t> draw_counts(Sampler& s, const std::vector<float>& logits, int n) {
  std::vector<int64_t> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) ++counts[size_t(s.sample(logits, {}))];
  return counts;
}

// Each count is Binomial(n, p). Bernstein: P(|X - np| >= t) <= 2 exp(-t^2 / (2 (s2 + t/3))) with
// s2 = n p (1 - p); solving for a per-bin failure probability kFalseFailure / bins gives t below.
// Bins with p = 0 must be empty: those are the tokens the filters removed.
void expect_distribution(const std::vector<int64_t>& counts, const std::vector<double>& probs,
                         int n) {
  ASSERT_EQ(counts.size(), probs.size());
  const double L = std::log(2.0 * double(counts.size()) / kFalseFailure);
  for (size_t i = 0; i < counts.size(); ++i) {
    if (probs[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " should have been filtered out";
      continue;
    }
    double mean = n * probs[i], s2 = n * probs[i] * (1 - probs[i]);
    double t = L / 3 + std::sqrt(L * L / 9 + 2 * L * s2);
    EXPECT_LE(std::abs(double(counts[i]) - mean), t)
        << "token " << i << " p=" << probs[i] << " count=" << counts[i] << " expected " << mean;
  }
}

// Sums bins into groups, for large vocabularies.
std::vector<double> group(const std::vector<double>& v, size_t groups) {
  std::vector<double> g(groups, 0.0);
  for (size_t i = 0; i < v.size(); ++i) g[i * groups / v.size()] += v[i];
  return g;
}
std::vector<int64_t> group(const std::vector<int64_t>& v, size_t groups) {
  std::vector<int64_t> g(groups, 0);
  for (size_t i = 0; i < v.size(); ++i) g[i * groups / v.size()] += v[i];
  return g;
}

void check(const std::vector<float>& logits, const SamplingParams& p, int n = 20000) {
  Sampler s(p, int64_t(logits.size()));
  expect_distribution(draw_counts(s, logits, n), expected_probs(logits, p), n);
}

const std::vector<float> kSmall = {1.0f, 2.5f, -0.5f, 0.0f, 1.7f, 3.0f, -2.0f, 0.8f};

std::vector<float> random_logits(size_t V, double scale, uint64_t seed) {
  Rng r(seed);
  std::vector<float> v(V);
  for (auto& x : v) x = float(r.normal() * scale);
  return v;
}

TEST(Sampler, Temperature) {
  for (float t : {1.0f, 0.5f, 2.0f}) {
    SamplingParams p;
    p.temperature = t;
    p.seed = 11;
    SCOPED_TRACE(t);
    check(kSmall, p);
  }
}

TEST(Sampler, TopK) {
  SamplingParams p;
  p.top_k = 3;
  p.seed = 12;
  check(kSmall, p);
  // Ties at the cut go to the lower id: ids 1 and 4 tie for second place, k = 2 keeps 0 and 1.
  SamplingParams q;
  q.top_k = 2;
  q.seed = 13;
  check({5.0f, 4.0f, 1.0f, 0.0f, 4.0f}, q);
}

TEST(Sampler, TopKLargerThanHeapPath) {
  SamplingParams p;
  p.top_k = 1500;  // beyond the bounded-heap path: nth_element
  p.temperature = 0.8f;
  p.seed = 14;
  auto logits = random_logits(3000, 1.0, 99);
  Sampler s(p, 3000);
  expect_distribution(draw_counts(s, logits, 20000), expected_probs(logits, p), 20000);
}

TEST(Sampler, TopP) {
  for (float tp : {0.3f, 0.8f, 0.95f}) {
    SamplingParams p;
    p.top_p = tp;
    p.seed = 15;
    SCOPED_TRACE(tp);
    check(kSmall, p);
  }
}

TEST(Sampler, TopPLargeNucleus) {
  // A flat distribution whose nucleus holds ~3000 tokens, so the weighted selection recurses
  // several levels before the cut.
  SamplingParams p;
  p.top_p = 0.6f;
  p.seed = 16;
  auto logits = random_logits(5000, 0.05, 7);
  auto probs = expected_probs(logits, p);
  size_t kept = size_t(std::count_if(probs.begin(), probs.end(), [](double v) { return v > 0; }));
  EXPECT_GT(kept, 2000u);
  Sampler s(p, 5000);
  auto counts = draw_counts(s, logits, 10000);
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] == 0) {
      EXPECT_EQ(counts[i], 0) << i;
    }
  }
  expect_distribution(group(counts, 50), group(probs, 50), 10000);
}

TEST(Sampler, MinP) {
  for (float mp : {0.1f, 0.3f}) {
    SamplingParams p;
    p.min_p = mp;
    p.seed = 17;
    SCOPED_TRACE(mp);
    check(kSmall, p);
  }
}

TEST(Sampler, Combined) {
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 6;
  p.top_p = 0.9f;
  p.min_p = 0.05f;
  p.seed = 18;
  check({1.0f, 2.5f, -0.5f, 0.0f, 1.7f, 3.0f, -2.0f, 0.8f, 2.2f, 1.1f}, p);
}

TEST(Sampler, CombinedFullVocabulary) {
  const int64_t V = 163840;
  auto logits = random_logits(size_t(V), 3.0, 5);
  for (int k : {0, 40, 2000}) {
    SamplingParams p;
    p.temperature = 0.6f;
    p.top_k = k;
    p.top_p = 0.9f;
    p.min_p = 0.02f;
    p.seed = 19;
    SCOPED_TRACE(k);
    auto probs = expected_probs(logits, p);
    Sampler s(p, V);
    const int n = 600;
    auto counts = draw_counts(s, logits, n);
    for (size_t i = 0; i < probs.size(); ++i) {
      if (probs[i] == 0) {
        ASSERT_EQ(counts[i], 0) << i;
      }
    }
    // Only the kept tokens as bins.
    std::vector<int64_t> c;
    std::vector<double> q;
    for (size_t i = 0; i < probs.size(); ++i)
      if (probs[i] > 0) c.push_back(counts[i]), q.push_back(probs[i]);
    EXPECT_GE(q.size(), 5u) << "the filters should leave a few candidates";
    expect_distribution(c, q, n);
  }
}

TEST(Sampler, Penalties) {
  SamplingParams p;
  p.repetition_penalty = 1.5f;
  p.frequency_penalty = 0.25f;
  p.presence_penalty = 0.5f;
  Sampler s(p, 6);
  s.set_prompt_length(2);
  std::vector<int32_t> history = {0, 1, 2, 2, 3};  // prompt {0, 1}, output {2, 2, 3}
  std::vector<float> l = {2.0f, -1.0f, 0.5f, -3.0f, 1.0f, 0.0f};
  s.penalize(l, history);
  const std::vector<float> want = {2.0f / 1.5f,   // prompt id: repetition only
                                   -1.0f * 1.5f,  // negative prompt id: multiplied
                                   0.5f / 1.5f - 2 * 0.25f - 0.5f,  // output twice
                                   -3.0f * 1.5f - 0.25f - 0.5f,     // output once, negative
                                   1.0f,
                                   0.0f};  // unseen
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(l[i], want[i], 1e-6) << i;
}

TEST(Sampler, PenaltiesIncrementalAndImplicitPrompt) {
  SamplingParams p;
  p.frequency_penalty = 1.0f;
  p.presence_penalty = 0.5f;
  p.repetition_penalty = 1.2f;
  // The first call's history is the prompt; ids appended later are output.
  Sampler s(p, 4);
  std::vector<int32_t> h = {1, 1};
  std::vector<float> l(4, 1.0f);
  s.penalize(l, h);
  EXPECT_NEAR(l[1], 1.0f / 1.2f, 1e-6);  // prompt: repetition only
  EXPECT_EQ(l[0], 1.0f);
  h.push_back(0);
  h.push_back(0);
  h.push_back(1);
  std::fill(l.begin(), l.end(), 1.0f);
  s.penalize(l, h);
  EXPECT_NEAR(l[0], 1.0f / 1.2f - 2.0f - 0.5f, 1e-6);
  EXPECT_NEAR(l[1], 1.0f / 1.2f - 1.0f - 0.5f, 1e-6);
  EXPECT_EQ(l[2], 1.0f);
  // Greedy sees the penalised logits: id 0 would win without the presence penalty.
  SamplingParams g;
  g.temperature = 0;
  g.presence_penalty = 1.0f;
  Sampler gs(g, 2);
  gs.set_prompt_length(0);
  std::vector<int32_t> out = {0};
  EXPECT_EQ(gs.sample(std::vector<float>{3.0f, 2.5f}, out), 1);
}

TEST(Sampler, SeedDeterminism) {
  auto run = [](uint64_t seed) {
    SamplingParams p;
    p.seed = seed;
    p.top_p = 0.9f;
    Sampler s(p, 64);
    std::vector<int32_t> out;
    for (int i = 0; i < 200; ++i) out.push_back(s.sample(random_logits(64, 1.5, uint64_t(i)), {}));
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(Sampler, GreedyTiesAndEdgeValues) {
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p, 4);
  EXPECT_EQ(s.sample(std::vector<float>{1, 3, 3, 2}, {}), 1);
  EXPECT_EQ(s.sample(std::vector<float>{0, 0, 0, 0}, {}), 0);
  EXPECT_EQ(s.sample(std::vector<float>{-INFINITY, -INFINITY, -5, -INFINITY}, {}), 2);
  EXPECT_THROW(s.sample(std::vector<float>(4, -INFINITY), {}), Error);
  EXPECT_THROW(s.sample(std::vector<float>{0, NAN, 0, 0}, {}), Error);
  EXPECT_THROW(s.sample(std::vector<float>{0, 1, 2}, {}), Error);  // wrong size
  // Sampling never picks a -inf token.
  SamplingParams q;
  q.seed = 3;
  Sampler r(q, 4);
  for (int i = 0; i < 1000; ++i) EXPECT_NE(r.sample(std::vector<float>{0, -INFINITY, 0, 0}, {}), 1);
}

TEST(Sampler, InvalidParams) {
  struct Case {
    std::function<void(SamplingParams&)> set;
    const char* field;
  };
  const std::vector<Case> cases = {
      {[](auto& p) { p.temperature = -0.1f; }, "temperature"},
      {[](auto& p) { p.temperature = NAN; }, "temperature"},
      {[](auto& p) { p.top_k = -1; }, "top_k"},
      {[](auto& p) { p.top_p = 0.0f; }, "top_p"},
      {[](auto& p) { p.top_p = 1.5f; }, "top_p"},
      {[](auto& p) { p.min_p = -0.1f; }, "min_p"},
      {[](auto& p) { p.min_p = 1.1f; }, "min_p"},
      {[](auto& p) { p.repetition_penalty = 0.0f; }, "repetition_penalty"},
      {[](auto& p) { p.presence_penalty = 2.5f; }, "presence_penalty"},
      {[](auto& p) { p.frequency_penalty = -3.0f; }, "frequency_penalty"},
      {[](auto& p) { p.max_tokens = 0; }, "max_tokens"},
      {[](auto& p) { p.stop_token_ids = {-1}; }, "stop_token_ids"},
      {[](auto& p) { p.stop_strings = {""}; }, "stop_strings"},
  };
  for (const auto& c : cases) {
    SamplingParams p;
    c.set(p);
    try {
      p.validate();
      ADD_FAILURE() << "accepted bad " << c.field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.field), std::string::npos) << e.what();
    }
    EXPECT_THROW(Sampler(p, 10), Error) << c.field;
  }
  SamplingParams ok;
  EXPECT_NO_THROW(ok.validate());
  ok.stop_token_ids = {10};
  EXPECT_THROW(Sampler(ok, 10), Error);  // id beyond the vocabulary
  EXPECT_THROW(Sampler(SamplingParams{}, 0), Error);
  SamplingParams pen;
  pen.repetition_penalty = 1.1f;
  Sampler s(pen, 4);
  EXPECT_THROW(s.sample(std::vector<float>(4, 0.0f), std::vector<int32_t>{7}), Error);
}

// Feeds chunks and returns everything emitted, plus whether a stop was hit.
std::pair<std::string, bool> stream(StopMatcher& m, const std::vector<std::string>& chunks) {
  std::string out;
  bool stopped = false;
  for (const auto& c : chunks) {
    auto r = m.feed(c);
    out += r.text;
    stopped = stopped || r.stopped;
  }
  if (!stopped) out += m.flush();
  return {out, stopped};
}

TEST(StopMatcher, SplitAcrossChunks) {
  StopMatcher m({"STOP"});
  auto r1 = m.feed("hello ST");
  EXPECT_EQ(r1.text, "hello ");  // "ST" might begin the stop string
  EXPECT_FALSE(r1.stopped);
  auto r2 = m.feed("O");
  EXPECT_EQ(r2.text, "");
  auto r3 = m.feed("P and more");
  EXPECT_EQ(r3.text, "");
  EXPECT_TRUE(r3.stopped);
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.feed("later").text, "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, FalseStartIsReleased) {
  StopMatcher m({"STOP"});
  EXPECT_EQ(m.feed("a ST").text, "a ");
  auto r = m.feed("ART");
  EXPECT_EQ(r.text, "START");
  EXPECT_FALSE(r.stopped);
}

TEST(StopMatcher, OverlappingPrefixes) {
  // "aab" begins inside "aaab": the matcher must not lose the match after a false start.
  StopMatcher m({"aab"});
  auto [out, stopped] = stream(m, {"xa", "a", "a", "b", "tail"});
  EXPECT_TRUE(stopped);
  EXPECT_EQ(out, "xa");
  StopMatcher n({"abab"});
  auto [out2, stopped2] = stream(n, {"ab", "a", "bab"});
  EXPECT_TRUE(stopped2);
  EXPECT_EQ(out2, "");
}

TEST(StopMatcher, MultipleStops) {
  StopMatcher m({"</end>", "\n\n", "###"});
  auto [out, stopped] = stream(m, {"line one\n", "line two #", "## x"});
  EXPECT_TRUE(stopped);
  EXPECT_EQ(out, "line one\nline two ");
  // The stop that starts first in the text wins when both complete in the same chunk.
  StopMatcher n({"cd", "bcde"});
  EXPECT_EQ(n.matched(), "");
  auto r = n.feed("abcdef");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "a");
  EXPECT_EQ(n.matched(), "bcde");  // which one completed (the Messages API's stop_sequence)
  EXPECT_EQ(m.matched(), "###");
}

TEST(StopMatcher, NoFalseHoldBack) {
  StopMatcher m({"STOP"});
  auto r = m.feed("no stop here: S T O P");
  EXPECT_EQ(r.text, "no stop here: S T O P");  // nothing that can begin "STOP" at the end
  EXPECT_EQ(m.feed("...ST").text, "...");
  EXPECT_EQ(m.flush(), "ST");  // generation ended: held text comes out
  EXPECT_EQ(m.flush(), "");
  StopMatcher none({});
  EXPECT_EQ(none.feed("anything").text, "anything");
  EXPECT_THROW(StopMatcher({""}), Error);
}

TEST(StopMatcher, Utf8Stops) {
  StopMatcher m({"。结束"});
  auto [out, stopped] = stream(m, {"你好", "。", "结", "束了"});
  EXPECT_TRUE(stopped);
  EXPECT_EQ(out, "你好");
}

}  // namespace
}  // namespace md
