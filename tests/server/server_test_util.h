// A tiny text checkpoint with a plan executor, shared by the server tests.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "megadecode/exec/cpu_executor.h"
#include "megadecode/server/engine_loop.h"
#include "megadecode/server/request.h"
#include "megadecode/text/generator.h"
#include "test_util.h"

namespace md::test {

struct ServedModel {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Generator> gen;
  std::unique_ptr<CpuExecutor> ex;
  explicit ServedModel(int max_batch = 8, ExecutorKind kind = ExecutorKind::kMegakernel) {
    const std::string dir = shared_text_checkpoint("tiny", 31);
    ModelOptions o;
    o.threads = 1;
    o.pin_threads = false;
    o.states.max_sequences = 16;
    o.states.cache_tokens = 16 * 4096;  // 4096 tokens a slot
    model = std::make_unique<Model>(dir, o);
    tok = std::make_unique<Tokenizer>(Tokenizer::load(dir, model->config().vocab_size));
    gen = std::make_unique<Generator>(*model, *tok);
    ExecutorOptions eo;
    eo.workers = 2;
    eo.pin = false;
    // The sanitizer runs share two cores with other jobs: a stalled worker there is load, not a
    // hang.
    eo.watchdog_seconds = 60;
    eo.states = o.states;
    ex = std::make_unique<CpuExecutor>(*model, max_batch, kind, eo);
  }
  server::ParseContext context(int max_model_len = 1024) const {
    server::ParseContext c;
    c.generator = gen.get();
    c.model_names = {"tiny"};
    c.vocab_size = tok->vocab_size();
    c.max_model_len = max_model_len;
    return c;
  }
};

// What a request's one choice produced, collected from its events.
struct Outcome {
  std::vector<int32_t> tokens;
  std::string text, finish;
  int completion_tokens = 0;
  int cached_tokens = 0;  // prompt tokens the prefix cache restored
};

inline Outcome collect(server::RequestStream& s) {
  Outcome o;
  server::ChoiceEvent e;
  while (!s.finished())
    if (s.next(e, 5.0)) {
      EXPECT_TRUE(e.error.empty()) << e.error;
      o.tokens.insert(o.tokens.end(), e.tokens.begin(), e.tokens.end());
      o.text += e.text;
      if (e.finish_reason) {
        o.finish = *e.finish_reason;
        o.completion_tokens = e.completion_tokens;
        o.cached_tokens = e.cached_tokens;
      }
    }
  return o;
}

inline server::EngineRequest greedy_request(std::vector<int32_t> prompt, int max_tokens) {
  server::ChoiceSpec c;
  c.prompt = std::move(prompt);
  c.sampling.temperature = 0;
  c.sampling.max_tokens = max_tokens;
  server::EngineRequest r;
  r.choices.push_back(std::move(c));
  return r;
}

// Prompts of different lengths (several prefill chunks, a chunk exactly, one token).
inline std::vector<std::vector<int32_t>> prompts(const Tokenizer& tok) {
  std::vector<std::vector<int32_t>> ps;
  const char* texts[] = {"The quick brown fox jumps over the lazy dog again and again",
                         "hello",
                         "a b c d e f g h i j k l m n o p",
                         "Once upon a time",
                         "x",
                         "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12",
                         "the the the",
                         "zebra"};
  for (const char* t : texts) ps.push_back(tok.encode(t, true));
  return ps;
}

// A mutated request body (the parsers' mutation tests): one of `seeds` with 1-4 edits (a byte
// flipped, a run deleted, a fragment spliced in or put in place of a value, a slice duplicated);
// the fragments: hostile JSON pieces and `extra` (the endpoint's own keys and values).
inline std::string mutated_body(const std::vector<std::string>& seeds,
                                const std::vector<std::string>& extra, std::mt19937_64& rng) {
  static const std::vector<std::string> hostile = {"null",
                                                   "-1",
                                                   "0",
                                                   "1e309",
                                                   "1.5",
                                                   "\"\"",
                                                   "\"x\"",
                                                   "[",
                                                   "]",
                                                   "{",
                                                   "}",
                                                   ",",
                                                   ":",
                                                   "true",
                                                   "[]",
                                                   "{}",
                                                   "\xff",
                                                   "\xc3",
                                                   "\\u0000",
                                                   "\\ud800",
                                                   "9223372036854775808",
                                                   "-9223372036854775809",
                                                   "[[[[[[[["};
  auto pick = [&](size_t n) { return size_t(rng() % n); };
  auto fragment = [&]() -> const std::string& {
    const size_t k = pick(hostile.size() + extra.size());
    return k < hostile.size() ? hostile[k] : extra[k - hostile.size()];
  };
  std::string b = seeds[pick(seeds.size())];
  const int edits = 1 + int(pick(4));
  for (int k = 0; k < edits; ++k) {
    const size_t at = pick(b.size() + 1);
    switch (pick(5)) {
      case 0:  // flip a byte
        if (!b.empty()) b[std::min(at, b.size() - 1)] ^= char(1 + pick(255));
        break;
      case 1:  // delete a run
        b.erase(std::min(at, b.size()), 1 + pick(8));
        break;
      case 2:  // splice a fragment
        b.insert(at, fragment());
        break;
      case 3: {  // replace a value after a colon with a fragment
        const size_t colon = b.find(':', at);
        if (colon != std::string::npos) {
          const size_t end = b.find_first_of(",}", colon);
          b.replace(colon + 1, (end == std::string::npos ? b.size() : end) - colon - 1, fragment());
        }
        break;
      }
      default:  // duplicate a slice
        if (!b.empty()) b.insert(at, b.substr(pick(b.size()), 1 + pick(16)));
    }
  }
  return b;
}

// The ApiError a parse throws (status 0 when it does not throw).
template <class F>
server::ApiError error_of(F&& f) {
  try {
    f();
  } catch (const server::ApiError& e) {
    return e;
  }
  return server::ApiError(0, "no error");
}

// Whether `program` (a Kimi tool-call program) lets a second call begin after one call of
// get_weather with {} (false: the one call must end the section).
inline bool allows_second_call(const ServedModel& m,
                               std::shared_ptr<const ConstraintProgram> program) {
  auto vocab = std::make_shared<const ConstraintVocab>(*m.tok, m.model->config().vocab_size);
  TokenConstraint c(std::move(program), vocab);
  for (int32_t id : m.tok->encode("<|tool_calls_section_begin|><|tool_call_begin|>functions."
                                  "get_weather:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
                                  true)) {
    EXPECT_TRUE(c.allows(id)) << id;
    c.accept(id);
  }
  EXPECT_TRUE(c.allows(*m.tok->special_id("<|tool_calls_section_end|>")));
  return c.allows(*m.tok->special_id("<|tool_call_begin|>"));
}

}  // namespace md::test
