#include "megadecode/server/http_server.h"

#include <dirent.h>
#include <fmt/format.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <ctime>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/server/anthropic_api.h"
#include "megadecode/server/request.h"
#include "megadecode/server/responses.h"
#include "megadecode/server/responses_api.h"
#include "megadecode/server/tool_calls.h"
#include "sse_stream.h"

namespace md::server {

using nlohmann::json;

namespace {

// What the access log reports of the request this HTTP thread is serving. httplib runs a
// request's handler, its streamed content and the logger on one thread, so a thread-local
// carries them from one to the next.
struct RequestLog {
  double start = 0;
  int64_t prompt_tokens = -1, completion_tokens = -1;
  double first_token = 0;  // steady seconds of the first generated text (0: none)
};
thread_local RequestLog t_log;

// The Anthropic Messages routes answer errors in Anthropic's shape, the others in OpenAI's.
bool anthropic_route(const std::string& path) {
  return path.rfind("/v1/messages", 0) == 0;
}

void send_error(httplib::Response& res, const ApiError& e, bool anthropic = false) {
  res.status = e.status;
  res.set_content(dump(anthropic ? anthropic_error(e) : e.to_json()), "application/json");
}

std::string random_id(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  const uint64_t x = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                     (counter.fetch_add(1) * 0x9E3779B97F4A7C15ull);
  return fmt::format("{}-{:016x}", prefix, x);
}

// ---- a client that left -------------------------------------------------------------------------
//
// httplib 0.11 tells a handler nothing about its connection: a write to a closed one fails (how
// streams notice), but a non-streamed handler writes only at its end, and DataSink::is_writable
// is a poll for POLLOUT, which a socket whose peer has closed (sent its FIN) still reports. So the
// handler finds its connection's socket itself: the descriptor whose local and peer addresses are
// the request's (a TCP connection's four addresses are unique, and the socket stays open while
// its worker thread runs the handler); peer_closed (sse_stream.h) then polls it. A streamed
// response also writes its tokens to that socket from the engine thread (sse_stream.h says why).

std::string numeric_address(const sockaddr_storage& a, socklen_t len, int& port) {
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, host, sizeof host, serv, sizeof serv,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "";
  port = std::atoi(serv);
  return host;
}

// The socket of the connection `req` came on; -1 when it cannot be found (nothing is noticed).
int request_socket(const httplib::Request& req) {
  return server::connection_socket(req.local_addr, req.local_port, req.remote_addr,
                                   req.remote_port);
}

}  // namespace

// httplib listens with a backlog of 5 (compiled into the library): a burst of clients beyond
// that has its handshakes dropped and retried, and a connection whose request then arrives late
// is closed unanswered. Listening again on the bound socket raises the backlog.
class Listener : public httplib::Server {
 public:
  void widen_backlog(int backlog) { ::listen(svr_sock_, backlog); }
};

struct HttpServer::Impl {
  const Generator& gen;
  EngineLoop& engine;
  Metrics& metrics;
  ServerOptions opt;
  ParseContext ctx;
  Listener http;
  int64_t created = int64_t(std::time(nullptr));
  std::shared_ptr<ResponseStore> store;

  Impl(const Generator& g, EngineLoop& e, Metrics& m, ServerOptions o)
      : gen(g),
        engine(e),
        metrics(m),
        opt(std::move(o)),
        store(std::make_shared<ResponseStore>(opt.responses_store)) {
    MD_CHECK(!opt.model_names.empty(), "serve: no served model name");
    ctx.generator = &gen;
    ctx.model_names = opt.model_names;
    ctx.vocab_size = gen.tokenizer().vocab_size();
    ctx.max_model_len = engine.options().max_model_len;
    ctx.max_json_depth = opt.max_json_depth;
    routes();
  }

  const Tokenizer& tok() const { return gen.tokenizer(); }

