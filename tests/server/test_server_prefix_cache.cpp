// The serving loop's prefix cache (engine/prefix_cache.h, docs/server.md "Prefix cache"): a chat's
// next turn, a shared prefix and a repeated prompt restore a kept state instead of prefilling it,
// and every request still gets exactly its solo greedy tokens (prompt chunks of at most
// plan::kMaxChainedRows rows run row by row, so a restored state continues with the same bits).
#include <gtest/gtest.h>

#include "megadecode/base/error.h"
#include "server/server_test_util.h"

namespace md {
namespace {

using server::EngineLoop;
using server::EngineOptions;
using test::collect;
using test::greedy_request;
using test::Outcome;

std::vector<int32_t> ids(int n, int salt) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(int32_t(1 + (salt * 37 + i * 11) % 97));
  return v;
}
std::vector<int32_t> cat(std::vector<int32_t> a, std::span<const int32_t> b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Solo {
  test::ServedModel& m;
  CpuExecutor ex;
  Generator g;
  explicit Solo(test::ServedModel& sm)
      : m(sm),
        ex(*sm.model, 1, ExecutorKind::kMegakernel,
           [] {
             ExecutorOptions eo;
             eo.workers = 2;
             eo.pin = false;
             return eo;
           }()),
        g(*sm.model, *sm.tok) {
    g.set_executor(&ex, 7);
  }
  std::vector<int32_t> operator()(const std::vector<int32_t>& prompt, int n) {
    SamplingParams sp;
    sp.temperature = 0;
    sp.max_tokens = n;
    return g.generate(prompt, sp).tokens;
  }
};

// 4 slots and the cache on, keeping states of 8 tokens or more; prompt chunks of `chunk` rows.
EngineOptions cache_options(int chunk, int entries) {
  EngineOptions o;
  o.max_batch = 4;
  o.prefill_chunk = chunk;
  o.max_model_len = 512;
  o.prefix_cache = entries;
  o.prefix_cache_min_tokens = 8;
  return o;
}

TEST(ServerPrefixCache, NextTurnsSharedPrefixesAndRepeatsHitAndKeepTheSoloTokens) {
  test::ServedModel m(4);
  Solo solo(m);
  // (No eviction here: a request keeps up to 3 states.)
  EngineLoop loop(*m.ex, *m.tok, cache_options(5, 12));
  const int kTokens = 10;
  auto run = [&](const std::vector<int32_t>& prompt, int want_cached, const char* what) {
    const Outcome out = collect(*loop.submit(greedy_request(prompt, kTokens)));
    EXPECT_EQ(out.tokens, solo(prompt, kTokens)) << what;
    EXPECT_EQ(out.cached_tokens, want_cached) << what;
    return out;
  };
  const std::vector<int32_t> p = ids(30, 1);
  const Outcome a = run(p, 0, "first prompt");
  ASSERT_EQ(a.tokens.size(), size_t(kTokens));
  // The next turn: the conversation so far (the prompt and the reply; the reply's last token was
  // drawn, never fed), then more. Its state was kept when the first request finished.
  const std::vector<int32_t> b =
      cat(cat(p, std::span(a.tokens).first(kTokens - 1)), std::vector<int32_t>(ids(6, 2)));
  run(b, 30 + kTokens - 1, "next turn");
  // A prompt sharing only p's first 20 tokens: nothing to restore, but a state is kept there...
  const std::vector<int32_t> c = cat(std::vector<int32_t>(p.begin(), p.begin() + 20), ids(15, 3));
  run(c, 0, "departs at 20");
  // ... which the next prompt with the same 20 tokens restores.
  run(cat(std::vector<int32_t>(p.begin(), p.begin() + 20), ids(12, 4)), 20, "shares 20");
  // The first prompt again: its own entry, kept with its last row's logits, gives the first draw
  // with nothing fed (and the same tokens).
  run(p, 30, "repeat");
  run(p, 30, "repeat again");
  // Prompt logprobs need every prompt row: no restore.
  {
    server::EngineRequest r = greedy_request(p, kTokens);
    r.prompt_logprobs = true;
    const Outcome out = collect(*loop.submit(r));
    EXPECT_EQ(out.tokens, solo(p, kTokens));
    EXPECT_EQ(out.cached_tokens, 0);
  }
  const int64_t hits = 39 + 20 + 30 + 30;
  EXPECT_EQ(loop.counters().prefix_cache_hits.load(), hits);
  // Every prompt token is looked up (7 requests) and each is either restored or prefilled.
  const int64_t looked_up = 30 + int64_t(b.size()) + int64_t(c.size()) + 32 + 30 + 30 + 30;
  EXPECT_EQ(loop.counters().prefix_cache_queries.load(), looked_up);
  EXPECT_EQ(loop.counters().prompt_tokens.load(), looked_up - hits);
}

// Requests running beside each other with the cache on (its entries take pool slots beside the
// running ones) still get their solo tokens; a short prompt is never kept.
TEST(ServerPrefixCache, ConcurrentRequestsKeepTheirSoloTokens) {
  test::ServedModel m(4);
  Solo solo(m);
  EngineLoop loop(*m.ex, *m.tok, cache_options(6, 12));
  const std::vector<int32_t> system = ids(24, 7);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back(cat(system, ids(3 + i, 10 + i)));
  prompts.push_back(ids(5, 30));  // below the cache's minimum
  for (int round = 0; round < 2; ++round) {
    std::vector<std::shared_ptr<server::RequestStream>> streams;
    for (const auto& p : prompts) streams.push_back(loop.submit(greedy_request(p, 8)));
    for (size_t i = 0; i < prompts.size(); ++i)
      EXPECT_EQ(collect(*streams[i]).tokens, solo(prompts[i], 8)) << round << " " << i;
  }
  // The second round restored something (the shared system prompt at least).
  EXPECT_GT(loop.counters().prefix_cache_hits.load(), 0);
  EXPECT_EQ(loop.counters().running.load(), 0);
}

// n > 1: the first choice keeps the prompt's state and last logits, and its siblings (waiting for
// it) restore them, so the prompt is prefilled once; every choice samples exactly what it samples
// without the cache.
TEST(ServerPrefixCache, ChoicesOfOnePromptPrefillItOnce) {
  test::ServedModel m(4);
  const std::vector<int32_t> p = ids(40, 9), other = ids(20, 11);
  auto request = [&] {
    server::EngineRequest r;
    for (int i = 0; i < 4; ++i) {
      server::ChoiceSpec c;
      c.prompt = i == 3 ? other : p;  // (the last choice is another prompt's)
      c.sampling.temperature = 1.0f;
      c.sampling.seed = 100 + uint64_t(i);
      c.sampling.max_tokens = 6;
      r.choices.push_back(std::move(c));
    }
    return r;
  };
  auto serve = [&](int cache, int64_t* prefilled, std::vector<int>* cached) {
    EngineLoop loop(*m.ex, *m.tok, cache_options(7, cache));
    auto stream = loop.submit(request());
    std::vector<std::vector<int32_t>> out(4);
    server::ChoiceEvent e;
    while (!stream->finished())
      if (stream->next(e, 5.0)) {
        EXPECT_TRUE(e.error.empty()) << e.error;
        auto& t = out[size_t(e.choice)];
        t.insert(t.end(), e.tokens.begin(), e.tokens.end());
        if (e.finish_reason && cached) (*cached)[size_t(e.choice)] = e.cached_tokens;
      }
    *prefilled = loop.counters().prompt_tokens.load();
    return out;
  };
  int64_t plain_rows = 0, cached_rows = 0;
  std::vector<int> cached(4, -1);
  const auto plain = serve(0, &plain_rows, nullptr);
  const auto with_cache = serve(12, &cached_rows, &cached);
  EXPECT_EQ(with_cache, plain);
  EXPECT_EQ(plain_rows, 3 * 40 + 20);
  EXPECT_EQ(cached_rows, 40 + 20);
  EXPECT_EQ(cached, (std::vector<int>{0, 40, 40, 0}));
}

TEST(ServerPrefixCache, APoolWithoutRoomForTheEntriesIsAnError) {
  test::ServedModel m(8);  // 16 slots
  EngineOptions o;
  o.max_batch = 8;
  o.max_model_len = 512;
  o.prefix_cache = 9;
  try {
    EngineLoop loop(*m.ex, *m.tok, o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("need 17 state slots"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace md
