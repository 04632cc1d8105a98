#include "megadecode/server/http_server.h"

#include <fmt/format.h>
#include <dirent.h>
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
#include "megadecode/server/request.h"
#include "megadecode/server/responses.h"
#include "megadecode/server/tool_calls.h"

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

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump(e.to_json()), "application/json");
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
// its worker thread runs the handler). A client that closes its end makes the socket readable at
// end of file; poll's POLLRDHUP (Linux) says so at once (a recv peek of 0 bytes where it is not
// reported), and POLLHUP / POLLERR say the connection was reset. A client that half-closes after
// its request counts as gone too, as uvicorn (vLLM's server) treats it.

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

bool peer_closed(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, short(POLLIN | POLLRDHUP), 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  if (p.revents & POLLIN) {  // data (a pipelined request) or end of file
    char c;
    const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }
  return false;
}

// How often a waiting handler looks at its connection.
constexpr double kPeerCheckSeconds = 0.05;

// Per streamed response: the engine's events turned into SSE chunks.
struct StreamState {
  std::shared_ptr<RequestStream> stream;
  CompletionRequest req;
  ResponseMeta meta;
  bool started = false, finished = false;
  std::vector<size_t> text_offset;     // completions logprobs: text sent so far per choice
  std::vector<ToolCallStream> tools;   // chat with tools: each choice's tool-call parser
  std::vector<bool> echoed;            // completions echo: the prompt text has been sent
  int64_t prompt_tokens = 0, completion_tokens = 0;
  double last_write = now_seconds();
  int socket = -1;  // the connection (connection_socket), to notice a client that left
};

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

  Impl(const Generator& g, EngineLoop& e, Metrics& m, ServerOptions o)
      : gen(g), engine(e), metrics(m), opt(std::move(o)) {
    MD_CHECK(!opt.model_names.empty(), "serve: no served model name");
    ctx.generator = &gen;
    ctx.model_names = opt.model_names;
    ctx.vocab_size = gen.tokenizer().vocab_size();
    ctx.max_model_len = engine.options().max_model_len;
    ctx.max_json_depth = opt.max_json_depth;
    routes();
  }

  const Tokenizer& tok() const { return gen.tokenizer(); }

  // Runs a handler body, turning every failure into an OpenAI error response.
  template <class F>
  void guarded(httplib::Response& res, F&& f) {
    try {
      f();
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const Error& e) {
      send_error(res, ApiError(400, e.what()));
    } catch (const std::bad_alloc&) {
      send_error(res, ApiError(500, "out of memory"));
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, fmt::format("internal error: {}", e.what())));
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
      if (!opt.api_key.empty() && req.path.rfind("/v1", 0) == 0 &&
          req.get_header_value("Authorization") != "Bearer " + opt.api_key) {
        send_error(res, ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", "",
                                 "invalid_api_key"));
        return httplib::Server::HandlerResponse::Handled;
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    // Statuses httplib sets itself (unknown route, body too large, bad request line) get an
    // OpenAI error body too.
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      if (res.status == 404)
        send_error(res, ApiError(404, fmt::format("no route {} {}", req.method, req.path), "",
                                 "not_found"));
      else if (res.status == 413)
        send_error(res, ApiError(413, "the request body is larger than the limit", "",
                                 "request_too_large"));
      else
        send_error(res, ApiError(res.status, fmt::format("HTTP error {}", res.status)));
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
  }

  void generate(const httplib::Request& http_req, CompletionRequest r, httplib::Response& res) {
    EngineRequest er;
    for (const auto& p : r.prompts)
      for (int j = 0; j < r.n; ++j) {
        ChoiceSpec c{p, r.sampling, r.constraint};
        c.sampling.seed = r.sampling.seed + uint64_t(j);  // n choices of one seed differ
        er.choices.push_back(std::move(c));
      }
    er.top_logprobs = r.logprobs ? r.top_logprobs : -1;
    er.prompt_logprobs = r.echo && r.logprobs;
    int64_t prompt_tokens = 0;
    for (const auto& p : r.prompts) prompt_tokens += int64_t(p.size());
    t_log.prompt_tokens = prompt_tokens;
    auto st = std::make_shared<StreamState>();
    st->stream = engine.submit(std::move(er));
    st->meta = {random_id(r.kind == RequestKind::kChat ? "chatcmpl" : "cmpl"),
                int64_t(std::time(nullptr)), r.model.empty() ? opt.model_names.front() : r.model};
    const size_t choices = r.prompts.size() * size_t(r.n);
    st->req = std::move(r);
    st->socket = request_socket(http_req);
    if (!st->req.stream) {
      // Waits for the whole result, looking at the connection meanwhile: a client that left has
      // its request cancelled, so its slots are free at the next step.
      std::vector<ChoiceResult> rs(choices);
      ChoiceEvent e;
      double checked = now_seconds();
      bool client_left = false;
      while (!st->stream->finished()) {
        if (st->stream->next(e, kPeerCheckSeconds)) {
          if (t_log.first_token == 0 && !e.tokens.empty()) t_log.first_token = now_seconds();
          rs[size_t(e.choice)].add(std::move(e));
        }
        if (!client_left && now_seconds() - checked >= kPeerCheckSeconds) {
          checked = now_seconds();
          client_left = peer_closed(st->socket);
          if (client_left) st->stream->cancel();
        }
      }
      if (client_left)  // nobody reads it; nginx's 499 in the access log and the metrics
        throw ApiError(499, "the client closed the connection", "", "client_closed_request");
      int64_t completion = 0;
      for (const ChoiceResult& c : rs) {
        if (!c.error.empty()) throw ApiError(500, c.error, "", "engine_error");
        completion += c.completion_tokens;
      }
      t_log.completion_tokens = completion;
      const json body = st->req.kind == RequestKind::kChat
                            ? chat_body(st->req, rs, st->meta, tok())
                            : completion_body(st->req, rs, st->meta, tok());
      res.set_content(dump(body), "application/json");
      return;
    }
    st->text_offset.assign(choices, 0);
    if (st->req.tools_given)
      for (size_t i = 0; i < choices; ++i)
        st->tools.emplace_back(st->req.chat_template, tool_call_id_prefix(st->meta, i));
    st->echoed.assign(choices, false);
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, st](size_t, httplib::DataSink& sink) { return stream_step(*st, sink); },
        [st](bool success) {
          if (!success) st->stream->cancel();  // the client left: free its slots
        });
  }

  // One call of the content provider: waits a little for the next event and writes its chunk.
  // false ends the response (the client is gone).
  bool stream_step(StreamState& st, httplib::DataSink& sink) {
    const CompletionRequest& r = st.req;
    const bool chat = r.kind == RequestKind::kChat;
    bool ok = true;
    auto send = [&](json j) {
      if (r.include_usage && !j.contains("usage")) j["usage"] = nullptr;
      const std::string s = "data: " + dump(j) + "\n\n";
      ok = ok && sink.write(s.data(), s.size());
    };
    if (!st.started) {
      st.started = true;
      for (size_t i = 0; i < st.text_offset.size(); ++i) {
        if (chat) {
          send(chat_chunk(st.meta, int(i), {{"role", "assistant"}, {"content", ""}}, nullptr,
                          std::nullopt));
        }
      }
    }
    ChoiceEvent e;
    const bool got = ok && st.stream->next(e, kPeerCheckSeconds);
    // Nothing came: a client that left is noticed now rather than at the next write.
    if (ok && !got && peer_closed(st.socket)) ok = false;
    if (ok && !got && now_seconds() - st.last_write > 1.0) {
      // Nothing to send for a while (queued, or a long prompt prefilling): an SSE comment, which
      // clients ignore, finds out whether the client is still there.
      static const std::string kKeepAlive = ": keep-alive\n\n";
      ok = sink.write(kKeepAlive.data(), kKeepAlive.size());
      st.last_write = now_seconds();
    }
    if (got) {
      st.last_write = now_seconds();
      const size_t i = size_t(e.choice);
      if (!e.tokens.empty() && t_log.first_token == 0) t_log.first_token = now_seconds();
      if (!e.error.empty()) {
        ApiError err(500, e.error, "", "engine_error");
        const std::string s = "data: " + dump(err.to_json()) + "\n\n";
        ok = sink.write(s.data(), s.size());
      } else if (chat) {
        json delta = json::object();
        std::string text = std::move(e.text);
        if (!e.reasoning.empty()) delta["reasoning_content"] = e.reasoning;
        std::string finish = e.finish_reason.value_or("");
        if (r.tools_given) {
          // Content goes out as it comes unless it may begin a tool-call section; a call goes
          // out as its header completes (index, id, name), then its arguments in pieces.
          ToolCallStream& tc = st.tools[i];
          ToolCallDelta d = tc.feed(text);
          if (e.finish_reason) {
            ToolCallDelta rest = tc.finish();
            d.content += rest.content;
            for (auto& p : rest.pieces) {
              if (!p.first && !d.pieces.empty() && d.pieces.back().index == p.index)
                d.pieces.back().arguments += p.arguments;
              else
                d.pieces.push_back(std::move(p));
            }
            finish = tool_calls_finish_reason(finish, tc.calls());
          }
          text = std::move(d.content);
          if (!d.pieces.empty()) {
            json calls = json::array();
            for (const ToolCallPiece& p : d.pieces) calls.push_back(tool_call_piece_json(p));
            delta["tool_calls"] = std::move(calls);
          }
        }
        if (!text.empty()) delta["content"] = text;
        json lp =
            r.logprobs && !e.logprobs.empty() ? chat_logprobs(e.logprobs, tok()) : json(nullptr);
        if (!delta.empty() || !lp.is_null() || e.finish_reason)
          send(chat_chunk(st.meta, int(i), delta, lp,
                          e.finish_reason ? std::optional<std::string>(finish) : std::nullopt));
      } else {
        json lp = nullptr;
        std::string text = std::move(e.text);
        if (r.echo && !st.echoed[i]) {
          // The prompt goes out with the choice's first event, which carries its logprobs.
          st.echoed[i] = true;
          const std::vector<int32_t>& prompt = r.prompts[i / size_t(r.n)];
          if (r.logprobs) lp = echo_logprobs(prompt, e.prompt_logprobs, e.logprobs, tok());
          text = sanitize_utf8(tok().decode(prompt, false)) + text;
        } else if (r.logprobs && !e.logprobs.empty()) {
          lp = completion_logprobs(e.logprobs, tok(), st.text_offset[i]);
        }
        if (lp.is_object() && !lp["tokens"].empty())  // the next offsets go on from the last token
          st.text_offset[i] = lp["text_offset"].back().get<size_t>() +
                              lp["tokens"].back().get<std::string>().size();
        if (!text.empty() || !lp.is_null() || e.finish_reason)
          send(completion_chunk(st.meta, int(i), text, lp, e.finish_reason));
      }
      if (e.finish_reason || !e.error.empty()) {
        // A prompt counts once however many choices it has.
        if (chat ? i == 0 : i % size_t(r.n) == 0) st.prompt_tokens += e.prompt_tokens;
        st.completion_tokens += e.completion_tokens;
        t_log.completion_tokens = st.completion_tokens;
      }
    }
    if (ok && st.stream->finished()) {
      if (r.include_usage) {
        json u = {{"id", st.meta.id},
                  {"object", chat ? "chat.completion.chunk" : "text_completion"},
                  {"created", st.meta.created},
                  {"model", st.meta.model},
                  {"choices", json::array()},
                  {"usage", usage_json(st.prompt_tokens, st.completion_tokens)}};
        send(u);
      }
      static const std::string kDone = "data: [DONE]\n\n";
      ok = ok && sink.write(kDone.data(), kDone.size());
      if (ok) sink.done();
      st.finished = true;
    }
    if (!ok) st.stream->cancel();
    return ok;
  }
};

// (httplib formats a request's addresses with getnameinfo's NI_NUMERICHOST too, as
// numeric_address does.) Without /proc the descriptors are tried up to the limit, capped at 65536.
int connection_socket(const std::string& local_addr, int local_port,
                      const std::string& remote_addr, int remote_port, bool use_proc) {
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
    const rlim_t n = getrlimit(RLIMIT_NOFILE, &lim) == 0 ? std::min<rlim_t>(lim.rlim_cur, 65536)
                                                         : 1024;
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