  // Runs a handler body, turning every failure into an error response (OpenAI's shape, or
  // Anthropic's).
  template <class F>
  void guarded(httplib::Response& res, F&& f, bool anthropic = false) {
    try {
      f();
    } catch (const ApiError& e) {
      send_error(res, e, anthropic);
    } catch (const Error& e) {
      send_error(res, ApiError(400, e.what()), anthropic);
    } catch (const std::bad_alloc&) {
      send_error(res, ApiError(500, "out of memory"), anthropic);
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, fmt::format("internal error: {}", e.what())), anthropic);
    }
  }

  void routes() {
    const int threads = std::max(opt.http_threads, 4);
    http.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
    http.set_payload_max_length(opt.max_body_bytes);
    http.set_tcp_nodelay(true);  // a streamed token is sent now, not after a delayed ACK
    // How long a connection's worker waits for a (first or next) request; also how long an idle
    // keep-alive connection can delay shutdown.
    http.set_keep_alive_timeout(5);
    http.set_read_timeout(30);
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      t_log = RequestLog{now_seconds()};
      // The key as OpenAI clients send it (Authorization: Bearer) or as Anthropic's do
      // (x-api-key).
      if (!opt.api_key.empty() && req.path.rfind("/v1", 0) == 0 &&
          req.get_header_value("Authorization") != "Bearer " + opt.api_key &&
          req.get_header_value("x-api-key") != opt.api_key) {
        send_error(
            res,
            ApiError(401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key)",
                     "", "invalid_api_key"),
            anthropic_route(req.path));
        // httplib calls this before it reads the body, which stays unread on the connection:
        // close it rather than read that body as the next request.
        res.set_header("Connection", "close");
        return httplib::Server::HandlerResponse::Handled;
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    // Statuses httplib sets itself (unknown route, body too large, bad request line) get an
    // OpenAI error body too.
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      const bool a = anthropic_route(req.path);
      if (res.status == 404)
        send_error(
            res,
            ApiError(404, fmt::format("no route {} {}", req.method, req.path), "", "not_found"), a);
      else if (res.status == 413)
        send_error(
            res,
            ApiError(413, "the request body is larger than the limit", "", "request_too_large"), a);
      else
        send_error(res, ApiError(res.status, fmt::format("HTTP error {}", res.status)), a);
    });
    http.set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
          send_error(res, ApiError(500, "internal error"));
        });
    http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      metrics.count_response(res.status);
      if (!opt.access_log) return;
      const double t = now_seconds();
      const RequestLog& l = t_log;
      std::string tokens;
      if (l.prompt_tokens >= 0)
        tokens = fmt::format(" prompt_tokens={} completion_tokens={}", l.prompt_tokens,
                             std::max<int64_t>(l.completion_tokens, 0));
      if (l.first_token > 0)
        tokens += fmt::format(" ttft_ms={:.1f}", (l.first_token - l.start) * 1e3);
      std::fprintf(opt.access_log, "%s %s %d%s total_ms=%.1f\n", req.method.c_str(),
                   req.path.c_str(), res.status, tokens.c_str(),
                   l.start > 0 ? (t - l.start) * 1e3 : 0.0);
      std::fflush(opt.access_log);
    });

    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      const std::string f = engine.failure();
      if (f.empty())
        res.set_content(R"({"status":"ok"})", "application/json");
      else
        send_error(res, ApiError(503, "the engine failed: " + f, "", "engine_failed"));
    });
    http.Get("/version", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"version":"0.1.0"})", "application/json");
    });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      json data = json::array();
      for (const std::string& n : opt.model_names)
        data.push_back({{"id", n},
                        {"object", "model"},
                        {"created", created},
                        {"owned_by", "megadecode"},
                        {"max_model_len", ctx.max_model_len}});
      res.set_content(dump({{"object", "list"}, {"data", data}}), "application/json");
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics.render(engine.counters()), "text/plain; version=0.0.4");
    });
    http.Get("/openapi.json", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(openapi_json(opt.model_names.front()), "application/json");
    });
    http.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] {
        TokenizeRequest t = parse_tokenize_request(req.body, ctx);
        res.set_content(dump({{"tokens", t.tokens},
                              {"count", t.tokens.size()},
                              {"max_model_len", ctx.max_model_len}}),
                        "application/json");
      });
    });
    http.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] {
        const std::vector<int32_t> ids = parse_detokenize_request(req.body, ctx);
        res.set_content(dump({{"prompt", sanitize_utf8(tok().decode(ids, false))}}),
                        "application/json");
      });
    });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { generate(req, parse_completion_request(req.body, ctx), res); });
    });
    http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { generate(req, parse_chat_request(req.body, ctx), res); });
    });
    http.Post("/v1/responses", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { respond(req, parse_responses_request(req.body, ctx, store.get()), res); });
    });
    http.Post("/v1/messages", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(
          res, [&] { messages(req, parse_messages_request(req.body, ctx), res); }, true);
    });
    http.Post("/v1/messages/count_tokens",
              [this](const httplib::Request& req, httplib::Response& res) {
                guarded(
                    res,
                    [&] {
                      res.set_content(dump({{"input_tokens", count_message_tokens(req.body, ctx)}}),
                                      "application/json");
                    },
                    true);
              });
    http.Get(R"(/v1/responses/([^/]+))",
             [this](const httplib::Request& req, httplib::Response& res) {
               guarded(res, [&] {
                 res.set_content(dump(stored(req.matches[1])->response), "application/json");
               });
             });
    http.Get(R"(/v1/responses/([^/]+)/input_items)",
             [this](const httplib::Request& req, httplib::Response& res) {
               guarded(res, [&] {
                 const json page = input_items_page(
                     stored(req.matches[1])->input_items, req.get_param_value("order"),
                     req.get_param_value("limit"), req.get_param_value("after"));
                 res.set_content(dump(page), "application/json");
               });
             });
    http.Delete(R"(/v1/responses/([^/]+))",
                [this](const httplib::Request& req, httplib::Response& res) {
                  guarded(res, [&] {
                    const std::string id = req.matches[1];
                    if (!store->erase(id))
                      throw ApiError(404, fmt::format("no stored response '{}'", id), "response_id",
                                     "response_not_found");
                    res.set_content(dump({{"id", id}, {"object", "response"}, {"deleted", true}}),
                                    "application/json");
                  });
                });
  }

  // Submits a request's choices (prompts x n) to the engine; the access log gets its prompt size.
  std::shared_ptr<RequestStream> submit(const CompletionRequest& r) {
    EngineRequest er;
    for (const auto& p : r.prompts)
      for (int j = 0; j < r.n; ++j) {
        ChoiceSpec c{p, r.sampling, r.constraint, r.logit_bias};
        c.sampling.seed = r.sampling.seed + uint64_t(j);  // n choices of one seed differ
        er.choices.push_back(std::move(c));
      }
    er.top_logprobs = r.logprobs ? r.top_logprobs : -1;
    er.prompt_logprobs = r.echo && r.logprobs;
    int64_t prompt_tokens = 0;
    for (const auto& p : r.prompts) prompt_tokens += int64_t(p.size());
    t_log.prompt_tokens = prompt_tokens;
    return engine.submit(std::move(er));
  }

  // A non-streamed request: hands its events to `on_event` until it finishes, looking at the
  // connection meanwhile: a client that left has its request cancelled, so its slots are free at
  // the next step (and the answer is nginx's 499, for the access log and the metrics).
  template <class F>
  void collect(RequestStream& stream, int socket, F&& on_event) {
    ChoiceEvent e;
    double checked = now_seconds();
    bool client_left = false;
    while (!stream.finished()) {
      if (stream.next(e, kPeerCheckSeconds)) {
        if (t_log.first_token == 0 && !e.tokens.empty()) t_log.first_token = now_seconds();
        on_event(std::move(e));
      }
      if (!client_left && now_seconds() - checked >= kPeerCheckSeconds) {
        checked = now_seconds();
        client_left = peer_closed(socket);
        if (client_left) stream.cancel();
      }
    }
    if (client_left)
      throw ApiError(499, "the client closed the connection", "", "client_closed_request");
  }

  void stream_response(httplib::Response& res, std::shared_ptr<SseStream> sse) {
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [sse](size_t, httplib::DataSink& sink) {
          const bool ok = sse->provide(sink);
          const StreamTotals t = sse->totals();  // for the access log (this thread's)
          t_log.first_token = t.first_token;
          t_log.completion_tokens = t.completion_tokens;
          return ok;
        },
        [sse](bool) { sse->close(); });
  }

  void generate(const httplib::Request& http_req, CompletionRequest r, httplib::Response& res) {
    const std::shared_ptr<RequestStream> stream = submit(r);
    ResponseMeta meta{random_id(r.kind == RequestKind::kChat ? "chatcmpl" : "cmpl"),
                      int64_t(std::time(nullptr)),
                      r.model.empty() ? opt.model_names.front() : r.model};
    const size_t choices = r.prompts.size() * size_t(r.n);
    const int socket = request_socket(http_req);
    if (!r.stream) {
      std::vector<ChoiceResult> rs(choices);
      collect(*stream, socket, [&](ChoiceEvent&& e) { rs[size_t(e.choice)].add(std::move(e)); });
      int64_t completion = 0;
      for (const ChoiceResult& c : rs) {
        if (!c.error.empty()) throw ApiError(500, c.error, "", "engine_error");
        completion += c.completion_tokens;
      }
      t_log.completion_tokens = completion;
      const json body = r.kind == RequestKind::kChat ? chat_body(r, rs, meta, tok())
                                                     : completion_body(r, rs, meta, tok());
      res.set_content(dump(body), "application/json");
      return;
    }
    stream_response(res,
                    std::make_shared<SseStream>(stream,
                                                std::make_unique<ChatStreamRenderer>(
                                                    std::move(r), std::move(meta), tok(), choices),
                                                socket, opt.engine_writes_streams));
  }

  // POST /v1/responses: one chat choice, its output as the Responses API's items.
  void respond(const httplib::Request& http_req, ResponsesRequest r, httplib::Response& res) {
    const std::shared_ptr<RequestStream> stream = submit(r.chat);
    ResponseMeta meta{response_id("resp"), int64_t(std::time(nullptr)),
                      r.chat.model.empty() ? opt.model_names.front() : r.chat.model};
    const int socket = request_socket(http_req);
    const bool streamed = r.chat.stream;
    auto req = std::make_shared<const ResponsesRequest>(std::move(r));
    if (!streamed) {
      ResponseBuilder b(req, meta, tok(), /*events=*/false);
      collect(*stream, socket, [&](ChoiceEvent&& e) { b.add(e); });
      b.finish();
      if (!b.segments().error().empty())
        throw ApiError(500, b.segments().error(), "", "engine_error");
      t_log.completion_tokens = b.segments().completion_tokens();
      if (req->store) store->put(meta.id, b.stored());
      res.set_content(dump(b.response()), "application/json");
      return;
    }
    stream_response(
        res, std::make_shared<SseStream>(stream, responses_stream_renderer(req, meta, tok(), store),
                                         socket, opt.engine_writes_streams));
  }

  // POST /v1/messages: one chat choice, its output as Anthropic content blocks.
  void messages(const httplib::Request& http_req, MessagesRequest r, httplib::Response& res) {
    const std::shared_ptr<RequestStream> stream = submit(r.chat);
    ResponseMeta meta{response_id("msg"), int64_t(std::time(nullptr)),
                      r.chat.model.empty() ? opt.model_names.front() : r.chat.model};
    const int socket = request_socket(http_req);
    const bool streamed = r.chat.stream;
    auto req = std::make_shared<const MessagesRequest>(std::move(r));
    if (!streamed) {
      MessageBuilder b(req, meta, /*events=*/false);
      collect(*stream, socket, [&](ChoiceEvent&& e) { b.add(e); });
      b.finish();
      if (!b.segments().error().empty())
        throw ApiError(500, b.segments().error(), "", "engine_error");
      t_log.completion_tokens = b.segments().completion_tokens();
      res.set_content(dump(b.message()), "application/json");
      return;
    }
    stream_response(res, std::make_shared<SseStream>(stream, messages_stream_renderer(req, meta),
                                                     socket, opt.engine_writes_streams));
  }

  std::shared_ptr<const StoredResponse> stored(const std::string& id) {
    std::shared_ptr<const StoredResponse> s = store->get(id);
    if (!s)
      throw ApiError(404, fmt::format("no stored response '{}'", id), "response_id",
                     "response_not_found");
    return s;
  }
};

