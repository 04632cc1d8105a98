// The HTTP front end against a server started in-process on a free loopback port, with
// cpp-httplib's client (and a raw socket for the disconnect test).
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "megadecode/base/util.h"
#include "megadecode/server/http_server.h"
#include "server/http_test_server.h"

namespace md {
namespace {

using nlohmann::json;
using test::post_json;
using test::sse_data;
using test::TestServer;
using ::testing::HasSubstr;

class ServerHttp : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = new TestServer(8); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static TestServer* server_;
};
TestServer* ServerHttp::server_ = nullptr;

TEST_F(ServerHttp, InfoEndpoints) {
  auto c = server_->client();
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto v = c.Get("/version");
  ASSERT_TRUE(v);
  EXPECT_EQ(json::parse(v->body)["version"], "0.1.0");
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  const json mj = json::parse(models->body);
  EXPECT_EQ(mj["object"], "list");
  EXPECT_EQ(mj["data"][0]["id"], "tiny");
  EXPECT_EQ(mj["data"][0]["max_model_len"], 4096);
  auto api = c.Get("/openapi.json");
  ASSERT_TRUE(api);
  const json aj = json::parse(api->body);
  for (const char* p : {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                        "/detokenize", "/metrics", "/health", "/version"})
    EXPECT_TRUE(aj["paths"].contains(p)) << p;
  auto none = c.Get("/v1/nothing");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 404);
  EXPECT_TRUE(json::parse(none->body)["error"].contains("message"));
  // tokenize / detokenize round trip.
  const json t = post_json(*server_, "/tokenize", {{"prompt", "hello world"}});
  EXPECT_EQ(t["tokens"].get<std::vector<int32_t>>(), server_->m.tok->encode("hello world", true));
  EXPECT_EQ(t["count"], t["tokens"].size());
  const json d = post_json(*server_, "/detokenize", {{"tokens", t["tokens"]}});
  EXPECT_EQ(d["prompt"], "hello world");
}

TEST_F(ServerHttp, CompletionMatchesTheGenerator) {
  const std::vector<int32_t> prompt = server_->m.tok->encode("The quick brown fox", true);
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 8;
  CpuExecutor ex1(*server_->m.model, 1, ExecutorKind::kMegakernel, [] {
    ExecutorOptions eo;
    eo.workers = 2;
    eo.pin = false;
    return eo;
  }());
  Generator g(*server_->m.model, *server_->m.tok);
  g.set_executor(&ex1, 16);
  const GenerationResult want = g.generate(prompt, sp);
  const json r = post_json(*server_, "/v1/completions",
                           {{"model", "tiny"},
                            {"prompt", prompt},
                            {"max_tokens", 8},
                            {"temperature", 0},
                            {"ignore_eos", true}});
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["choices"][0]["text"], want.text);
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(r["usage"]["completion_tokens"], 8);
  EXPECT_EQ(r["usage"]["total_tokens"], prompt.size() + 8);
  // echo + logprobs: an entry per prompt token (the first without a logprob) and per token.
  const json e = post_json(*server_, "/v1/completions",
                           {{"prompt", prompt},
                            {"max_tokens", 3},
                            {"temperature", 0},
                            {"ignore_eos", true},
                            {"echo", true},
                            {"logprobs", 2}});
  const json& lp = e["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), prompt.size() + 3);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["token_logprobs"][1].is_number());
  EXPECT_EQ(lp["top_logprobs"][prompt.size()].size(), 2u);
  EXPECT_EQ(e["choices"][0]["text"].get<std::string>().rfind(
                sanitize_utf8(server_->m.tok->decode(prompt)), 0),
            0u);
  // The same streamed: the prompt text and its logprobs come with the first token.
  auto c = server_->client();
  auto st = c.Post("/v1/completions",
                   json{{"prompt", prompt},
                        {"max_tokens", 3},
                        {"temperature", 0},
                        {"ignore_eos", true},
                        {"echo", true},
                        {"logprobs", 2},
                        {"stream", true}}
                       .dump(),
                   "application/json");
  ASSERT_TRUE(st);
  std::string streamed_text;
  json streamed_tokens = json::array(), streamed_offsets = json::array();
  for (const std::string& d : sse_data(st->body)) {
    if (d == "[DONE]") break;
    const json ch = json::parse(d)["choices"][0];
    streamed_text += ch["text"].get<std::string>();
    if (ch["logprobs"].is_object())
      for (size_t k = 0; k < ch["logprobs"]["tokens"].size(); ++k) {
        streamed_tokens.push_back(ch["logprobs"]["tokens"][k]);
        streamed_offsets.push_back(ch["logprobs"]["text_offset"][k]);
      }
  }
  EXPECT_EQ(streamed_text, e["choices"][0]["text"]);
  EXPECT_EQ(streamed_tokens, lp["tokens"]);
  EXPECT_EQ(streamed_offsets, lp["text_offset"]);
  // lm-eval's loglikelihood request: echo, logprobs, no new tokens.
  const json ll = post_json(
      *server_, "/v1/completions",
      {{"prompt", prompt}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 1}, {"temperature", 0}});
  EXPECT_EQ(ll["choices"][0]["logprobs"]["tokens"].size(), prompt.size());
  EXPECT_EQ(ll["usage"]["completion_tokens"], 0);
  EXPECT_EQ(ll["choices"][0]["logprobs"]["token_logprobs"][1],
            e["choices"][0]["logprobs"]["token_logprobs"][1]);
  // n = 2 sampled choices with a seed: two choices, reproducible.
  const json body = {
      {"prompt", "hello"}, {"max_tokens", 6}, {"n", 2}, {"seed", 5}, {"ignore_eos", true}};
  const json n1 = post_json(*server_, "/v1/completions", body),
             n2 = post_json(*server_, "/v1/completions", body);
  ASSERT_EQ(n1["choices"].size(), 2u);
  EXPECT_EQ(n1["choices"][1]["index"], 1);
  EXPECT_EQ(n1["choices"], n2["choices"]);
  EXPECT_EQ(n1["usage"]["completion_tokens"], 12);
}

