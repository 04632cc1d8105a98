#include "sse_stream.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>

#include "megadecode/base/util.h"

namespace md::server {

using nlohmann::json;

// A client that closes its end makes the socket readable at end of file; poll's POLLRDHUP
// (Linux) says so at once (a recv peek of 0 bytes where it is not reported), and POLLHUP /
// POLLERR say the connection was reset. A client that half-closes after its request counts as
// gone too, as uvicorn (vLLM's server) treats it.
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

namespace {

bool would_block(int err) {
  return err == EAGAIN || err == EWOULDBLOCK || err == EINTR;
}

// Writes all of `buf` to a non-blocking-used socket, waiting for room; false when the peer left,
// the connection failed, or nothing could be written for the write timeout.
bool send_all(int fd, const std::string& buf, double timeout_s) {
  size_t off = 0;
  double progress = now_seconds();
  while (off < buf.size()) {
    const ssize_t n = ::send(fd, buf.data() + off, buf.size() - off, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      off += size_t(n);
      progress = now_seconds();
      continue;
    }
    if (n < 0 && !would_block(errno)) return false;
    if (now_seconds() - progress > timeout_s || peer_closed(fd)) return false;
    pollfd p{fd, POLLOUT, 0};
    poll(&p, 1, int(kPeerCheckSeconds * 1e3));
  }
  return true;
}

}  // namespace

SseStream::SseStream(std::shared_ptr<RequestStream> stream, CompletionRequest req,
                     ResponseMeta meta, const Tokenizer& tok, size_t choices, int socket,
                     bool direct)
    : stream_(std::move(stream)),
      req_(std::move(req)),
      meta_(std::move(meta)),
      tok_(tok),
      socket_(socket),
      direct_(direct && socket >= 0),
      last_write_(now_seconds()),
      text_offset_(choices, 0),
      echoed_(choices, false),
      plain_(choices) {
  if (req_.tools_given)
    for (size_t i = 0; i < choices; ++i)
      tools_.emplace_back(req_.chat_template, tool_call_id_prefix(meta_, i));
}

SseStream::Totals SseStream::totals() const {
  std::lock_guard<std::mutex> lk(mu_);
  return totals_;
}

void SseStream::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
  }
  stream_->cancel();  // a no-op for a finished request; frees the slots of one cut short
}

bool SseStream::provide(httplib::DataSink& sink) {
  return direct_ ? provide_direct(sink) : provide_queued(sink);
}

// ---- the queued path: the HTTP thread takes the events and writes them through httplib --------

bool SseStream::provide_queued(httplib::DataSink& sink) {
  std::string out;
  bool end = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!started_) {
      started_ = true;
      out = render_start();
    }
  }
  ChoiceEvent e;
  const bool got = stream_->next(e, kPeerCheckSeconds);
  const bool finished = stream_->finished();
  bool ok = true;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (got) out += render_event(e);
    if (finished) {
      out += render_end();
      end = true;
    }
    // Nothing came: a client that left is noticed now rather than at the next write. Nothing
    // for a while (queued, or a long prompt prefilling): an SSE comment, which clients ignore,
    // finds out whether the client is still there.
    if (out.empty() && peer_closed(socket_)) ok = false;
    if (ok && out.empty() && now_seconds() - last_write_ > 1.0) out = ": keep-alive\n\n";
    if (!out.empty()) last_write_ = now_seconds();
  }
  if (ok && !out.empty()) ok = sink.write(out.data(), out.size());
  if (ok && end) sink.done();
  if (!ok) stream_->cancel();
  return ok;
}

// ---- the direct path: the engine thread writes, the HTTP thread flushes and watches ------------

void SseStream::fail() {
  failed_ = true;
  stream_->cancel();
  cv_.notify_all();
}

