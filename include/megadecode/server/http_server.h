// The HTTP front end (cpp-httplib): OpenAI-compatible routes over an EngineLoop. Handlers parse
// and validate on the HTTP threads, submit to the engine and relay its events (whole, or as
// server-sent events); they never touch the model. See docs/server.md.
#pragma once
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "megadecode/server/engine_loop.h"
#include "megadecode/server/metrics.h"
#include "megadecode/text/generator.h"

namespace md::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                       // 0: any free port (bind() says which)
  std::string api_key;                   // non-empty: /v1 routes need "Authorization: Bearer KEY"
  std::vector<std::string> model_names;  // the served names; the first is reported
  size_t max_body_bytes = 16u << 20;     // larger bodies get 413
  int http_threads = 64;                 // connections served at once
  int max_json_depth = 64;
  std::FILE* access_log = stderr;  // one line per request; nullptr: none
  // A streamed response's chunks are written by the engine thread (src/server/sse_stream.h);
  // false: by the response's HTTP thread from the request's event queue (tests cover both).
  bool engine_writes_streams = true;
  // Finished /v1/responses kept for previous_response_id and GET /v1/responses/{id}, the least
  // recently used dropped beyond this many (0: none kept).
  size_t responses_store = 256;
};

class HttpServer {
 public:
  HttpServer(const Generator& generator, EngineLoop& engine, Metrics& metrics,
             ServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;
  // Binds the listening socket; returns the port. md::Error when the address cannot be bound.
  int bind();
  // Serves until stop() (blocks the calling thread).
  void run();
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The descriptor of this process's connected TCP socket with these numeric addresses (how a
// handler finds its connection to watch for a client that leaves): listed from /proc/self/fd, or
// without /proc (or with use_proc false) tried one by one up to the descriptor limit; -1: none.
int connection_socket(const std::string& local_addr, int local_port, const std::string& remote_addr,
                      int remote_port, bool use_proc = true);

// The OpenAPI 3 description of the routes and fields (GET /openapi.json).
std::string openapi_json(const std::string& model_name);

}  // namespace md::server
