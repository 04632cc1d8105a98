// `megadecode serve-bench`: the streaming load client of bench/serve_bench.py (same requests, same
// measures, same output lines), in C++. On a host with few cores the client shares the CPUs with
// the server's workers and every cycle it spends is taken from them; one thread drives every
// connection through poll(2) and parses HTTP/1.1 chunked server-sent events by hand, parsing JSON
// only for the usage chunk and errors, so it costs a fraction of the Python client's CPU.
//
//   bench mode: per concurrency level, N streamed /v1/completions of --input-len random token ids
//     and exactly --output-len tokens (ignore_eos); prints request throughput, output tokens/s,
//     time to first token and inter-token latency p50/p99 (ms), and the client's own CPU time.
//   prefill-probe mode (--prefill-probe LEN): --concurrency streams decode; once each has
//     streamed for --probe-after seconds, a LEN-token prompt (max_tokens 1) arrives; prints the
//     streams' inter-token gaps before it and while it is prefilled, and its time to first token.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "common.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"

namespace md::cli {

namespace {

struct LoadOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  int input_len = 128, output_len = 64, num_requests = 32, vocab = 1000, warmup = 1;
  int prefix_len = 0;  // ids every prompt starts with (a shared system prompt)
  uint64_t seed = 0;
  std::string concurrency = "1,2,4,8";
  int prefill_probe = 0;
  double probe_after = 1.0;
};

// One streamed completion on its own connection; feed() takes the bytes as they arrive.
struct Stream {
  int fd = -1;
  double t0 = 0;
  std::string raw, sse;  // bytes not parsed yet: headers and chunk framing; de-chunked body
  int status = 0;
  double ttft = -1, last = 0;
  std::vector<double> gaps;
  std::vector<double>* arrivals = nullptr;  // every event's arrival time (probe mode)
  int64_t tokens = 0;
  bool done = false;  // saw data: [DONE]
  std::string error;