void SseStream::queue_and_send(const std::string& sse) {
  if (!sse.empty()) out_ += fmt::format("{:x}\r\n{}\r\n", sse.size(), sse);
  if (out_.size() > kMaxBufferedBytes) return fail();  // the client reads nothing
  if (flushing_ || out_.empty()) return;  // the HTTP thread sends what follows its bytes
  const ssize_t n = ::send(socket_, out_.data(), out_.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n > 0) {
    out_.erase(0, size_t(n));
    last_write_ = now_seconds();
  } else if (n < 0 && !would_block(errno)) {
    fail();
  }
}

void SseStream::on_event(ChoiceEvent&& e, bool last) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_ || failed_) return;
  std::string sse = render_event(e);
  if (last) {
    sse += render_end();
    ended_ = true;
  }
  queue_and_send(sse);
  // The HTTP thread wakes only for bytes the socket did not take, or to end the body.
  if (!out_.empty() || ended_) cv_.notify_all();
}

bool SseStream::provide_direct(httplib::DataSink& sink) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!started_) {
    started_ = true;
    queue_and_send(render_start());
    lk.unlock();
    // The headers are out (httplib writes them before it calls the provider): from now on the
    // engine thread writes this response's events itself, starting with any already queued.
    stream_->set_consumer([w = weak_from_this()](ChoiceEvent&& ev, bool last) {
      if (const auto s = w.lock()) s->on_event(std::move(ev), last);
    });
    lk.lock();
  }
  cv_.wait_for(lk, std::chrono::duration<double>(kPeerCheckSeconds),
               [&] { return !out_.empty() || ended_ || failed_; });
  if (!failed_ && !out_.empty()) {
    // A slow reader: write what the engine left, without holding the engine up meanwhile (it
    // appends behind these bytes).
    std::string buf;
    buf.swap(out_);
    flushing_ = true;
    lk.unlock();
    const bool ok = send_all(socket_, buf, kWriteTimeoutSeconds);
    lk.lock();
    flushing_ = false;
    if (ok) last_write_ = now_seconds();
    if (!ok) fail();
  }
  if (!failed_ && out_.empty() && !ended_) {
    if (peer_closed(socket_)) {
      fail();
    } else if (now_seconds() - last_write_ > 1.0) {
      queue_and_send(": keep-alive\n\n");
    }
  }
  if (failed_) {
    closed_ = true;
    return false;
  }
  if (ended_ && out_.empty()) {
    closed_ = true;  // from here on httplib owns the socket again
    lk.unlock();
    sink.done();
  }
  return true;
}

// ---- rendering
// -----------------------------------------------------------------------------------

std::string SseStream::render_start() {
  std::string out;
  if (req_.kind != RequestKind::kChat) return out;
  for (size_t i = 0; i < text_offset_.size(); ++i) {
    json j =
        chat_chunk(meta_, int(i), {{"role", "assistant"}, {"content", ""}}, nullptr, std::nullopt);
    if (req_.include_usage) j["usage"] = nullptr;
    out += "data: " + dump(j) + "\n\n";
  }
  return out;
}

const ChunkTemplate& SseStream::plain_chunk(size_t i) {
  ChunkTemplate& t = plain_[i];
  if (!t.valid()) {
    json j = req_.kind == RequestKind::kChat
                 ? chat_chunk(meta_, int(i), {{"content", ChunkTemplate::kMarker}}, nullptr,
                              std::nullopt)
                 : completion_chunk(meta_, int(i), ChunkTemplate::kMarker, nullptr, std::nullopt);
    if (req_.include_usage) j["usage"] = nullptr;
    t = ChunkTemplate(j);
  }
  return t;
}