// (httplib formats a request's addresses with getnameinfo's NI_NUMERICHOST too, as
// numeric_address does.) Without /proc the descriptors are tried up to the limit, capped at 65536.
int connection_socket(const std::string& local_addr, int local_port, const std::string& remote_addr,
                      int remote_port, bool use_proc) {
  auto matches = [&](int fd) {
    sockaddr_storage peer{}, local{};
    socklen_t pl = sizeof peer, ll = sizeof local;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0)
      return false;  // not a connected socket
    int pport = -1, lport = -1;
    return numeric_address(peer, pl, pport) == remote_addr && pport == remote_port &&
           numeric_address(local, ll, lport) == local_addr && lport == local_port;
  };
  DIR* d = use_proc ? opendir("/proc/self/fd") : nullptr;
  if (!d) {
    rlimit lim{};
    const rlim_t n =
        getrlimit(RLIMIT_NOFILE, &lim) == 0 ? std::min<rlim_t>(lim.rlim_cur, 65536) : 1024;
    for (int fd = 0; fd < int(n); ++fd)
      if (matches(fd)) return fd;
    return -1;
  }
  int found = -1;
  while (const dirent* e = readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(d)) continue;
    if (matches(int(fd))) {
      found = int(fd);
      break;
    }
  }
  closedir(d);
  return found;
}

HttpServer::HttpServer(const Generator& generator, EngineLoop& engine, Metrics& metrics,
                       ServerOptions options)
    : impl_(std::make_unique<Impl>(generator, engine, metrics, std::move(options))) {}

HttpServer::~HttpServer() {
  stop();
}

int HttpServer::bind() {
  Impl& m = *impl_;
  if (m.opt.port == 0) {
    const int port = m.http.bind_to_any_port(m.opt.host);
    MD_CHECK(port > 0, "serve: cannot listen on {} (any port)", m.opt.host);
    m.http.widen_backlog(1024);
    return port;
  }
  MD_CHECK(m.http.bind_to_port(m.opt.host, m.opt.port), "serve: cannot listen on {}:{}", m.opt.host,
           m.opt.port);
  m.http.widen_backlog(1024);
  return m.opt.port;
}

void HttpServer::run() {
  impl_->http.listen_after_bind();
}

void HttpServer::stop() {
  impl_->http.stop();
}

}  // namespace md::server
