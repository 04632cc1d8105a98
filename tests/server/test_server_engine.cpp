// The engine loop: continuous batching gives every sequence exactly its solo tokens (the
// executors are bit-identical per sequence, whatever the batch and the chunking), a cancelled
// request leaves within one step and frees its slot, and a full queue is refused at once.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <mutex>
#include <thread>

#include "megadecode/base/error.h"
#include "megadecode/exec/reference_executor.h"
#include "server/server_test_util.h"

namespace md {
namespace {

using server::ChoiceEvent;
using server::EngineLoop;
using server::EngineOptions;
using server::EngineRequest;

using test::collect;
using test::greedy_request;
using test::Outcome;
using test::prompts;

TEST(ServerEngine, BatchedGreedyEqualsSolo) {
  test::ServedModel m(8);
  EngineOptions o;
  o.max_batch = 8;
  o.prefill_chunk = 5;
  o.max_model_len = 512;
  const auto ps = prompts(*m.tok);
  const int kTokens = 20;
  // The solo reference: Generator over the same executor kind, one sequence at a time.
  std::vector<std::vector<int32_t>> solo;
  {
    CpuExecutor ex1(*m.model, 1, ExecutorKind::kMegakernel, [] {
      ExecutorOptions eo;
      eo.workers = 2;
      eo.pin = false;
      return eo;
    }());
    Generator g(*m.model, *m.tok);
    g.set_executor(&ex1, 7);
    for (const auto& p : ps) {
      SamplingParams sp;
      sp.temperature = 0;
      sp.max_tokens = kTokens;
      solo.push_back(g.generate(p, sp).tokens);
    }
  }
  EngineLoop loop(*m.ex, *m.tok, o);
  // Alone, through the loop.
  for (size_t i = 0; i < ps.size(); ++i)
    EXPECT_EQ(collect(*loop.submit(greedy_request(ps[i], kTokens))).tokens, solo[i]) << i;
  // All eight at once, then staggered arrivals (prefill beside decode steps).
  std::vector<std::shared_ptr<server::RequestStream>> streams;
  for (const auto& p : ps) streams.push_back(loop.submit(greedy_request(p, kTokens)));
  for (size_t i = 0; i < ps.size(); ++i) {
    const Outcome out = collect(*streams[i]);
    EXPECT_EQ(out.tokens, solo[i]) << "batched " << i;
    EXPECT_EQ(out.finish, "length");
    EXPECT_EQ(out.completion_tokens, kTokens);
  }
  streams.clear();
  for (size_t i = 0; i < ps.size(); ++i) {
    streams.push_back(loop.submit(greedy_request(ps[i], kTokens)));
    std::this_thread::sleep_for(std::chrono::milliseconds(2 * int(i)));
  }
  for (size_t i = 0; i < ps.size(); ++i)
    EXPECT_EQ(collect(*streams[i]).tokens, solo[i]) << "staggered " << i;
  EXPECT_EQ(loop.counters().running.load(), 0);
  EXPECT_GT(loop.counters().steps.load(), 0);
}

// A long prompt arriving beside a decoding stream is prefilled one chunk a step inside the
// stream's steps: the stream gets a token every step, and the prompt takes ceil(len / chunk)
// steps (never one frozen step for the whole prompt, never steps without the stream).
TEST(ServerEngine, LongPromptIsInterleavedChunkByChunk) {
  test::ServedModel m(2);
  EngineOptions o;
  o.max_batch = 2;
  o.prefill_chunk = 8;
  o.max_model_len = 1024;
  // The engine thread waits in a's first decode step (after its first token went out) until b
  // is queued, so b arrives while a decodes however slow this thread is (a loaded CI machine
  // once let a finish first).
  std::atomic<bool> b_queued{false};
  std::atomic<int> decode_steps{0};
  server::EngineObserver obs;
  obs.decode_batch = [&](int) {
    if (++decode_steps == 1)
      for (int i = 0; i < 10000 && !b_queued; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  EngineLoop loop(*m.ex, *m.tok, o, obs);
  auto a = loop.submit(greedy_request(m.tok->encode("hello", true), 100));
  ChoiceEvent e;
  int a_tokens = 0;
  while (a_tokens < 1)
    if (a->next(e, 5.0)) a_tokens += int(e.tokens.size());
  std::vector<int32_t> long_prompt(200);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = int32_t(1 + i % 50);
  auto b = loop.submit(greedy_request(long_prompt, 1));
  b_queued = true;
  const Outcome bo = collect(*b);
  // a's tokens so far (the stream may hold some not yet read).
  const int64_t tokens_when_b_done = loop.counters().generation_tokens.load() - 1;
  const Outcome ao = collect(*a);
  EXPECT_EQ(bo.tokens.size(), 1u);
  EXPECT_EQ(int(ao.tokens.size()) + a_tokens, 100);
  EXPECT_GE(tokens_when_b_done, 1 + 200 / 8 - 1) << "the prompt went in fewer steps than chunks";
  // Every step but a's own prefill decoded a: b's chunks added no step of their own.
  EXPECT_LE(loop.counters().steps.load(), 1 + 100);
}

// While anything decodes, a step's prompt rows are at most one chunk, whichever prompts they
// come from (short prompts arriving together share it), and every prompt row is fed once.
TEST(ServerEngine, PromptRowsPerStepStayWithinOneChunk) {
  test::ServedModel m(4);
  EngineOptions o;
  o.max_batch = 4;
  o.prefill_chunk = 8;
  o.max_model_len = 4096;
  std::mutex mu;
  std::vector<std::pair<int, int>> steps;  // (rows, decoding sequences)
  server::EngineObserver obs;  // both on the engine thread: `step`, then `decode_batch` if any
  obs.step = [&](double, int rows) {
    std::lock_guard<std::mutex> lk(mu);
    steps.emplace_back(rows, 0);
  };
  obs.decode_batch = [&](int b) {
    std::lock_guard<std::mutex> lk(mu);
    steps.back().second = b;
  };
  EngineLoop loop(*m.ex, *m.tok, o, obs);
  // `a` decodes until it is cancelled, so it is decoding whenever the others prefill, however
  // late this thread gets to submit them.
  auto a = loop.submit(greedy_request(m.tok->encode("hello", true), 4000));
  ChoiceEvent e;
  int a_tokens = 0;
  while (a_tokens < 2)
    if (a->next(e, 5.0)) a_tokens += int(e.tokens.size());
  std::vector<std::shared_ptr<server::RequestStream>> rest;
  for (int len : {3, 3, 10}) {
    std::vector<int32_t> p(static_cast<size_t>(len));
    for (int i = 0; i < len; ++i) p[size_t(i)] = 1 + i;
    rest.push_back(loop.submit(greedy_request(p, 2)));
  }
  for (auto& r : rest) EXPECT_EQ(collect(*r).finish, "length");
  a->cancel();
  collect(*a);
  std::lock_guard<std::mutex> lk(mu);
  int prompt_rows_while_decoding = 0;
  for (const auto& [rows, dec] : steps) {
    if (dec == 0) continue;  // a's own prefill
    EXPECT_LE(rows - dec, o.prefill_chunk) << "a step fed more than one chunk of prompt rows";
    prompt_rows_while_decoding += rows - dec;
  }
  EXPECT_EQ(prompt_rows_while_decoding, 3 + 3 + 10);
}

// The reference path behind the Executor interface: served greedy tokens equal Generator's on
// the reference path (one prefill call, then one forward a token), alone and beside others.
TEST(ServerEngine, ReferenceExecutorServesTheReferenceTokens) {
  test::ServedModel m(1);
  ReferenceExecutor ex(*m.model, 4, m.model->options().states);
  EngineOptions o;
  o.max_batch = 4;
  o.prefill_chunk = 64;  // every prompt in one forward call, as Generator prefills
  o.max_model_len = 512;
  const auto ps = prompts(*m.tok);
  std::vector<std::vector<int32_t>> solo;
  {
    Generator g(*m.model, *m.tok);
    for (size_t i = 0; i < 4; ++i) {
      SamplingParams sp;
      sp.temperature = 0;
      sp.max_tokens = 10;
      solo.push_back(g.generate(ps[i], sp).tokens);
    }
  }
  EngineLoop loop(ex, *m.tok, o);
  std::vector<std::shared_ptr<server::RequestStream>> streams;
  for (size_t i = 0; i < 4; ++i) streams.push_back(loop.submit(greedy_request(ps[i], 10)));
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(collect(*streams[i]).tokens, solo[i]) << i;
  EXPECT_THROW(ex.plan(1, 1), Error);
}

TEST(ServerEngine, StopIdsStopStringsAndSampling) {
  test::ServedModel m(2);
  EngineOptions o;
  o.max_batch = 2;
  o.max_model_len = 256;
  EngineLoop loop(*m.ex, *m.tok, o);
  const auto p = m.tok->encode("Once upon a time", true);
  const Outcome free_run = collect(*loop.submit(greedy_request(p, 12)));
  ASSERT_EQ(free_run.tokens.size(), 12u);
  // A stop id at the 4th generated token ends there (the id is reported, its text is not).
  EngineRequest r = greedy_request(p, 12);
  r.choices[0].sampling.stop_token_ids = {free_run.tokens[3]};
  const Outcome stopped = collect(*loop.submit(r));
  const auto first = std::find(free_run.tokens.begin(), free_run.tokens.end(), free_run.tokens[3]);
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(free_run.tokens.begin(), first + 1));
  EXPECT_EQ(stopped.finish, "stop");
  // Sampled with a seed: reproducible, and equal to the Generator's draw.
  EngineRequest s = greedy_request(p, 10);
  s.choices[0].sampling.temperature = 0.9f;
  s.choices[0].sampling.seed = 11;
  const Outcome a = collect(*loop.submit(s)), b = collect(*loop.submit(s));
  EXPECT_EQ(a.tokens, b.tokens);
  // The executor outlives the generator, whose sequence lives in the executor's pool.
  CpuExecutor ex1(*m.model, 1, ExecutorKind::kMegakernel, [] {
    ExecutorOptions eo;
    eo.workers = 2;
    eo.pin = false;
    return eo;
  }());
  Generator g(*m.model, *m.tok);
  g.set_executor(&ex1, 16);
  EXPECT_EQ(g.generate(p, s.choices[0].sampling).tokens, a.tokens);
  EXPECT_NE(a.tokens, std::vector<int32_t>(free_run.tokens.begin(), free_run.tokens.begin() + 10))
      << "sampling stayed greedy: the test cannot tell";
}

// --stream-interval N: the first token goes out alone (time to first token), then events of N
// tokens, the last event with what is left; the tokens and text are those of interval 1.
TEST(ServerEngine, StreamIntervalGroupsTokensIntoFewerEvents) {
  test::ServedModel m(2);
  EngineOptions o;
  o.max_batch = 2;
  o.max_model_len = 256;
  const auto p = m.tok->encode("Once upon a time", true);
  Outcome one;
  {
    EngineLoop loop(*m.ex, *m.tok, o);
    one = collect(*loop.submit(greedy_request(p, 11)));
  }
  ASSERT_EQ(one.tokens.size(), 11u);
  o.stream_interval = 4;
  EngineLoop loop(*m.ex, *m.tok, o);
  auto s = loop.submit(greedy_request(p, 11));
  std::vector<size_t> sizes;
  Outcome grouped;
  ChoiceEvent e;
  while (!s->finished())
    if (s->next(e, 5.0)) {
      sizes.push_back(e.tokens.size());
      grouped.tokens.insert(grouped.tokens.end(), e.tokens.begin(), e.tokens.end());
      grouped.text += e.text;
      if (e.finish_reason) grouped.finish = *e.finish_reason;
    }
  EXPECT_EQ(sizes, (std::vector<size_t>{1, 4, 4, 2}));
  EXPECT_EQ(grouped.tokens, one.tokens);
  EXPECT_EQ(grouped.text, one.text);
  EXPECT_EQ(grouped.finish, "length");
  o.stream_interval = 0;
  EXPECT_THROW(EngineLoop(*m.ex, *m.tok, o), Error);
}

TEST(ServerEngine, CancelFreesTheSlotWithinOneStep) {
  test::ServedModel m(1);
  EngineOptions o;
  o.max_batch = 1;
  o.max_queue = 4;
  o.max_model_len = 4096;
  EngineLoop loop(*m.ex, *m.tok, o);
  const auto p = m.tok->encode("hello", true);
  auto s = loop.submit(greedy_request(p, 4000));
  auto waiting = loop.submit(greedy_request(p, 5));  // needs the only slot
  ChoiceEvent e;
  int seen = 0;
  while (seen < 3)
    if (s->next(e, 5.0)) seen += int(e.tokens.size());
  // Only `s` runs (the other waits for its slot), so the generated-token counter is its count;
  // a step already under way may add one more, then the sequence leaves.
  const int64_t tokens_at_cancel = loop.counters().generation_tokens.load();
  s->cancel();
  Outcome out;
  while (!s->finished())
    if (s->next(e, 5.0) && e.finish_reason) {
      out.finish = *e.finish_reason;
      out.completion_tokens = e.completion_tokens;
    }
  EXPECT_EQ(out.finish, "abort");
  EXPECT_LE(out.completion_tokens, tokens_at_cancel + 1);
  EXPECT_GE(out.completion_tokens, 3);
  // The slot went to the waiting request, which completes normally.
  EXPECT_EQ(collect(*waiting).finish, "length");
  EXPECT_EQ(loop.counters().running.load(), 0);
}

TEST(ServerEngine, FullQueueIsRefusedAndShutdownAborts) {
  test::ServedModel m(1);
  EngineOptions o;
  o.max_batch = 1;
  o.max_queue = 1;
  o.max_model_len = 4096;
  auto loop = std::make_unique<EngineLoop>(*m.ex, *m.tok, o);
  const auto p = m.tok->encode("hello", true);
  auto a = loop->submit(greedy_request(p, 4000));
  // Wait until `a` holds the slot, then one may wait and the next is refused.
  while (loop->counters().running.load() == 0) std::this_thread::yield();
  auto b = loop->submit(greedy_request(p, 4000));
  try {
    loop->submit(greedy_request(p, 4));
    ADD_FAILURE() << "a full queue accepted a request";
  } catch (const server::ApiError& e) {
    EXPECT_EQ(e.status, 503);
    EXPECT_EQ(e.code, "queue_full");
  }
  loop->shutdown(0.0);
  EXPECT_EQ(collect(*a).finish, "abort");
  EXPECT_EQ(collect(*b).finish, "abort");
  try {
    loop->submit(greedy_request(p, 4));
    ADD_FAILURE() << "a stopped loop accepted a request";
  } catch (const server::ApiError& e) {
    EXPECT_EQ(e.status, 503);
  }
}

TEST(ServerEngine, LogprobsAndEchoPromptLogprobs) {
  test::ServedModel m(1);
  EngineOptions o;
  o.max_batch = 1;
  o.max_model_len = 256;
  o.prefill_chunk = 3;
  EngineLoop loop(*m.ex, *m.tok, o);
  const auto p = m.tok->encode("The quick brown fox", true);
  EngineRequest r = greedy_request(p, 4);
  r.top_logprobs = 3;
  r.prompt_logprobs = true;
  auto s = loop.submit(r);
  std::vector<server::TokenLogprob> gen, prompt;
  ChoiceEvent e;
  while (!s->finished())
    if (s->next(e, 5.0)) {
      gen.insert(gen.end(), e.logprobs.begin(), e.logprobs.end());
      if (!e.prompt_logprobs.empty()) prompt = e.prompt_logprobs;
    }
  ASSERT_EQ(gen.size(), 4u);
  ASSERT_EQ(prompt.size(), p.size() - 1);
  for (size_t i = 0; i < prompt.size(); ++i) EXPECT_EQ(prompt[i].id, p[i + 1]);
  // Greedy: the chosen token is the most likely one; logprobs are <= 0 and the tops descend.
  for (const auto& l : gen) {
    ASSERT_EQ(l.top.size(), 3u);
    EXPECT_EQ(l.top[0].first, l.id);
    EXPECT_FLOAT_EQ(l.top[0].second, l.logprob);
    EXPECT_LE(l.logprob, 0.0f);
    EXPECT_GE(l.top[0].second, l.top[1].second);
    EXPECT_GE(l.top[1].second, l.top[2].second);
  }
  // The prompt logprobs are those of the model's logits: check one by hand.
  SequenceState seq = m.model->new_sequence();
  std::vector<float> logits(size_t(m.model->config().vocab_size));
  m.model->forward(seq, std::span(p.data(), 1), logits.data(), false);
  double mx = *std::max_element(logits.begin(), logits.end()), sum = 0;
  for (float x : logits) sum += std::exp(double(x) - mx);
  EXPECT_NEAR(prompt[0].logprob, double(logits[size_t(p[1])]) - mx - std::log(sum), 1e-3);
}

// logit_bias: +100 on one id makes a greedy choice draw it at every step, -100 on the solo greedy
// output's first token keeps it out; a biased choice beside an unbiased one leaves the latter's
// tokens its solo ones (the bias is the choice's); the logprobs stay those of the model's logits.
TEST(ServerEngine, LogitBiasForcesAndBansTokensPerChoice) {
  test::ServedModel m(2);
  EngineOptions o;
  o.max_batch = 2;
  o.max_model_len = 256;
  EngineLoop loop(*m.ex, *m.tok, o);
  const auto p = m.tok->encode("The quick brown fox", true);
  const int kTokens = 6;
  const std::vector<int32_t> solo = collect(*loop.submit(greedy_request(p, kTokens))).tokens;
  ASSERT_EQ(solo.size(), size_t(kTokens));
  // A token the model does not pick first: forced by +100.
  int32_t forced = 0;
  while (forced == solo[0] || m.tok->is_special(forced)) ++forced;
  EngineRequest up = greedy_request(p, kTokens);
  up.choices[0].logit_bias = {{forced, 100.0f}};
  up.top_logprobs = 1;
  EngineRequest down = greedy_request(p, kTokens);
  down.choices[0].logit_bias = {{solo[0], -100.0f}};
  auto su = loop.submit(up);
  auto sd = loop.submit(greedy_request(p, kTokens));  // beside it, unbiased
  std::vector<int32_t> got;
  std::vector<server::TokenLogprob> lps;
  ChoiceEvent e;
  while (!su->finished())
    if (su->next(e, 5.0)) {
      got.insert(got.end(), e.tokens.begin(), e.tokens.end());
      lps.insert(lps.end(), e.logprobs.begin(), e.logprobs.end());
    }
  EXPECT_EQ(got, std::vector<int32_t>(size_t(kTokens), forced));
  EXPECT_EQ(collect(*sd).tokens, solo);
  // The first forced token's logprob is the model's own: below the solo choice's (the argmax).
  ASSERT_EQ(lps.size(), size_t(kTokens));
  EXPECT_LT(lps[0].logprob, lps[0].top[0].second + 1e-6f);
  EXPECT_NE(lps[0].top[0].first, forced);
  const std::vector<int32_t> banned = collect(*loop.submit(down)).tokens;
  ASSERT_FALSE(banned.empty());
  EXPECT_NE(banned[0], solo[0]);
}

}  // namespace
}  // namespace md

namespace md {
namespace {

// RequestStream::set_consumer: the events queued before it go to the consumer first, in order,
// then every push goes straight to it; `last` is set on the event after which none follows.
TEST(RequestStreamConsumer, TakesTheQueuedEventsThenTheLiveOnesInOrder) {
  server::RequestStream s(2);
  auto event = [](int choice, int32_t token, bool finish) {
    server::ChoiceEvent e;
    e.choice = choice;
    e.tokens = {token};
    if (finish) e.finish_reason = "length";
    return e;
  };
  s.push(event(0, 10, false));
  s.push(event(1, 20, true));
  std::vector<std::pair<int32_t, bool>> got;
  s.set_consumer([&](server::ChoiceEvent&& e, bool last) { got.emplace_back(e.tokens[0], last); });
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], std::make_pair(int32_t(10), false));
  EXPECT_EQ(got[1], std::make_pair(int32_t(20), false));  // choice 0 is still open
  EXPECT_FALSE(s.finished());
  s.push(event(0, 11, false));
  s.push(event(0, 12, true));
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[2], std::make_pair(int32_t(11), false));
  EXPECT_EQ(got[3], std::make_pair(int32_t(12), true));
  server::ChoiceEvent e;
  EXPECT_FALSE(s.next(e, 0.01));  // nothing is queued any more
  EXPECT_TRUE(s.finished());
}

}  // namespace
}  // namespace md