  ~Stream() {
    if (fd >= 0) close(fd);
  }
  void arrival(double now) {
    if (arrivals) arrivals->push_back(now);
    if (ttft < 0)
      ttft = now - t0;
    else
      gaps.push_back(now - last);
    last = now;
  }
  void event(std::string_view e, double now) {
    if (e.substr(0, 6) != "data: ") return;  // an SSE comment (keep-alive)
    const std::string_view data = e.substr(6);
    if (data == "[DONE]") {
      done = true;
    } else if (data.substr(0, 16).find("\"error\"") != std::string_view::npos) {
      const nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
      error = j.is_object() && j.contains("error") ? j["error"].value("message", std::string(data))
                                                   : std::string(data);
    } else if (data.find("\"usage\":{") != std::string_view::npos) {
      const nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
      if (j.is_discarded()) {
        error = "a usage chunk that is not JSON";
        return;
      }
      tokens = j["usage"].value("completion_tokens", int64_t(0));
      if (j.contains("choices") && !j["choices"].empty()) arrival(now);
    } else {
      arrival(now);
    }
  }
  void feed(const char* p, size_t n, double now) {
    raw.append(p, n);
    if (status == 0) {
      const size_t end = raw.find("\r\n\r\n");
      if (end == std::string::npos) return;
      const size_t sp = raw.find(' ');
      status = sp < end ? std::atoi(raw.c_str() + sp + 1) : -1;
      if (status != 200) error = fmt::format("HTTP {}", status);
      raw.erase(0, end + 4);
    }
    for (;;) {  // chunked transfer coding: "<hex size>\r\n<data>\r\n"; size 0 ends it
      const size_t eol = raw.find("\r\n");
      if (eol == std::string::npos) break;
      const size_t size = eol ? std::strtoul(raw.c_str(), nullptr, 16) : 0;
      if (raw.size() < eol + 2 + size + 2) break;
      sse.append(raw, eol + 2, size);
      raw.erase(0, eol + 2 + size + 2);
    }
    size_t at = 0;
    for (size_t end; (end = sse.find("\n\n", at)) != std::string::npos; at = end + 2)
      event(std::string_view(sse).substr(at, end - at), now);
    sse.erase(0, at);
  }
};

std::unique_ptr<Stream> open_stream(const LoadOptions& o, const std::string& body) {
  auto s = std::make_unique<Stream>();
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(o.port));
  if (inet_pton(AF_INET, o.host.c_str(), &a.sin_addr) != 1)
    fail("serve-bench: --host {} is not an IPv4 address", o.host);
  s->fd = socket(AF_INET, SOCK_STREAM, 0);
  if (s->fd < 0 || connect(s->fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    fail("serve-bench: cannot connect to {}:{}: {}", o.host, o.port, std::strerror(errno));
  const int one = 1;
  setsockopt(s->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  s->t0 = now_seconds();
  const std::string req = fmt::format(
      "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n"
      "Content-Length: {}\r\nConnection: close\r\n\r\n{}",
      o.host, body.size(), body);
  for (size_t sent = 0; sent < req.size();) {
    const ssize_t n = send(s->fd, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) fail("serve-bench: send: {}", std::strerror(errno));
    sent += size_t(n);
  }
  return s;
}

std::string request_body(const LoadOptions& o, std::mt19937_64& rng, int prompt_len,
                         int max_tokens) {
  nlohmann::json prompt = nlohmann::json::array();
  // The shared prefix: the same ids in every request (their own generator, from the seed).
  std::mt19937_64 shared(o.seed ^ 0x9E3779B97F4A7C15ull);
  for (int i = 0; i < o.prefix_len; ++i)
    prompt.push_back(1 + int(shared() % uint64_t(o.vocab - 1)));
  for (int i = 0; i < prompt_len; ++i) prompt.push_back(1 + int(rng() % uint64_t(o.vocab - 1)));
  return nlohmann::json{{"prompt", prompt},
                        {"max_tokens", max_tokens},
                        {"ignore_eos", true},
                        {"temperature", 0},
                        {"stream", true},
                        {"stream_options", {{"include_usage", true}}}}
      .dump();
}

// Runs `next()` bodies (empty: none now) with at most `concurrency` streams open, asking again
// after every poll; done(stream) after each ends. `open`: streams already started.
template <typename Next, typename Done>
void drive(const LoadOptions& o, int concurrency, Next next, Done done,
           std::vector<std::unique_ptr<Stream>> open = {}) {
  auto start = [&] {
    const std::string body = next();
    if (body.empty()) return false;
    open.push_back(open_stream(o, body));
    return true;
  };
  while (int(open.size()) < concurrency && start()) {
  }
  std::vector<pollfd> fds;
  char buf[65536];
  while (!open.empty()) {
    fds.clear();
    for (const auto& s : open) fds.push_back({s->fd, POLLIN, 0});
    if (poll(fds.data(), fds.size(), 600000) <= 0) fail("serve-bench: no answer for 600 s");
    const double now = now_seconds();
    for (size_t i = fds.size(); i-- > 0;) {
      if (!fds[i].revents) continue;
      Stream& s = *open[i];
      const ssize_t n = recv(s.fd, buf, sizeof buf, 0);
      if (n > 0) {
        s.feed(buf, size_t(n), now);
        continue;
      }
      if (n < 0 && s.error.empty()) s.error = fmt::format("recv: {}", std::strerror(errno));
      std::unique_ptr<Stream> ended = std::move(open[i]);
      open.erase(open.begin() + std::ptrdiff_t(i));
      done(*ended);
    }
    while (int(open.size()) < concurrency && start()) {
    }
  }
}

double pct(std::vector<double> xs, double p) {
  if (xs.empty()) return std::nan("");
  std::sort(xs.begin(), xs.end());
  return xs[std::min(xs.size() - 1, size_t(std::lround(p / 100 * double(xs.size() - 1))))];
}

std::string stream_error(const Stream& s) {
  if (!s.error.empty()) return s.error;
  return s.done ? "" : "stream ended without [DONE]";
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

int bench(const LoadOptions& o, const std::vector<int>& levels) {
  fmt::print("{:>5} {:>8} {:>10} {:>9} {:>9} {:>8} {:>8}  (ms)  client cpu s\n", "conc", "req/s",
             "out tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99");
  int failures = 0;
  for (int conc : levels) {
    std::mt19937_64 rng(o.seed + uint64_t(conc));
    const int n = std::max(o.num_requests, conc);
    if (o.warmup > 0) {  // not counted: a fresh server's first steps touch its pages and buffers
      int left = conc;
      drive(o, conc, [&] { return left-- > 0 ? request_body(o, rng, o.input_len, 4) : ""; },
            [](Stream&) {});
    }
    std::vector<double> ttfts, gaps;
    std::vector<std::string> errors;
    int64_t tokens = 0;
    int left = n;
    const double c0 = cpu_seconds(), t0 = now_seconds();
    drive(
        o, conc,
        [&] { return left-- > 0 ? request_body(o, rng, o.input_len, o.output_len) : ""; },
        [&](Stream& s) {
          if (const std::string e = stream_error(s); !e.empty()) {
            errors.push_back(e);
            return;
          }
          ttfts.push_back(std::max(s.ttft, 0.0));
          gaps.insert(gaps.end(), s.gaps.begin(), s.gaps.end());
          tokens += s.tokens;
        });
    const double wall = now_seconds() - t0, cpu = cpu_seconds() - c0;
    fmt::print("{:>5} {:>8.2f} {:>10.1f} {:>9.1f} {:>9.1f} {:>8.2f} {:>8.2f}  {:.3f}{}\n", conc,
               double(ttfts.size()) / wall, double(tokens) / wall, pct(ttfts, 50) * 1e3,
               pct(ttfts, 99) * 1e3, pct(gaps, 50) * 1e3, pct(gaps, 99) * 1e3, cpu,
               errors.empty() ? "" : fmt::format("  errors: {} ({})", errors.size(), errors[0]));
    std::fflush(stdout);
    failures += int(errors.size());
  }
  return failures ? 1 : 0;
}

int prefill_probe(const LoadOptions& o, int conc) {
  std::mt19937_64 rng(o.seed);
  std::vector<std::vector<double>> arrivals(static_cast<size_t>(conc));
  std::vector<std::unique_ptr<Stream>> open;
  for (int i = 0; i < conc; ++i) {
    open.push_back(open_stream(o, request_body(o, rng, o.input_len, o.output_len)));
    open.back()->arrivals = &arrivals[size_t(i)];
  }
  double t_probe = -1, t_first = -1;
  std::vector<std::string> errors;
  bool probe_sent = false;
  // The probe is the body the driver gets (it asks after every poll, with room for one stream
  // more) once every stream has streamed for --probe-after seconds.
  const std::string probe_body = request_body(o, rng, o.prefill_probe, 1);
  drive(
      o, conc + 1,
      [&]() -> std::string {
        if (probe_sent) return "";
        const double now = now_seconds();
        for (const auto& a : arrivals)
          if (a.empty() || now - a.front() < o.probe_after) return "";
        probe_sent = true;
        t_probe = now_seconds();
        return probe_body;
      },
      [&](Stream& s) {
        if (const std::string e = stream_error(s); !e.empty()) errors.push_back(e);
        if (!s.arrivals) t_first = s.t0 + s.ttft;  // the probe
      },
      std::move(open));
  if (!errors.empty()) fail("serve-bench: {} errors ({})", errors.size(), errors[0]);
  if (!probe_sent)
    fail("serve-bench: the streams ended before the probe was sent: raise --output-len");
  std::vector<double> before, during;
  for (const auto& a : arrivals)
    for (size_t i = 1; i < a.size(); ++i) {
      if (a[i] <= t_probe)
        before.push_back(a[i] - a[i - 1]);
      else if (a[i - 1] < t_first)  // a gap that overlaps the prefill
        during.push_back(a[i] - a[i - 1]);
    }
  if (during.empty()) fail("serve-bench: no stream token overlapped the prefill: raise --output-len");
  auto ms = [](const std::vector<double>& xs, double p) { return pct(xs, p) * 1e3; };
  fmt::print("{} streams; a {}-token prompt arrived, first token after {:.1f} ms\n", conc,
             o.prefill_probe, (t_first - t_probe) * 1e3);
  fmt::print("  inter-token ms before: p50 {:.2f} p99 {:.2f} max {:.2f} ({} gaps)\n",
             ms(before, 50), ms(before, 99), ms(before, 100), before.size());
  fmt::print("  inter-token ms during: p50 {:.2f} p99 {:.2f} max {:.2f} ({} gaps)\n",
             ms(during, 50), ms(during, 99), ms(during, 100), during.size());
  fmt::print("  p99 rise: {:.2f} ms\n", ms(during, 99) - ms(before, 99));
  return 0;
}

}  // namespace

void register_serve_bench(CLI::App& app) {
  auto o = std::make_shared<LoadOptions>();
  auto* c = app.add_subcommand(
      "serve-bench", "streaming load client for a running `megadecode serve` (bench/serve_bench.py "
                     "in C++: a fraction of its CPU)");
  c->add_option("--host", o->host, "the server's IPv4 address");
  c->add_option("--port", o->port, "the server's port")->check(CLI::Range(1, 65535));
  c->add_option("--input-len", o->input_len, "prompt tokens (random ids)")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--output-len", o->output_len, "generated tokens per request (ignore_eos)")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--concurrency", o->concurrency, "streams open at once, per level: e.g. 1,2,4,8");
  c->add_option("--num-requests", o->num_requests, "requests per level (at least the level)")
      ->check(CLI::Range(1, 1 << 24));
  c->add_option("--vocab", o->vocab, "prompt ids are drawn from [1, vocab)")
      ->check(CLI::Range(2, 1 << 30));
  c->add_option("--seed", o->seed, "prompt ids' seed");
  c->add_option("--prefix-len", o->prefix_len,
                "ids every prompt starts with before its --input-len random ones (a shared "
                "system prompt: what the server's prefix cache restores; vLLM's "
                "--random-prefix-len)")
      ->check(CLI::Range(0, 1 << 20));
  c->add_option("--warmup", o->warmup,
                "first run `concurrency` uncounted 4-token requests per level (0: none)")
      ->check(CLI::Range(0, 1));
  c->add_option("--prefill-probe", o->prefill_probe,
                "prefill-probe mode: the arriving prompt's length")
      ->check(CLI::Range(0, 1 << 20));
  c->add_option("--probe-after", o->probe_after,
                "prefill-probe: seconds every stream has streamed before the probe")
      ->check(CLI::Range(0.0, 3600.0));
  c->callback([o] {
    const std::vector<int> levels = parse_ints("--concurrency", o->concurrency, 1, 4096);
    const int rc = o->prefill_probe > 0
                       ? prefill_probe(*o, *std::max_element(levels.begin(), levels.end()))
                       : bench(*o, levels);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace md::cli
