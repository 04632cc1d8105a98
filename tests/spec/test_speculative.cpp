// The speculative loop (spec/speculative.h) on the golden and random test models of tests/exec
// (Kimi Linear tiny / small, Kimi K3 tiny / small), both executors: greedy speculative decoding
// emits exactly plain greedy decoding's tokens for drafts that always agree (the target's own
// greedy tokens), never agree, are random, come from n-gram lookup or from a random DSpark draft;
// the sequence's state afterwards is bit for bit that of the plain run; a step cut short by its
// consumer commits to match; the fixed acceptance length forces its count; the n-gram drafter's
// lookup; bad options are errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "exec/exec_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/base/xoshiro.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/spec/dspark_drafter.h"
#include "megadecode/spec/ngram_drafter.h"
#include "megadecode/spec/speculative.h"
#include "test_util.h"

namespace md {
namespace {

using test::expect_same_state;
using ::testing::HasSubstr;

std::string model_dir(const std::string& name) {
  if (name == "k3-small") return test::shared_checkpoint("k3-small", 24);
  return test::data_dir() + "/data/golden/" + name;
}

std::vector<int32_t> prompt_of(const Model& m, int n, int salt) {
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> ids(size_t(n), 0);
  for (int t = 0; t < n; ++t) ids[size_t(t)] = int32_t((salt * 131 + t * 17 + 5) % (V - 1));
  return ids;
}

// The test hook: proposes what the target will choose (truth: the prompt and plain greedy
// decoding's tokens), or with agree = false a token it will not choose first.
class TruthDrafter : public Drafter {
 public:
  TruthDrafter(std::vector<int32_t> truth, int64_t vocab, bool agree)
      : truth_(std::move(truth)), V_(vocab), agree_(agree) {}
  std::string_view name() const override { return agree_ ? "agree" : "disagree"; }
  void reset() override {}
  void observe(std::span<const int32_t>, int64_t, std::span<const float>) override {}
  void propose(std::span<const int32_t> context, std::span<int32_t> out) override {
    for (size_t i = 0; i < out.size(); ++i) {
      const size_t at = context.size() + i;
      const int32_t t = at < truth_.size() ? truth_[at] : 0;
      out[i] = agree_ ? t : int32_t((t + 1) % V_);
    }
  }

 private:
  std::vector<int32_t> truth_;
  int64_t V_;
  bool agree_;
};

class RandomDrafter : public Drafter {
 public:
  RandomDrafter(int64_t vocab, uint64_t seed) : V_(vocab), rng_(seed) {}
  std::string_view name() const override { return "random"; }
  void reset() override {}
  void observe(std::span<const int32_t>, int64_t, std::span<const float>) override {}
  void propose(std::span<const int32_t>, std::span<int32_t> out) override {
    for (int32_t& t : out) t = int32_t(rng_.next() % uint64_t(V_));
  }

