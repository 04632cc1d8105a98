// What one streamed token costs the engine thread to render, per endpoint: a text event (one
// token, a short word) through each stream renderer (src/server/stream_renderer.h), the chunk or
// event text that the engine thread then sends. A streamed token pays this once, between steps.
//   ./build/bench/megadecode_bench_render
#include <benchmark/benchmark.h>

#include <memory>
#include <string>

#include "megadecode/server/anthropic_api.h"
#include "megadecode/server/responses_api.h"
#include "megadecode/tokenizer/tokenizer.h"
#include "stream_renderer.h"

namespace {

using namespace md;
using namespace md::server;

const Tokenizer& tokenizer() {
  static const Tokenizer tok = Tokenizer::load(MD_BENCH_TOKENIZER_DIR);
  return tok;
}

ChoiceEvent text_event(bool logprobs) {
  ChoiceEvent e;
  e.tokens = {1234};
  e.text = " hello";
  if (logprobs) e.logprobs = {{1234, -0.25f, {}}};
  return e;
}

// Renders the same one-token event again and again (a renderer holds no per-token state that
// grows, other than the text each builder keeps for its final object).
void run(benchmark::State& state, StreamRenderer& r, bool logprobs) {
  benchmark::DoNotOptimize(r.start());
  size_t bytes = 0;
  for (auto _ : state) {
    ChoiceEvent e = text_event(logprobs);
    const std::string out = r.event(e);
    bytes += out.size();
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["bytes/token"] = double(bytes) / double(state.iterations());
}

CompletionRequest chat_request(RequestKind kind, bool logprobs) {
  CompletionRequest r;
  r.kind = kind;
  r.prompts = {{1, 2, 3}};
  r.logprobs = logprobs;
  return r;
}

void BM_ChatChunk(benchmark::State& state) {
  const bool lp = state.range(0) != 0;
  ChatStreamRenderer r(chat_request(RequestKind::kChat, lp),
                       {"chatcmpl-0123456789abcdef", 1796432931, "small"}, tokenizer(), 1);
  run(state, r, lp);
}
BENCHMARK(BM_ChatChunk)->ArgName("logprobs")->Arg(0)->Arg(1);

void BM_CompletionChunk(benchmark::State& state) {
  ChatStreamRenderer r(chat_request(RequestKind::kCompletion, false),
                       {"cmpl-0123456789abcdef", 1796432931, "small"}, tokenizer(), 1);
  run(state, r, false);
}
BENCHMARK(BM_CompletionChunk);

void BM_ResponsesEvent(benchmark::State& state) {
  const bool lp = state.range(0) != 0;
  auto req = std::make_shared<ResponsesRequest>();
  req->chat = chat_request(RequestKind::kChat, lp);
  req->echo = {{"tools", nlohmann::json::array()}};
  auto r = responses_stream_renderer(req, {response_id("resp"), 1796432931, "small"}, tokenizer(),
                                     nullptr);
  run(state, *r, lp);
}
BENCHMARK(BM_ResponsesEvent)->ArgName("logprobs")->Arg(0)->Arg(1);

void BM_MessagesEvent(benchmark::State& state) {
  auto req = std::make_shared<MessagesRequest>();
  req->chat = chat_request(RequestKind::kChat, false);
  auto r = messages_stream_renderer(req, {response_id("msg"), 1796432931, "small"});
  run(state, *r, false);
}
BENCHMARK(BM_MessagesEvent);

}  // namespace

BENCHMARK_MAIN();
