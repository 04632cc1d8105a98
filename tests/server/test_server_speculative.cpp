// Speculative decoding in the engine loop (EngineOptions::make_drafter): the streams are exactly
// plain serving's (greedy tokens, stop ids ending a step early, logprobs from the verify rows),
// with prompts arriving while others decode (steps with prompt rows decode one row a sequence,
// which the drafters observe, aux rows included for a DSpark draft); the acceptance counters and
// their /metrics lines add up.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include "megadecode/base/threads.h"
#include "megadecode/server/metrics.h"
#include "megadecode/model/draft_config.h"
#include "megadecode/spec/draft_model.h"
#include "megadecode/spec/dspark_drafter.h"
#include "megadecode/spec/ngram_drafter.h"
#include "server/server_test_util.h"

namespace md {
namespace {

using server::EngineLoop;
using server::EngineOptions;
using server::EngineRequest;
using test::collect;
using test::greedy_request;
using test::Outcome;
using test::prompts;
using ::testing::HasSubstr;

EngineOptions engine_options() {
  EngineOptions o;
  o.max_batch = 8;
  o.prefill_chunk = 5;
  o.max_model_len = 512;
  return o;
}

// Each prompt's request, all at once, then staggered (prompt rows beside decode steps).
std::vector<Outcome> serve_all(EngineLoop& loop, const std::vector<EngineRequest>& reqs) {
  std::vector<Outcome> out;
  std::vector<std::shared_ptr<server::RequestStream>> streams;
  for (const EngineRequest& r : reqs) streams.push_back(loop.submit(r));
  for (auto& s : streams) out.push_back(collect(*s));
  streams.clear();
  for (size_t i = 0; i < reqs.size(); ++i) {
    streams.push_back(loop.submit(reqs[i]));
    std::this_thread::sleep_for(std::chrono::milliseconds(3 * int(i)));
  }
  for (auto& s : streams) out.push_back(collect(*s));
  return out;
}

std::vector<EngineRequest> requests(const test::ServedModel& m) {
  std::vector<EngineRequest> reqs;
  const auto ps = prompts(*m.tok);
  for (size_t i = 0; i < ps.size(); ++i) reqs.push_back(greedy_request(ps[i], 17 + 3 * int(i)));
  return reqs;
}

TEST(ServerEngine, SpeculativeNgramStreamsEqualPlainServing) {
  test::ServedModel m(8);
  std::vector<EngineRequest> reqs = requests(m);
  std::vector<Outcome> plain;
  {
    EngineLoop loop(*m.ex, *m.tok, engine_options());
    plain = serve_all(loop, reqs);
  }
  // A stop id that plain decoding of the first prompt reaches mid-stream, and logprobs of the
  // second: speculative steps must end and score where plain steps do.
  ASSERT_GT(plain[0].tokens.size(), 8u);
  const int32_t stop = plain[0].tokens[6];
  reqs[0].choices[0].sampling.stop_token_ids = {stop};
  reqs[1].top_logprobs = 3;
  std::vector<std::vector<server::TokenLogprob>> plain_lp;
  auto logprobs_of = [](EngineLoop& loop, const EngineRequest& r) {
    auto s = loop.submit(r);
    std::vector<server::TokenLogprob> lp;
    server::ChoiceEvent e;
    while (!s->finished())
      if (s->next(e, 5.0)) lp.insert(lp.end(), e.logprobs.begin(), e.logprobs.end());
    return lp;
  };
  Outcome plain_stop;
  {
    EngineLoop loop(*m.ex, *m.tok, engine_options());
    plain_stop = collect(*loop.submit(reqs[0]));
    plain_lp.push_back(logprobs_of(loop, reqs[1]));
  }
  for (int K : {1, 4}) {
    SCOPED_TRACE(K);
    EngineOptions o = engine_options();
    o.speculative.num_draft_tokens = K;
    o.make_drafter = [] { return std::make_unique<NgramDrafter>(); };
    // With the prefix cache: a restored sequence's drafter observes the restored tokens (a
    // prompt's second send keeps a state at its last token but one, which its third restores:
    // the logprobs request below is sent three times).
    o.prefix_cache = 8;
    o.prefix_cache_min_tokens = 2;
    EngineLoop loop(*m.ex, *m.tok, o);
    std::vector<EngineRequest> plain_reqs = requests(m);
    const std::vector<Outcome> spec = serve_all(loop, plain_reqs);
    ASSERT_EQ(spec.size(), plain.size());
    for (size_t i = 0; i < spec.size(); ++i) {
      EXPECT_EQ(spec[i].tokens, plain[i].tokens) << i;
      EXPECT_EQ(spec[i].text, plain[i].text) << i;
      EXPECT_EQ(spec[i].finish, "length");
      EXPECT_EQ(spec[i].completion_tokens, plain[i].completion_tokens);
    }
    const Outcome stopped = collect(*loop.submit(reqs[0]));
    EXPECT_EQ(stopped.tokens, plain_stop.tokens);
    EXPECT_EQ(stopped.finish, "stop");
    for (int send = 0; send < 3; ++send) {
      const std::vector<server::TokenLogprob> lp = logprobs_of(loop, reqs[1]);
      ASSERT_EQ(lp.size(), plain_lp[0].size());
      for (size_t i = 0; i < lp.size(); ++i) {
        EXPECT_EQ(lp[i].id, plain_lp[0][i].id) << i;
        // Verify rows = decode rows, bitwise.
        EXPECT_EQ(lp[i].logprob, plain_lp[0][i].logprob) << send << " " << i;
        EXPECT_EQ(lp[i].top, plain_lp[0][i].top) << i;
      }
    }
    const server::EngineCounters& c = loop.counters();
    EXPECT_GT(c.prefix_cache_hits.load(), 0);
    EXPECT_GT(c.spec_drafts.load(), 0);
    EXPECT_EQ(c.spec_draft_tokens.load(), K * c.spec_drafts.load());
    EXPECT_LE(c.spec_accepted_tokens.load(), c.spec_draft_tokens.load());
    int64_t at = 0;
    for (const auto& a : c.spec_accepted_at) at += a.load();
    EXPECT_EQ(at, c.spec_accepted_tokens.load());
    EXPECT_EQ(c.running.load(), 0);
    server::Metrics metrics;
    const std::string text = metrics.render(c);
    EXPECT_THAT(text, HasSubstr(fmt::format("megadecode_spec_decode_num_draft_tokens_total {}",
                                            c.spec_draft_tokens.load())));
    EXPECT_THAT(text, HasSubstr(fmt::format("megadecode_spec_decode_num_accepted_tokens_total {}",
                                            c.spec_accepted_tokens.load())));
    EXPECT_THAT(text, HasSubstr("megadecode_spec_decode_num_accepted_tokens_per_pos_total{"
                                "position=\"0\"}"));
  }
  // Without a drafter there are no speculative lines.
  server::EngineCounters none;
  EXPECT_THAT(server::Metrics().render(none), ::testing::Not(HasSubstr("spec_decode")));
}

// Near --max-model-len a verify's K + 1 rows would reach past the limit (positions the slot's
// share of the pool need not hold), so those steps decode plain rows: with K = 15 and a limit of
// 40 tokens, the stream still ends exactly at the limit with plain serving's tokens. (Here the
// pool has room beyond the limit, so this checks the output, not that the guard was taken.)
TEST(ServerEngine, SpeculativeStepsStopShortOfTheModelLength) {
  test::ServedModel m(2);
  EngineOptions o = engine_options();
  o.max_batch = 2;
  o.max_model_len = 40;
  const std::vector<int32_t> prompt = prompts(*m.tok)[1];  // short: verifies happen before the end
  ASSERT_LT(prompt.size(), 20u);
  const EngineRequest r = greedy_request(prompt, 100);
  Outcome plain;
  {
    EngineLoop loop(*m.ex, *m.tok, o);
    plain = collect(*loop.submit(r));
  }
  EXPECT_EQ(plain.finish, "length");
  EXPECT_EQ(plain.tokens.size() + prompt.size(), 40u);
  o.speculative.num_draft_tokens = 15;
  o.make_drafter = [] { return std::make_unique<NgramDrafter>(); };
  EngineLoop loop(*m.ex, *m.tok, o);
  const Outcome spec = collect(*loop.submit(r));
  EXPECT_EQ(spec.tokens, plain.tokens);
  EXPECT_EQ(spec.finish, "length");
  EXPECT_GT(loop.counters().spec_drafts.load(), 0);
  EXPECT_TRUE(loop.failure().empty()) << loop.failure();
}

// A random DSpark draft (its aux rows come from every step, prompt chunks and plain decode rows
// included): the same tokens as plain serving, sampled requests included (their seeds give
// plain serving's draws only without speculation, so those are checked for running to their
// length without errors); the draft runs as draft plans on the executor.
TEST(ServerEngine, SpeculativeDSparkDraftStreamsEqualPlainServing) {
  test::ServedModel m(8);
  test::TempDir dir("serve_draft");
  {
    ThreadPool pool(1, false);
    make_random_draft(draft_config_for_target(m.model->config()), dir.path(), 5, pool);
  }
  DraftModel draft(dir.path(), m.model->config(), m.model->options());
  std::vector<EngineRequest> reqs = requests(m);
  std::vector<Outcome> plain;
  {
    EngineLoop loop(*m.ex, *m.tok, engine_options());
    plain = serve_all(loop, reqs);
  }
  // The draft as draft plans on the engine's executor, batched across slots (the host forward
  // drafts the same tokens: DraftPlan.SpeculativeDecodingWithThePlanDraftIsExact).
  EngineOptions o = engine_options();
  o.speculative.num_draft_tokens = 3;
  o.make_drafter = [&draft, &m] { return std::make_unique<DSparkDrafter>(draft, m.ex.get()); };
  EngineLoop loop(*m.ex, *m.tok, o);
  const std::vector<Outcome> spec = serve_all(loop, reqs);
  ASSERT_EQ(spec.size(), plain.size());
  for (size_t i = 0; i < spec.size(); ++i) EXPECT_EQ(spec[i].tokens, plain[i].tokens) << i;
  EXPECT_GT(loop.counters().spec_drafts.load(), 0);
  EngineRequest sampled = greedy_request(prompts(*m.tok)[0], 25);
  sampled.choices[0].sampling.temperature = 0.8f;
  sampled.choices[0].sampling.top_p = 0.9f;
  sampled.choices[0].sampling.seed = 7;
  const Outcome s = collect(*loop.submit(sampled));
  EXPECT_EQ(s.finish, "length");
  EXPECT_EQ(s.completion_tokens, 25);
  EXPECT_EQ(s.tokens.size(), 25u);
}

// Tokens, logprobs and prompt logprobs of one stream.
struct Scored {
  std::vector<int32_t> tokens;
  std::vector<server::TokenLogprob> logprobs, prompt_logprobs;
};
Scored collect_scored(server::RequestStream& s) {
  Scored o;
  server::ChoiceEvent e;
  while (!s.finished())
    if (s.next(e, 5.0)) {
      EXPECT_TRUE(e.error.empty()) << e.error;
      o.tokens.insert(o.tokens.end(), e.tokens.begin(), e.tokens.end());
      o.logprobs.insert(o.logprobs.end(), e.logprobs.begin(), e.logprobs.end());
      o.prompt_logprobs.insert(o.prompt_logprobs.end(), e.prompt_logprobs.begin(),
                               e.prompt_logprobs.end());
    }
  return o;
}
void expect_same_logprobs(const std::vector<server::TokenLogprob>& a,
                          const std::vector<server::TokenLogprob>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].id, b[i].id) << what << " " << i;
    EXPECT_EQ(a[i].logprob, b[i].logprob) << what << " " << i;
  }
}