 private:
  int64_t V_;
  Xoshiro256 rng_;
};

struct Decoded {
  std::vector<int32_t> tokens;  // generated
  SequenceState state;          // has consumed the prompt and all tokens but the last
  SpeculativeStats stats;
};

int32_t argmax(const std::vector<float>& l) {
  int32_t b = 0;
  for (size_t i = 1; i < l.size(); ++i)
    if (l[i] > l[size_t(b)]) b = int32_t(i);
  return b;
}

// Plain greedy decoding through the plan: one row a step, the plan's in-step argmax.
Decoded plain_greedy(Executor& ex, const std::vector<int32_t>& prompt, int n) {
  Decoded r;
  r.state = ex.new_sequence();
  std::vector<float> logits(size_t(ex.model().config().vocab_size));
  ex.prefill(r.state, prompt, logits.data());
  r.tokens.push_back(argmax(logits));
  SequenceState* p = &r.state;
  while (int(r.tokens.size()) < n) {
    int32_t next = -1;
    ex.step(std::span(&p, 1), std::span(&r.tokens.back(), 1), nullptr, &next);
    r.tokens.push_back(next);
  }
  return r;
}

Decoded speculative_greedy(Executor& ex, Drafter& d, const SpeculativeOptions& o,
                           const std::vector<int32_t>& prompt, int n) {
  Decoded r;
  r.state = ex.new_sequence();
  SpeculativeDecoder dec(ex, d, o);
  dec.reset();
  std::vector<float> logits(size_t(ex.model().config().vocab_size));
  dec.prefill(r.state, prompt, logits.data());
  std::vector<int32_t> history = prompt;
  history.push_back(argmax(logits));
  r.tokens.push_back(history.back());
  auto emit = [&](int32_t t) {
    r.tokens.push_back(t);
    return int(r.tokens.size()) < n;
  };
  if (n > 1)
    while (dec.step(r.state, history, nullptr, emit)) {
    }
  EXPECT_EQ(std::vector<int32_t>(history.begin() + std::ptrdiff_t(prompt.size()), history.end()),
            r.tokens);
  r.stats = dec.stats();
  return r;
}

struct Case {
  std::string model;
  Precision precision;
  ExecutorKind kind;
};

class SpeculativeGreedy : public ::testing::TestWithParam<Case> {};

TEST_P(SpeculativeGreedy, EmitsPlainGreedyTokensForAnyDraft) {
  const Case& c = GetParam();
  Model m(model_dir(c.model), test::opts(c.precision));
  const int64_t V = m.config().vocab_size;
  CpuExecutor ex(m, 1, 2, c.kind);
  const std::vector<int32_t> prompt = prompt_of(m, 11, 3);
  const int n = 37;  // not a multiple of any K + 1 below: the last step is cut short
  const Decoded plain = plain_greedy(ex, prompt, n + 16);
  const std::vector<int32_t> want(plain.tokens.begin(), plain.tokens.begin() + n);
  Decoded plain_n = plain_greedy(ex, prompt, n);
  std::vector<int32_t> truth = prompt;
  truth.insert(truth.end(), plain.tokens.begin(), plain.tokens.end());
  for (int K : {1, 3, 7, 15}) {
    SpeculativeOptions o;
    o.num_draft_tokens = K;
    TruthDrafter agree(truth, V, true), disagree(truth, V, false);
    RandomDrafter random(V, uint64_t(K));
    NgramDrafter ngram;
    for (Drafter* d : std::vector<Drafter*>{&agree, &disagree, &random, &ngram}) {
      SCOPED_TRACE(std::string(d->name()) + " K=" + std::to_string(K));
      const Decoded r = speculative_greedy(ex, *d, o, prompt, n);
      EXPECT_EQ(r.tokens, want);
      expect_same_state(r.state, plain_n.state, "after speculative decoding");
      EXPECT_EQ(r.stats.drafted, r.stats.steps * K);
      if (d == &agree) {
        EXPECT_EQ(r.stats.accepted, r.stats.drafted);
        EXPECT_EQ(r.stats.steps, (n - 1 + K) / (K + 1));
      }
      if (d == &disagree) {
        EXPECT_EQ(r.stats.accepted, 0);
        EXPECT_EQ(r.stats.steps, n - 1);
      }
      EXPECT_EQ(r.stats.emitted, n - 1);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, SpeculativeGreedy,
    ::testing::Values(Case{"tiny", Precision::BF16, ExecutorKind::kMegakernel},
                      Case{"tiny", Precision::FP32, ExecutorKind::kOpByOp},
                      Case{"small", Precision::BF16, ExecutorKind::kOpByOp},
                      Case{"k3-tiny", Precision::BF16, ExecutorKind::kMegakernel},
                      Case{"k3-tiny", Precision::FP32, ExecutorKind::kMegakernel},
                      Case{"k3-small", Precision::BF16, ExecutorKind::kMegakernel}),
    [](const auto& info) {
      std::string n = info.param.model + "_" +
                      (info.param.precision == Precision::BF16 ? "bf16" : "fp32") + "_" +
                      std::string(executor_name(info.param.kind));
      for (char& ch : n)
        if (ch == '-') ch = '_';
      return n;
    });

// A batched step (step_batch, what the server runs): four sequences at different positions, each
// with its own drafter (agreeing, never agreeing, random, n-gram) and token budget, verified
// together until each has its tokens; every one emits plain greedy decoding's tokens and ends in
// its state, and a sequence that stops leaves the batch without disturbing the others.
TEST(Speculative, BatchedStepsEmitEachSequencesPlainGreedyTokens) {
  for (const char* name : {"tiny", "k3-tiny"}) {
    SCOPED_TRACE(name);
    Model m(model_dir(name), test::opts(Precision::BF16));
    const int64_t V = m.config().vocab_size;
    CpuExecutor ex(m, 4, 2, ExecutorKind::kMegakernel);
    const int lens[4] = {7, 13, 21, 30};
    struct Seq {
      std::vector<int32_t> prompt, want, history;
      std::unique_ptr<Drafter> drafter;
      Decoded plain;
      SequenceState state;
      int n = 0;
    };
    std::vector<Seq> seqs(4);
    for (int b = 0; b < 4; ++b) {
      Seq& q = seqs[size_t(b)];
      q.prompt = prompt_of(m, 5 + 3 * b, 11 + b);
      q.n = lens[b];
      q.plain = plain_greedy(ex, q.prompt, q.n + 16);
      std::vector<int32_t> truth = q.prompt;
      truth.insert(truth.end(), q.plain.tokens.begin(), q.plain.tokens.end());
      q.want.assign(q.plain.tokens.begin(), q.plain.tokens.begin() + q.n);
      if (b == 0) q.drafter = std::make_unique<TruthDrafter>(truth, V, true);
      if (b == 1) q.drafter = std::make_unique<TruthDrafter>(truth, V, false);
      if (b == 2) q.drafter = std::make_unique<RandomDrafter>(V, 99);
      if (b == 3) q.drafter = std::make_unique<NgramDrafter>();
    }
    SpeculativeOptions o;
    o.num_draft_tokens = 4;
    SpeculativeDecoder dec(ex, std::span<const int>(), o);
    std::vector<float> logits(static_cast<size_t>(V));
    for (Seq& q : seqs) {
      q.state = ex.new_sequence();
      ex.prefill(q.state, q.prompt, logits.data());
      q.history = q.prompt;
      q.history.push_back(argmax(logits));
    }
    auto generated = [](const Seq& q) { return int(q.history.size() - q.prompt.size()); };
    for (int round = 0; round < 64; ++round) {
      std::vector<SpecSeq> batch;
      for (Seq& q : seqs) {
        if (generated(q) >= q.n) continue;
        SpecSeq s;
        s.seq = &q.state;
        s.history = &q.history;
        s.drafter = q.drafter.get();
        s.emit = [&q, &generated](int32_t, std::span<const float> l) {
          EXPECT_TRUE(l.empty());
          return generated(q) < q.n;
        };
        batch.push_back(std::move(s));
      }
      if (batch.empty()) break;
      dec.step_batch(batch);
    }
    for (int b = 0; b < 4; ++b) {
      Seq& q = seqs[size_t(b)];
      SCOPED_TRACE(b);
      EXPECT_EQ(std::vector<int32_t>(q.history.begin() + std::ptrdiff_t(q.prompt.size()),
                                     q.history.end()),
                q.want);
      const Decoded plain_n = plain_greedy(ex, q.prompt, q.n);
      expect_same_state(q.state, plain_n.state, "after batched speculative decoding");
    }
    const SpeculativeStats& st = dec.stats();
    EXPECT_GT(st.steps, st.batches);  // several sequences a step
    EXPECT_EQ(st.drafted, st.steps * 4);
    EXPECT_GE(st.accepted_at[0], st.accepted_at[3]);
    int64_t at = 0;
    for (int64_t a : st.accepted_at) at += a;
    EXPECT_EQ(at, st.accepted);
  }
}

// Benchmark mode: every step accepts exactly N drafts and emits N + 1 tokens (the drafts and the
// target's choice after them), and the sequence has consumed exactly what was emitted.
TEST(Speculative, FixedAcceptanceLengthForcesTheCount) {
  Model m(model_dir("tiny"), test::opts(Precision::BF16));
  const int64_t V = m.config().vocab_size;
  CpuExecutor ex(m, 1, 2, ExecutorKind::kMegakernel);
  const std::vector<int32_t> prompt = prompt_of(m, 9, 4);
  for (int N : {0, 2, 5}) {
    SpeculativeOptions o;
    o.num_draft_tokens = 5;
    o.fixed_acceptance_length = N;
    RandomDrafter d(V, 7);
    const Decoded r = speculative_greedy(ex, d, o, prompt, 1 + 4 * (N + 1));
    EXPECT_EQ(r.stats.steps, 4);
    EXPECT_EQ(r.stats.accepted, 4 * N);
    EXPECT_EQ(r.stats.emitted, 4 * (N + 1));
    // The same tokens fed one by one through the reference path give the same state, and each
    // step's last token is the target's greedy choice there.
    // (Token by token: the reference's one-call prefill differs from the plan's chunks in fp32
    // order.)
    SequenceState ref = m.new_sequence();
    std::vector<float> logits(static_cast<size_t>(V));
    for (const int32_t& t : prompt) m.forward(ref, std::span(&t, 1), logits.data(), false);
    for (size_t i = 0; i + 1 < r.tokens.size(); ++i) {
      if (i % size_t(N + 1) == 0 && i > 0) {
        EXPECT_EQ(r.tokens[i], argmax(logits)) << i;
      }
      m.forward(ref, std::span(&r.tokens[i], 1), logits.data(), false);
    }
    EXPECT_EQ(r.tokens.back(), argmax(logits));
    expect_same_state(r.state, ref, "fixed acceptance " + std::to_string(N));
  }
}

TEST(Speculative, BadOptionsAreErrors) {
  Model m(model_dir("tiny"), test::opts(Precision::BF16));
  CpuExecutor ex(m, 1, 2, ExecutorKind::kMegakernel);
  NgramDrafter d;
  auto error_of = [&](SpeculativeOptions o) {
    try {
      SpeculativeDecoder dec(ex, d, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  SpeculativeOptions o;
  o.num_draft_tokens = 16;
  EXPECT_THAT(error_of(o), HasSubstr("--num-draft-tokens 16 is not in 1..15"));
  o.num_draft_tokens = 0;
  EXPECT_THAT(error_of(o), HasSubstr("--num-draft-tokens 0"));
  o.num_draft_tokens = 3;
  o.fixed_acceptance_length = 4;
  EXPECT_THAT(error_of(o), HasSubstr("--fixed-acceptance-length 4 is not in 0..3"));
  // A history that does not end one past the sequence's position.
  SpeculativeDecoder dec(ex, d, SpeculativeOptions{});
  SequenceState s = ex.new_sequence();
  std::vector<int32_t> h = {1, 2, 3};
  EXPECT_THROW(dec.step(s, h, nullptr, [](int32_t) { return true; }), Error);
}

TEST(NgramDrafter, ProposesTheContinuationOfTheLongestRecentMatch) {
  std::vector<int32_t> out(4);
  // The suffix "7 8 9" occurred before, followed by 1 2; the continuation runs on (1 2 7 8).
  NgramDrafter d;
  d.propose(std::vector<int32_t>{7, 8, 9, 1, 2, 7, 8, 9}, out);
  EXPECT_EQ(out, (std::vector<int32_t>{1, 2, 7, 8}));
  // The most recent of several matches of the longest n: "5 6" -> 3 (not the older 4).
  d.propose(std::vector<int32_t>{5, 6, 4, 0, 5, 6, 3, 0, 5, 6}, out);
  EXPECT_EQ(out, (std::vector<int32_t>{3, 0, 5, 6}));
  // A longer match wins over a more recent shorter one: "1 2 3" -> 9, not "3" -> 4.
  d.propose(std::vector<int32_t>{1, 2, 3, 9, 9, 3, 4, 1, 2, 3}, out);
  EXPECT_EQ(out[0], 9);
  // A periodic text continues its period through the proposal itself.
  d.propose(std::vector<int32_t>{4, 5, 4, 5}, out);
  EXPECT_EQ(out, (std::vector<int32_t>{4, 5, 4, 5}));
  // Nothing matches: the last token again.
  d.propose(std::vector<int32_t>{1, 2, 3}, out);
  EXPECT_EQ(out, (std::vector<int32_t>{3, 3, 3, 3}));
  d.propose(std::vector<int32_t>{6}, out);
  EXPECT_EQ(out, (std::vector<int32_t>{6, 6, 6, 6}));
  // max_n = 1: only the last token is looked up ("3" -> 4 is the most recent).
  NgramDrafter one(NgramOptions{1});
  one.propose(std::vector<int32_t>{1, 2, 3, 9, 9, 3, 4, 1, 2, 3}, out);
  EXPECT_EQ(out[0], 4);
  EXPECT_THROW(NgramDrafter(NgramOptions{0}), Error);
  EXPECT_THROW(NgramDrafter(NgramOptions{17}), Error);
}

// A random DSpark draft drafts from its ring of the target's aux rows: whatever it drafts, the
// emitted tokens are plain greedy decoding's.
TEST(Speculative, DSparkDraftGreedyIsExact) {
  for (const char* name : {"tiny", "k3-tiny"}) {
    SCOPED_TRACE(name);
    Model m(model_dir(name), test::opts(Precision::BF16));
    test::TempDir dir("spec_draft");
    {
      ThreadPool pool(2, false);
      make_random_draft(draft_config_for_target(m.config()), dir.path(), 3, pool);
    }
    DraftModel draft(dir.path(), m.config(), test::opts(Precision::BF16));
    CpuExecutor ex(m, 1, 2, ExecutorKind::kMegakernel);
    const std::vector<int32_t> prompt = prompt_of(m, 21, 5);  // two prefill chunks
    const int n = 30;
    Decoded plain = plain_greedy(ex, prompt, n);
    DSparkDrafter d(draft);
    SpeculativeOptions o;
    o.num_draft_tokens = 7;
    const Decoded r = speculative_greedy(ex, d, o, prompt, n);
    EXPECT_EQ(r.tokens, plain.tokens);
    expect_same_state(r.state, plain.state, "after DSpark speculative decoding");
    // The ring holds one context row per consumed position.
    EXPECT_EQ(d.state().rows_written, r.state.pos);
  }
}

// The drafter's ring is built from the verify steps' aux rows: equal to a ring built from
// Model::forward's aux capture of the same tokens fed one at a time. Needs the executors' aux
// capture (StepOptions::aux).
TEST(Speculative, DSparkContextComesFromTheVerifiedRows) {
  for (const char* name : {"tiny", "k3-tiny"}) {
    SCOPED_TRACE(name);
    Model m(model_dir(name), test::opts(Precision::BF16));
    test::TempDir dir("spec_draft_ctx");
    {
      ThreadPool pool(2, false);
      make_random_draft(draft_config_for_target(m.config()), dir.path(), 4, pool);
    }
    DraftModel draft(dir.path(), m.config(), test::opts(Precision::BF16));
    CpuExecutor ex(m, 1, 2, ExecutorKind::kMegakernel);
    {
      // Does this executor capture aux rows yet?
      SequenceState s = ex.new_sequence();
      const std::vector<int32_t> one = {1};
      std::vector<float> aux(size_t(draft.config().context_width()), 0.0f);
      StepOptions so;
      so.aux = AuxCapture{draft.config().aux_layer_ids, aux.data()};
      const StepSeq q{&s, one, LogitRows::kNone};
      ex.step(std::span(&q, 1), nullptr, nullptr, {}, so);
      bool any = false;
      for (float v : aux) any |= v != 0.0f;
      if (!any) GTEST_SKIP() << "the CPU executor does not fill StepOptions::aux yet";
    }
    const std::vector<int32_t> prompt = prompt_of(m, 19, 6);
    DSparkDrafter d(draft);
    SpeculativeOptions o;
    o.num_draft_tokens = 4;
    const Decoded r = speculative_greedy(ex, d, o, prompt, 25);
    // The reference: every consumed token through Model::forward with aux capture.
    std::vector<int32_t> consumed = prompt;
    consumed.insert(consumed.end(), r.tokens.begin(), r.tokens.end() - 1);
    DraftState want = draft.new_state();
    SequenceState ref = m.new_sequence();
    std::vector<float> aux(size_t(draft.config().context_width()));
    for (size_t t = 0; t < consumed.size(); ++t) {
      const AuxCapture cap{draft.config().aux_layer_ids, aux.data()};
      m.forward(ref, std::span(&consumed[t], 1), nullptr, false, &cap);
      const int32_t pos = int32_t(t);
      draft.update_context(want, aux, std::span(&pos, 1));
    }
    EXPECT_EQ(d.state().positions, want.positions);
    EXPECT_TRUE(test::same_bits(d.state().keys.data(), want.keys.data(), want.keys.size()));
    EXPECT_TRUE(test::same_bits(d.state().values.data(), want.values.data(), want.values.size()));
  }
}

}  // namespace
}  // namespace md
