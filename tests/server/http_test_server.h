// A server on a free loopback port over the tiny model, for the HTTP tests.
#pragma once
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "megadecode/server/http_server.h"
#include "server/server_test_util.h"

namespace md::test {

using nlohmann::json;

// A server on 127.0.0.1:<free port> over the tiny model, serving from a thread of its own.
struct TestServer {
  test::ServedModel m;
  server::Metrics metrics;
  std::unique_ptr<server::EngineLoop> engine;
  std::unique_ptr<server::HttpServer> http;
  std::thread thread;
  int port = 0;
  // `forced_output`: text every choice generates first (EngineOptions::test_forced_tokens).
  // `engine_writes`: ServerOptions::engine_writes_streams.
  explicit TestServer(int max_batch = 8, std::string api_key = "", size_t max_body = 1 << 20,
                      const std::string& forced_output = "", bool engine_writes = true)
      : m(max_batch) {
    signal(SIGPIPE, SIG_IGN);
    server::EngineOptions eo;
    eo.max_batch = max_batch;
    eo.max_queue = 32;
    eo.max_model_len = 4096;
    eo.prefill_chunk = 8;
    // The pool's 8 slots beside the running ones (every test here runs with the cache on).
    eo.prefix_cache = 16 - max_batch;
    eo.prefix_cache_min_tokens = 8;
    if (!forced_output.empty()) eo.test_forced_tokens = m.tok->encode(forced_output, true);
    engine = std::make_unique<server::EngineLoop>(*m.ex, *m.tok, eo, metrics.observer());
    server::ServerOptions so;
    so.port = 0;
    so.api_key = std::move(api_key);
    so.model_names = {"tiny"};
    so.max_body_bytes = max_body;
    so.http_threads = 32;
    so.access_log = nullptr;
    so.engine_writes_streams = engine_writes;
    http = std::make_unique<server::HttpServer>(*m.gen, *engine, metrics, so);
    port = http->bind();
    thread = std::thread([this] { http->run(); });
  }
  ~TestServer() {
    engine->shutdown(0);
    http->stop();
    thread.join();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60);
    return c;
  }
};

inline json post_json(const TestServer& s, const std::string& path, const json& body,
                      int want = 200) {
  auto c = s.client();
  auto r = c.Post(path.c_str(), body.dump(), "application/json");
  EXPECT_TRUE(r) << path;
  if (!r) return {};
  EXPECT_EQ(r->status, want) << r->body;
  return json::parse(r->body);
}

// The data payloads of an SSE body, in order ("[DONE]" included).
inline std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    const size_t end = body.find("\n\n", pos);
    out.push_back(body.substr(pos + 6, end - pos - 6));
    pos = end;
  }
  return out;
}

}  // namespace md::test