// A prompt that arrives while another request decodes goes in chunk by chunk inside the
// speculative verify steps (at most 16 rows and --prefill-chunk a step): both streams are plain
// serving's (tokens, logprobs, the long prompt's prompt logprobs, bit for bit), for n-gram
// drafting and for a DSpark draft on the executor (the prompt's rows enter its ring from those
// steps), and the prompt rows did ride in verify steps.
TEST(ServerEngine, SpeculationGoesOnWhileAPromptIsFed) {
  test::ServedModel m(2);
  test::TempDir dir("serve_mixed_draft");
  {
    ThreadPool pool(1, false);
    make_random_draft(draft_config_for_target(m.model->config()), dir.path(), 9, pool);
  }
  DraftModel draft(dir.path(), m.model->config(), m.model->options());
  EngineRequest a = greedy_request(prompts(*m.tok)[0], 60);
  a.top_logprobs = 2;
  std::vector<int32_t> long_prompt(64);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = int32_t(3 + (i * 7) % 61);
  EngineRequest b = greedy_request(long_prompt, 12);
  b.prompt_logprobs = true;
  b.top_logprobs = 1;
  auto serve = [&](EngineOptions o, int* mixed_steps) {
    const int K = o.speculative.num_draft_tokens;
    server::EngineObserver obs;
    // Engine thread only: a verify step of one sequence feeds K + 1 rows, more with prompt rows.
    // In a's first decode step (after its first token went out) it waits until b is queued, so
    // that b arrives while a decodes (a's 60 tokens take at least 15 more steps) however slow
    // this thread is.
    std::atomic<bool> b_queued{false};
    int decode_steps = 0;
    obs.step = [mixed_steps, K](double, int rows) {
      if (mixed_steps && rows > K + 1) ++*mixed_steps;
    };
    obs.decode_batch = [&](int) {
      if (++decode_steps == 1)
        for (int i = 0; i < 10000 && !b_queued; ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
    };
    o.max_batch = 2;
    o.prefill_chunk = 8;
    o.max_model_len = 1024;
    EngineLoop loop(*m.ex, *m.tok, o, obs);
    auto sa = loop.submit(a);
    server::ChoiceEvent e;
    int got = 0;
    std::vector<server::ChoiceEvent> early;
    while (got < 1)
      if (sa->next(e, 5.0)) {
        got += int(e.tokens.size());
        early.push_back(e);
      }
    auto sb = loop.submit(b);
    b_queued = true;
    const Scored rb = collect_scored(*sb);
    Scored ra = collect_scored(*sa);
    for (auto it = early.rbegin(); it != early.rend(); ++it) {
      ra.tokens.insert(ra.tokens.begin(), it->tokens.begin(), it->tokens.end());
      ra.logprobs.insert(ra.logprobs.begin(), it->logprobs.begin(), it->logprobs.end());
    }
    return std::pair{ra, rb};
  };
  const auto plain = serve(engine_options(), nullptr);
  ASSERT_EQ(plain.first.tokens.size(), 60u);
  ASSERT_EQ(plain.second.prompt_logprobs.size(), 63u);
  for (bool dspark : {false, true}) {
    SCOPED_TRACE(dspark ? "DSpark draft on the executor" : "n-gram");
    EngineOptions o = engine_options();
    o.speculative.num_draft_tokens = 3;
    if (dspark)
      o.make_drafter = [&] { return std::make_unique<DSparkDrafter>(draft, m.ex.get()); };
    else
      o.make_drafter = [] { return std::make_unique<NgramDrafter>(); };
    int mixed = 0;
    const auto spec = serve(o, &mixed);
    EXPECT_EQ(spec.first.tokens, plain.first.tokens);
    EXPECT_EQ(spec.second.tokens, plain.second.tokens);
    expect_same_logprobs(spec.first.logprobs, plain.first.logprobs, "a's logprobs");
    expect_same_logprobs(spec.second.logprobs, plain.second.logprobs, "b's logprobs");
    expect_same_logprobs(spec.second.prompt_logprobs, plain.second.prompt_logprobs,
                         "b's prompt logprobs");
    // 64 prompt rows in chunks of 8: 8 steps, each beside a's verify.
    EXPECT_GE(mixed, 8);
  }
}

}  // namespace
}  // namespace md