std::string SseStream::render_event(ChoiceEvent& e) {
  const CompletionRequest& r = req_;
  const bool chat = r.kind == RequestKind::kChat;
  std::string out;
  const size_t i = size_t(e.choice);
  if (!e.tokens.empty() && totals_.first_token == 0) totals_.first_token = now_seconds();
  // The common event, text and nothing else: from the choice's template (what the general path
  // below builds, byte for byte; tested).
  const bool plain = e.error.empty() && !e.finish_reason && !r.logprobs &&
                     (chat ? !r.tools_given && e.reasoning.empty() : !(r.echo && !echoed_[i]));
  if (plain && plain_chunk(i).valid()) {
    if (!e.text.empty() || !e.tokens.empty()) out = plain_[i].sse(e.text);
    return out;
  }
  auto send = [&](json j) {
    if (r.include_usage && !j.contains("usage")) j["usage"] = nullptr;
    out += "data: " + dump(j) + "\n\n";
  };
  if (!e.error.empty()) {
    ApiError err(500, e.error, "", "engine_error");
    out += "data: " + dump(err.to_json()) + "\n\n";
  } else if (chat) {
    json delta = json::object();
    std::string text = std::move(e.text);
    if (!e.reasoning.empty()) delta["reasoning_content"] = e.reasoning;
    std::string finish = e.finish_reason.value_or("");
    if (r.tools_given) {
      // Content goes out as it comes unless it may begin a tool-call section; a call goes out
      // as its header completes (index, id, name), then its arguments in pieces.
      ToolCallStream& tc = tools_[i];
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
    // A token whose text is held back (an incomplete UTF-8 sequence, a possible stop string)
    // still gets its chunk, with empty content, as vLLM sends it: a client sees every token
    // arrive. (A tool-call parser's held-back content sends nothing, as vLLM's parsers do.)
    if (!text.empty() || (!r.tools_given && !e.tokens.empty() && delta.empty()))
      delta["content"] = text;
    json lp = r.logprobs && !e.logprobs.empty() ? chat_logprobs(e.logprobs, tok_) : json(nullptr);
    if (!delta.empty() || !lp.is_null() || e.finish_reason)
      send(chat_chunk(meta_, int(i), delta, lp,
                      e.finish_reason ? std::optional<std::string>(finish) : std::nullopt));
  } else {
    json lp = nullptr;
    std::string text = std::move(e.text);
    if (r.echo && !echoed_[i]) {
      // The prompt goes out with the choice's first event, which carries its logprobs.
      echoed_[i] = true;
      const std::vector<int32_t>& prompt = r.prompts[i / size_t(r.n)];
      if (r.logprobs) lp = echo_logprobs(prompt, e.prompt_logprobs, e.logprobs, tok_);
      text = sanitize_utf8(tok_.decode(prompt, false)) + text;
    } else if (r.logprobs && !e.logprobs.empty()) {
      lp = completion_logprobs(e.logprobs, tok_, text_offset_[i]);
    }
    if (lp.is_object() && !lp["tokens"].empty())  // the next offsets go on from the last token
      text_offset_[i] =
          lp["text_offset"].back().get<size_t>() + lp["tokens"].back().get<std::string>().size();
    if (!text.empty() || !e.tokens.empty() || !lp.is_null() || e.finish_reason)
      send(completion_chunk(meta_, int(i), text, lp, e.finish_reason));
  }
  if (e.finish_reason || !e.error.empty()) {
    // A prompt counts once however many choices it has.
    if (chat ? i == 0 : i % size_t(r.n) == 0) {
      totals_.prompt_tokens += e.prompt_tokens;
      totals_.cached_tokens += e.cached_tokens;
    }
    totals_.completion_tokens += e.completion_tokens;
  }
  return out;
}

std::string SseStream::render_end() {
  std::string out;
  if (req_.include_usage) {
    const bool chat = req_.kind == RequestKind::kChat;
    const json u = {{"id", meta_.id},
                    {"object", chat ? "chat.completion.chunk" : "text_completion"},
                    {"created", meta_.created},
                    {"model", meta_.model},
                    {"choices", json::array()},
                    {"usage", usage_json(totals_.prompt_tokens, totals_.completion_tokens,
                                         totals_.cached_tokens)}};
    out += "data: " + dump(u) + "\n\n";
  }
  out += "data: [DONE]\n\n";
  return out;
}

}  // namespace md::server
