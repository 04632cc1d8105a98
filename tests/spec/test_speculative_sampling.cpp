// Speculative sampling through the loop (spec/speculative.h) emits plain sampling's
// distribution: on the tiny golden model, from a fixed prompt and anchor, the joint distribution
// of the first two emitted tokens over many seeds is G-tested against the exact plain-sampling
// probabilities p(t1) p(t2 | t1), computed from the plan's decode steps with the same
// sample_distribution, with and without penalties (whose counts must include the drafts). The
// drafts are likely tokens (accepted about a third of the time), so both the acceptance and the
// correction paths carry mass. False-failure probability below 1e-6 per case (the seeds are
// fixed, so every run is the same run). And the Generator: greedy speculative generation equals
// plain generation (with penalties too), sampled speculative generation is reproducible.
#include <gtest/gtest.h>

#include <map>
#include <utility>
#include <vector>

#include "exec/exec_test_util.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/spec/ngram_drafter.h"
#include "megadecode/spec/speculative.h"
#include "megadecode/text/generator.h"
#include "spec/stat_test.h"
#include "test_util.h"

namespace md {
namespace {

using Pair = std::pair<int32_t, int32_t>;

int32_t mode(const std::map<int32_t, double>& p) {
  int32_t best = p.begin()->first;
  for (const auto& [id, q] : p)
    if (q > p.at(best)) best = id;
  return best;
}

// Proposes from a table keyed by the context's length and last token: deterministic in the
// context, as the acceptance rule requires.
class TableDrafter : public Drafter {
 public:
  std::map<std::pair<size_t, int32_t>, std::vector<int32_t>> table;
  std::string_view name() const override { return "table"; }
  void reset() override {}
  void observe(std::span<const int32_t>, int64_t, std::span<const float>) override {}
  void propose(std::span<const int32_t> context, std::span<int32_t> out) override {
    auto it = table.find({context.size(), context.back()});
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = it != table.end() && i < it->second.size() ? it->second[i] : context.back();
  }
};

std::map<int32_t, double> distribution(const SamplingParams& sp, int64_t V, size_t prompt_len,
                                       const std::vector<int32_t>& history,
                                       const std::vector<float>& logits) {
  Sampler s(sp, V);
  s.set_prompt_length(prompt_len);
  SampleScratch sc;
  const SampleDistribution d = sample_distribution(s.prepare_without_draw(history), logits, sc);
  std::map<int32_t, double> p;
  for (const auto& c : d.support) p[c.id] = d.probability(c.id);
  return p;
}

// repeat_draft: pick the anchor and first draft d1 so that, had row 1's penalties left d1 out,
// d1 would keep a large probability there (a model about to repeat itself): then a loop that
// counted the penalties over the history without the drafts would emit d1 twice far too often.
void check_two_token_distribution(const SamplingParams& sp, int runs, bool repeat_draft) {
  Model m(test::data_dir() + "/data/golden/tiny", test::opts(Precision::BF16));
  const int64_t V = m.config().vocab_size;
  CpuExecutor ex(m, 1, 2, ExecutorKind::kMegakernel);
  const std::vector<int32_t> prompt = {11, 200, 37, 512, 9, 77, 300, 5};
  std::vector<float> logits(static_cast<size_t>(V));
  SequenceState base = ex.new_sequence();
  ex.prefill(base, prompt, logits.data());
  SequenceState s0 = ex.new_sequence(), s1 = ex.new_sequence();
  auto feed = [&](SequenceState& s, int32_t t) {
    SequenceState* p = &s;
    ex.step(std::span(&p, 1), std::span(&t, 1), logits.data());
  };

  int32_t anchor = 40, d1 = -1;
  std::map<int32_t, double> p0;
  for (int32_t a = 40; a < 400 && d1 < 0; ++a) {
    anchor = a;
    s0.copy_from(base);
    feed(s0, a);
    std::vector<int32_t> h0 = prompt;
    h0.push_back(a);
    p0 = distribution(sp, V, prompt.size(), h0, logits);
    if (!repeat_draft) {
      d1 = mode(p0);
      break;
    }
    for (const auto& [t, q] : p0) {
      if (q < 0.15) continue;
      s1.copy_from(s0);
      feed(s1, t);
      // Row 1's distribution with d1 = t left out of the penalty counts.
      const std::map<int32_t, double> wrong = distribution(sp, V, prompt.size(), h0, logits);
      if (wrong.count(t) && wrong.at(t) >= 0.15) {
        d1 = t;
        break;
      }
    }
  }
  ASSERT_GE(d1, 0) << "no anchor found whose likely draft would repeat";
  std::vector<int32_t> h0 = prompt;
  h0.push_back(anchor);

  // The exact plain-sampling probabilities of (t1, t2) after the anchor.
  std::map<int32_t, std::map<int32_t, double>> p1;
  std::map<Pair, double> joint;
  for (const auto& [t1, q1] : p0) {
    s1.copy_from(s0);
    feed(s1, t1);
    std::vector<int32_t> h1 = h0;
    h1.push_back(t1);
    p1[t1] = distribution(sp, V, prompt.size(), h1, logits);
    for (const auto& [t2, q2] : p1[t1]) joint[{t1, t2}] = q1 * q2;
  }

  TableDrafter d;
  d.table[{h0.size(), anchor}] = {d1, mode(p1[d1])};
  for (const auto& [t1, q] : p1) d.table[{h0.size() + 1, t1}] = {mode(q), mode(q)};
  SpeculativeOptions o;
  o.num_draft_tokens = 2;
  SpeculativeDecoder dec(ex, d, o);
  SequenceState s = ex.new_sequence();
  std::map<Pair, long> seen;
  for (int r = 0; r < runs; ++r) {
    s.copy_from(base);
    SamplingParams q = sp;
    q.seed = uint64_t(r) + 1000;
    Sampler smp(q, V);
    smp.set_prompt_length(prompt.size());
    std::vector<int32_t> history = h0;
    std::vector<int32_t> got;
    auto emit = [&](int32_t t) {
      got.push_back(t);
      return got.size() < 2;
    };
    while (dec.step(s, history, &smp, emit)) {
    }
    ++seen[{got[0], got[1]}];
  }
  const SpeculativeStats& st = dec.stats();
  // Both paths carry mass: some drafts accepted, some rejected.
  EXPECT_GT(st.accepted, st.drafted / 20);
  EXPECT_LT(st.accepted, st.drafted * 9 / 10);
  const test::FitResult f = test::g_test(seen, joint);
  EXPECT_GT(f.p_value, 1e-6) << "G " << f.g << " df " << f.df << " " << f.problem << "; acceptance "
                             << st.acceptance_rate() << "; anchor " << anchor << " d1 " << d1;
}

TEST(SpeculativeSampling, TwoTokenDistributionEqualsPlainSampling) {
  SamplingParams sp;
  sp.temperature = 0.9f;
  sp.top_k = 5;
  sp.top_p = 0.95f;
  check_two_token_distribution(sp, 8000, false);
}

TEST(SpeculativeSampling, TwoTokenDistributionEqualsPlainSamplingWithPenalties) {
  SamplingParams sp;
  sp.temperature = 0.8f;
  sp.top_k = 5;
  sp.repetition_penalty = 1.6f;
  sp.presence_penalty = 1.0f;
  sp.frequency_penalty = 0.5f;
  check_two_token_distribution(sp, 8000, true);
}

class SpeculativeGenerator : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::shared_text_checkpoint("tiny", 21);
    model_ = std::make_unique<Model>(dir_, test::opts(Precision::BF16));
    tok_ = std::make_unique<Tokenizer>(Tokenizer::load(dir_));
  }
  GenerationResult generate(const SamplingParams& p, Drafter* d, int K = 4) {
    CpuExecutor ex(*model_, 1, 2, ExecutorKind::kMegakernel);
    Generator g(*model_, *tok_);
    g.set_executor(&ex);
    SpeculativeOptions o;
    o.num_draft_tokens = K;
    g.set_speculative(d, o);
    return g.generate(g.encode("the quick brown fox jumps over the lazy dog. the quick"), p);
  }
  std::string dir_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(SpeculativeGenerator, GreedyEqualsPlainGeneration) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 40;
  NgramDrafter ngram;
  for (int variant = 0; variant < 2; ++variant) {
    if (variant == 1) p.repetition_penalty = 1.3f, p.frequency_penalty = 0.4f;
    const GenerationResult plain = generate(p, nullptr);
    EXPECT_FALSE(plain.speculative);
    for (int K : {1, 5}) {
      const GenerationResult spec = generate(p, &ngram, K);
      EXPECT_TRUE(spec.speculative);
      EXPECT_EQ(spec.tokens, plain.tokens) << "variant " << variant << " K " << K;
      EXPECT_EQ(spec.text, plain.text);
      EXPECT_EQ(spec.finish_reason, plain.finish_reason);
      EXPECT_GT(spec.speculative_stats.steps, 0);
      EXPECT_EQ(spec.speculative_stats.emitted + 1, int64_t(spec.tokens.size()));
    }
  }
}

TEST_F(SpeculativeGenerator, SampledGenerationIsReproducible) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.9f;
  p.max_tokens = 30;
  p.seed = 5;
  NgramDrafter ngram;
  const GenerationResult a = generate(p, &ngram), b = generate(p, &ngram);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(int(a.tokens.size()), 30);
  p.seed = 6;
  EXPECT_NE(generate(p, &ngram).tokens, a.tokens);
}

}  // namespace
}  // namespace md