// A prompt that starts with an earlier one restores its state: usage says how many prompt tokens
// were cached (OpenAI's prompt_tokens_details.cached_tokens), streamed or not, and /metrics counts
// them.
TEST_F(ServerHttp, PrefixCacheHitsAreReportedInUsageAndMetrics) {
  std::vector<int32_t> p;
  for (int i = 0; i < 40; ++i) p.push_back(int32_t(3 + (i * 29) % 83));
  const json body = {{"prompt", p}, {"max_tokens", 3}, {"temperature", 0}, {"ignore_eos", true}};
  const json first = post_json(*server_, "/v1/completions", body);
  EXPECT_EQ(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  std::vector<int32_t> longer = p;
  for (int32_t id : {90, 91, 92, 93}) longer.push_back(id);
  json b2 = body;
  b2["prompt"] = longer;
  const json second = post_json(*server_, "/v1/completions", b2);
  const int cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
  EXPECT_GE(cached, 40);
  EXPECT_LT(cached, int(longer.size()));
  EXPECT_EQ(second["usage"]["prompt_tokens"], longer.size());
  // Streamed, the usage chunk says the same.
  b2["stream"] = true;
  b2["stream_options"] = {{"include_usage", true}};
  auto c = server_->client();
  auto st = c.Post("/v1/completions", b2.dump(), "application/json");
  ASSERT_TRUE(st);
  json usage;
  for (const std::string& d : sse_data(st->body))
    if (d != "[DONE]" && json::parse(d)["usage"].is_object()) usage = json::parse(d)["usage"];
  ASSERT_TRUE(usage.is_object()) << st->body;
  EXPECT_GE(usage["prompt_tokens_details"]["cached_tokens"].get<int>(), 40);
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  const size_t at = m->body.find("\nmegadecode_prefix_cache_hits_total ");
  ASSERT_NE(at, std::string::npos);
  EXPECT_GE(std::stol(m->body.substr(at + 36)), 80);
  EXPECT_NE(m->body.find("megadecode_prefix_cache_queries_total"), std::string::npos);
  // What it holds: entries (at most the 8 slots given to it) and their bytes.
  const size_t e = m->body.find("\nmegadecode_prefix_cache_entries ");
  ASSERT_NE(e, std::string::npos);
  const long entries = std::stol(m->body.substr(e + 33));
  EXPECT_GE(entries, 1);
  EXPECT_LE(entries, 8);
  const size_t b = m->body.find("\nmegadecode_prefix_cache_bytes ");
  ASSERT_NE(b, std::string::npos);
  EXPECT_GE(std::stol(m->body.substr(b + 31)),
            entries * long(server_->m.ex->states().slot_bytes()));
}

TEST_F(ServerHttp, ChatStreamEqualsNonStream) {
  const json body = {{"messages", {{{"role", "user"}, {"content", "tell me a story"}}}},
                     {"max_tokens", 10},
                     {"temperature", 0},
                     {"ignore_eos", true},
                     {"logprobs", true},
                     {"top_logprobs", 1}};
  const json whole = post_json(*server_, "/v1/chat/completions", body);
  EXPECT_EQ(whole["object"], "chat.completion");
  EXPECT_EQ(whole["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(whole["choices"][0]["logprobs"]["content"].size(), 10u);
  json sbody = body;
  sbody["stream"] = true;
  sbody["stream_options"] = {{"include_usage", true}};
  auto c = server_->client();
  auto r = c.Post("/v1/chat/completions", sbody.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_THAT(r->get_header_value("Content-Type"), HasSubstr("text/event-stream"));
  const auto data = sse_data(r->body);
  ASSERT_GE(data.size(), 3u);
  EXPECT_EQ(data.back(), "[DONE]");
  std::string content;
  int logprob_entries = 0;
  std::string finish;
  for (size_t i = 0; i + 2 < data.size(); ++i) {
    const json ch = json::parse(data[i]);
    EXPECT_EQ(ch["object"], "chat.completion.chunk");
    EXPECT_TRUE(ch.contains("usage") && ch["usage"].is_null());
    const json& delta = ch["choices"][0]["delta"];
    if (i == 0) {
      EXPECT_EQ(delta["role"], "assistant");
    }
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (ch["choices"][0]["logprobs"].is_object())
      logprob_entries += int(ch["choices"][0]["logprobs"]["content"].size());
    if (!ch["choices"][0]["finish_reason"].is_null()) finish = ch["choices"][0]["finish_reason"];
  }
  const json usage = json::parse(data[data.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  // (The same counts; the second request's prompt came from the prefix cache.)
  for (const char* k : {"prompt_tokens", "completion_tokens", "total_tokens"})
    EXPECT_EQ(usage["usage"][k], whole["usage"][k]) << k;
  EXPECT_EQ(usage["usage"]["prompt_tokens_details"]["cached_tokens"],
            usage["usage"]["prompt_tokens"]);
  EXPECT_EQ(content, whole["choices"][0]["message"]["content"]);
  EXPECT_EQ(logprob_entries, 10);
  EXPECT_EQ(finish, "length");
}

TEST_F(ServerHttp, BadInputsGetErrorsAndTheServerKeepsServing) {
  auto c = server_->client();
  struct Case {
    std::string path, body;
    int status;
    std::string param;
  };
  std::string huge_prompt = "[";
  for (int i = 0; i < 4200; ++i) huge_prompt += i ? ",7" : "7";
  huge_prompt += "]";
  const std::vector<Case> cases = {
      {"/v1/completions", "{not json", 400, ""},
      {"/v1/completions", "{\"prompt\":\"\xc3\x28\"}", 400, ""},
      {"/v1/completions", R"({"prompt":"a","model":"nope"})", 404, "model"},
      {"/v1/completions", R"({"prompt":"a","max_tokens":-5})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt":"a","top_p":2})", 400, "top_p"},
      {"/v1/completions", "{\"prompt\":" + huge_prompt + "}", 400, "prompt"},
      {"/v1/completions", "{\"prompt\":" + std::string(5000, '[') + "}", 400, ""},
      {"/v1/chat/completions", R"({"messages":[]})", 400, "messages"},
      {"/v1/chat/completions", R"({"messages":[{"role":"robot","content":"x"}]})", 400,
       "messages.0.role"},
      {"/v1/completions", "{\"prompt\":\"" + std::string(2 << 20, 'a') + "\"}", 413, ""},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.body.substr(0, 80));
    auto r = c.Post(k.path.c_str(), k.body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, k.status) << r->body;
    const json e = json::parse(r->body);
    ASSERT_TRUE(e.contains("error")) << r->body;
    EXPECT_FALSE(e["error"]["message"].get<std::string>().empty());
    if (k.param.empty()) {
      EXPECT_TRUE(e["error"]["param"].is_null()) << r->body;
    } else {
      EXPECT_EQ(e["error"]["param"], k.param);
    }
  }
  post_json(*server_, "/v1/completions", {{"prompt", "still here"}, {"max_tokens", 2}});
}

TEST_F(ServerHttp, SixteenConcurrentClientsGetTheirSoloOutput) {
  const int kClients = 16;
  auto body = [](int i) {
    return json{{"prompt", "client " + std::to_string(i) + std::string(size_t(i), '!')},
                {"max_tokens", 12},
                {"temperature", 0},
                {"ignore_eos", true},
                {"stream", i % 2 == 1}};
  };
  auto text_of = [](const httplib::Result& r, bool stream) {
    if (!stream) return json::parse(r->body)["choices"][0]["text"].get<std::string>();
    std::string t;
    for (const std::string& d : sse_data(r->body))
      if (d != "[DONE]") t += json::parse(d)["choices"][0]["text"].get<std::string>();
    return t;
  };
  std::vector<std::string> solo(kClients), together(kClients);
  for (int i = 0; i < kClients; ++i) {
    auto c = server_->client();
    auto r = c.Post("/v1/completions", body(i).dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200);
    solo[size_t(i)] = text_of(r, i % 2 == 1);
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      auto c = server_->client();
      auto r = c.Post("/v1/completions", body(i).dump(), "application/json");
      if (r && r->status == 200)
        together[size_t(i)] = text_of(r, i % 2 == 1);
      else  // what went wrong, in place of the text
        together[size_t(i)] = r ? "HTTP " + std::to_string(r->status) + ": " + r->body
                                : "client error " + httplib::to_string(r.error());
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(together[size_t(i)], solo[size_t(i)]) << i;
}

// Reads a streamed completion on a raw socket, hangs up after two chunks, and watches the slot
// come free: the engine aborts the sequence at the next step after the failed write.
TEST_F(ServerHttp, DisconnectMidStreamFreesTheSlot) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(server_->port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const auto& counters = server_->engine->counters();
  const int64_t tokens_before = counters.generation_tokens.load();
  const std::string body = json{
      {"prompt", "go on"},
      {"max_tokens", 4000},
      {"ignore_eos", true},
      {"stream", true}}.dump();
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
      "application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(send(fd, req.data(), req.size(), 0), ssize_t(req.size()));
  std::string got;
  char buf[4096];
  while (std::count(got.begin(), got.end(), '\n') < 12) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0);
    got.append(buf, size_t(n));
  }
  EXPECT_THAT(got, HasSubstr("data: {"));
  close(fd);
  for (int i = 0; i < 2000 && counters.running.load() > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(counters.running.load(), 0);
  // It left early: far fewer than its 4000 tokens were made.
  EXPECT_LT(counters.generation_tokens.load() - tokens_before, 2000);
  auto c = server_->client();
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_THAT(m->body, HasSubstr("megadecode_sequences_finished_total{finish_reason=\"abort\"}"));
  EXPECT_THAT(m->body, HasSubstr("megadecode_time_to_first_token_seconds_bucket"));
}

// Sends `body` as a POST of `path` on a raw socket (no response read); returns the socket.
int raw_post(int port, const std::string& path, const std::string& body) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  const std::string req = "POST " + path +
                          " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          "Content-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body;
  if (send(fd, req.data(), req.size(), 0) != ssize_t(req.size())) {
    close(fd);
    return -1;
  }
  return fd;
}

// A client that hangs up while its non-streamed completion runs: the handler sees the closed
// connection (no write needed), the engine aborts the sequence at its next step, the slot is
// free within a fraction of a second, and the access log / metrics record a 499.
TEST_F(ServerHttp, DisconnectDuringNonStreamedCompletionFreesTheSlot) {
  const auto& counters = server_->engine->counters();
  const int64_t tokens_before = counters.generation_tokens.load();
  const int fd =
      raw_post(server_->port, "/v1/completions",
               json{{"prompt", "go on"}, {"max_tokens", 4000}, {"ignore_eos", true}}.dump());
  ASSERT_GE(fd, 0);
  // Running, with a few tokens made.
  for (int i = 0; i < 2000 && counters.generation_tokens.load() - tokens_before < 5; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(counters.running.load(), 1);
  close(fd);
  const double t0 = now_seconds();
  while (counters.running.load() > 0 && now_seconds() - t0 < 20)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const double freed_after = now_seconds() - t0;
  EXPECT_EQ(counters.running.load(), 0);
  EXPECT_LT(freed_after, 2.0);
  EXPECT_LT(counters.generation_tokens.load() - tokens_before, 4000);
  auto c = server_->client();
  // The metrics count the response once the handler has returned (it is logged after), and the
  // abort once the engine thread has finished the sequence, which may come after the slot count
  // drops: wait (1 s at most) for both.
  std::string metrics;
  for (int i = 0; i < 200 && (metrics.find("status=\"499\"") == std::string::npos ||
                              metrics.find("finish_reason=\"abort\"") == std::string::npos);
       ++i) {
    auto m = c.Get("/metrics");
    ASSERT_TRUE(m);
    metrics = m->body;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_THAT(metrics, HasSubstr("megadecode_http_responses_total{status=\"499\"}"));
  EXPECT_THAT(metrics, HasSubstr("megadecode_sequences_finished_total{finish_reason=\"abort\"}"));
  // Errors found before generation still get their status.
  auto bad = c.Post("/v1/completions", R"({"prompt":"a","max_tokens":-5})", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
}

// Tool calls end to end on the Kimi Linear format: the model's output is forced to a tool-call
// section (a random checkpoint never writes one), which comes back as message.tool_calls with
// finish_reason "tool_calls"; streamed, the content comes first as it is generated, each call's
// id and name once its header is complete, then its arguments in pieces, and the deltas add up to
// the whole message.
// The body of a raw HTTP/1.1 response with chunked transfer encoding: the chunks joined.
std::string dechunk(const std::string& raw) {
  size_t at = raw.find("\r\n\r\n");
  if (at == std::string::npos) return "";
  at += 4;
  std::string body;
  for (;;) {
    const size_t eol = raw.find("\r\n", at);
    if (eol == std::string::npos) break;
    const size_t n = std::stoul(raw.substr(at, eol - at), nullptr, 16);
    if (n == 0) break;
    body += raw.substr(eol + 2, n);
    at = eol + 2 + n + 2;
  }
  return body;
}

// A streamed completion's text, its chunks that carry a choice, and its usage's token count.
struct StreamedText {
  std::string text;
  int chunks = 0;
  int64_t completion_tokens = -1;
  bool done = false;
};
StreamedText read_stream(const std::string& body) {
  StreamedText st;
  for (const std::string& d : sse_data(body)) {
    if (d == "[DONE]") {
      st.done = true;
      continue;
    }
    const json j = json::parse(d);
    if (j.contains("usage") && j["usage"].is_object())
      st.completion_tokens = j["usage"]["completion_tokens"];
    if (j["choices"].empty()) continue;
    ++st.chunks;
    st.text += j["choices"][0]["text"].get<std::string>();
  }
  return st;
}

// A client that reads nothing holds up neither the engine nor the other streams: its chunks wait
// in its response's buffer (the socket takes a few kilobytes, then would block), its sequence
// runs to the end, another stream is served meanwhile, and when the client reads at last it gets
// the whole stream, equal to the non-streamed completion. Every token has its chunk, also one
// whose text is held back (as vLLM streams), so the chunks count the tokens.
TEST_F(ServerHttp, ASlowReaderHoldsUpNothingAndGetsItsWholeStream) {
  const json body = {
      {"prompt", "a slow reader"}, {"max_tokens", 600}, {"temperature", 0}, {"ignore_eos", true}};
  const json whole = post_json(*server_, "/v1/completions", body);
  json sbody = body;
  sbody["stream"] = true;
  sbody["stream_options"] = {{"include_usage", true}};
  // A small receive buffer, set before connecting, so the server's writes would block early.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  const int small = 2048;
  ASSERT_EQ(setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small), 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(server_->port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  // And a small send buffer on the server's end of the connection (this process's socket):
  // loopback TCP would otherwise grow it to megabytes.
  sockaddr_in me{};
  socklen_t len = sizeof me;
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len), 0);
  int server_fd = -1;
  for (int i = 0; i < 2000 && server_fd < 0; ++i) {
    server_fd =
        server::connection_socket("127.0.0.1", server_->port, "127.0.0.1", ntohs(me.sin_port));
    if (server_fd < 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_GE(server_fd, 0);
  const int sndbuf = 4096;
  ASSERT_EQ(setsockopt(server_fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf), 0);
  const std::string payload = sbody.dump();
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(payload.size()) + "\r\n\r\n" + payload;
  ASSERT_EQ(send(fd, req.data(), req.size(), 0), ssize_t(req.size()));
  // Another stream, served while the first client reads nothing.
  json other = body;
  other["prompt"] = "meanwhile";
  other["max_tokens"] = 16;
  other["stream"] = true;
  auto c = server_->client();
  auto r = c.Post("/v1/completions", other.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(read_stream(r->body).chunks, 16);
  // The slow client's sequence ends without it having read a byte.
  const auto& counters = server_->engine->counters();
  for (int i = 0; i < 6000 && counters.running.load() > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(counters.running.load(), 0);
  std::string raw;
  char buf[4096];
  while (raw.find("data: [DONE]") == std::string::npos) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0) << "the stream ended early after " << raw.size() << " bytes";
    raw.append(buf, size_t(n));
  }
  close(fd);
  ASSERT_GT(raw.size(), size_t(64) << 10);  // more than the socket buffers hold
  const StreamedText st = read_stream(dechunk(raw));
  EXPECT_TRUE(st.done);
  EXPECT_EQ(st.text, whole["choices"][0]["text"]);
  EXPECT_EQ(st.completion_tokens, 600);
  EXPECT_EQ(st.chunks, 600);
}

// The queued path (the HTTP thread writes the chunks; also used where the connection's socket
// cannot be found) streams what the engine-written path streams.
TEST(ServerHttpQueued, StreamsAsTheEngineWrittenPathDoes) {
  const json body = {{"prompt", "the same words"},
                     {"max_tokens", 40},
                     {"temperature", 0},
                     {"ignore_eos", true},
                     {"stream", true},
                     {"stream_options", {{"include_usage", true}}}};
  StreamedText got[2];
  for (const bool engine_writes : {true, false}) {
    TestServer s(2, "", 1 << 20, "", engine_writes);
    auto c = s.client();
    auto r = c.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200);
    got[engine_writes] = read_stream(r->body);
  }
  for (const StreamedText& st : got) {
    EXPECT_TRUE(st.done);
    EXPECT_EQ(st.chunks, 40);
    EXPECT_EQ(st.completion_tokens, 40);
  }
  EXPECT_EQ(got[0].text, got[1].text);
}

TEST(ServerHttpToolCalls, KimiMarkupComesBackAsToolCalls) {
  const std::string call0 =
      "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": "
      "\"Paris\"}<|tool_call_end|>";
  const std::string call1 =
      "<|tool_call_begin|>functions.time:1<|tool_call_argument_begin|>{}<|tool_call_end|>";
  const std::string markup =
      "Let me check.<|tool_calls_section_begin|>" + call0 + call1 + "<|tool_calls_section_end|>";
  TestServer s(2, "", 1 << 20, markup + "<|im_end|>");
  const json tools = json::parse(
      R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}},
          {"type":"function","function":{"name":"time"}}])");
  json body = {{"messages", {{{"role", "user"}, {"content", "weather?"}}}},
               {"tools", tools},
               {"max_tokens", 200},
               {"temperature", 0}};
  const json whole = post_json(s, "/v1/chat/completions", body);
  const json& choice = whole["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  const json& msg = choice["message"];
  EXPECT_EQ(msg["content"], "Let me check.");
  ASSERT_EQ(msg["tool_calls"].size(), 2u) << whole.dump();
  EXPECT_EQ(msg["tool_calls"][0], json::parse(R"({"id":"functions.get_weather:0","type":"function",
                            "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}})"));
  EXPECT_EQ(msg["tool_calls"][1]["function"]["name"], "time");
  EXPECT_EQ(msg["tool_calls"][1]["function"]["arguments"], "{}");

  body["stream"] = true;
  auto c = s.client();
  auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  std::string content, finish;
  json calls = json::array();
  int content_chunks_before_calls = 0, argument_pieces = 0;
  for (const std::string& d : sse_data(r->body)) {
    if (d == "[DONE]") break;
    const json ch = json::parse(d)["choices"][0];
    const json& delta = ch["delta"];
    if (delta.contains("content")) {
      content += delta["content"].get<std::string>();
      if (calls.empty() && !delta["content"].get<std::string>().empty())
        ++content_chunks_before_calls;
    }
    if (delta.contains("tool_calls"))
      for (json tc : delta["tool_calls"]) {
        const size_t index = tc["index"].get<size_t>();
        tc.erase("index");
        if (tc.contains("id")) {  // a call's first piece: id, type, name and arguments so far
          EXPECT_EQ(index, calls.size());
          calls.push_back(tc);
        } else {  // the next piece of its arguments
          ASSERT_EQ(index + 1, calls.size());
          EXPECT_EQ(tc.size(), 1u);
          calls[index]["function"]["arguments"] =
              calls[index]["function"]["arguments"].get<std::string>() +
              tc["function"]["arguments"].get<std::string>();
          ++argument_pieces;
        }
      }
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  EXPECT_EQ(content, msg["content"]);
  EXPECT_EQ(calls, msg["tool_calls"]);
  EXPECT_EQ(finish, "tool_calls");
  EXPECT_GT(content_chunks_before_calls, 1);  // streamed token by token, not held to the end
  EXPECT_GT(argument_pieces, 2);              // and so are the arguments

  // Without tools the markup is content; cut inside the second call (max_tokens), the first
  // call is a call, the rest content, and the finish reason the sampler's.
  json plain = body;
  plain.erase("tools");
  plain["stream"] = false;
  const json p = post_json(s, "/v1/chat/completions", plain);
  EXPECT_EQ(p["choices"][0]["message"]["content"], markup);
  EXPECT_FALSE(p["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(p["choices"][0]["finish_reason"], "stop");
  json cut = body;
  cut["stream"] = false;
  const std::string prefix = "Let me check.<|tool_calls_section_begin|>" + call0;
  cut["max_tokens"] = s.m.tok->encode(prefix, true).size() + 4;
  const json k = post_json(s, "/v1/chat/completions", cut);
  EXPECT_EQ(k["choices"][0]["finish_reason"], "length");
  ASSERT_EQ(k["choices"][0]["message"]["tool_calls"].size(), 1u);
  EXPECT_THAT(k["choices"][0]["message"]["content"].get<std::string>(),
              ::testing::StartsWith("Let me check.<|tool_call_begin|>"));
}

TEST(ServerHttpAuth, ApiKeyIsRequiredOnV1) {
  TestServer s(1, "sekret");
  auto c = s.client();
  const std::string body = R"({"prompt":"hi","max_tokens":2})";
  auto no = c.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(no);
  EXPECT_EQ(no->status, 401);
  EXPECT_EQ(json::parse(no->body)["error"]["code"], "invalid_api_key");
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 401);
  httplib::Headers wrong = {{"Authorization", "Bearer nope"}};
  auto bad = c.Post("/v1/completions", wrong, body, "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 401);
  httplib::Headers right = {{"Authorization", "Bearer sekret"}};
  auto ok = c.Post("/v1/completions", right, body, "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  auto health = c.Get("/health");  // outside /v1: open
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

}  // namespace
}  // namespace md

namespace md {
namespace {

// The handler's way to its connection, with /proc and without it (descriptors tried one by one):
// a loopback connection's accepted end is found by its four addresses, both ways.
TEST(ServerConnection, TheSocketIsFoundWithAndWithoutProc) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  socklen_t len = sizeof a;
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(connect(client, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  sockaddr_in peer{};
  len = sizeof peer;
  const int accepted = accept(listener, reinterpret_cast<sockaddr*>(&peer), &len);
  ASSERT_GE(accepted, 0);
  const int server_port = ntohs(a.sin_port), client_port = ntohs(peer.sin_port);
  for (bool use_proc : {true, false}) {
    SCOPED_TRACE(use_proc);
    // The server's end: local = the listening address, peer = the client's.
    EXPECT_EQ(
        server::connection_socket("127.0.0.1", server_port, "127.0.0.1", client_port, use_proc),
        accepted);
    EXPECT_EQ(
        server::connection_socket("127.0.0.1", client_port, "127.0.0.1", server_port, use_proc),
        client);
    EXPECT_EQ(
        server::connection_socket("127.0.0.1", server_port, "127.0.0.1", client_port + 1, use_proc),
        -1);
  }
  close(accepted);
  close(client);
  close(listener);
}

}  // namespace
}  // namespace md
