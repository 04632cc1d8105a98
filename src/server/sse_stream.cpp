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

SseStream::SseStream(std::shared_ptr<RequestStream> stream,
                     std::unique_ptr<StreamRenderer> renderer, int socket, bool direct)
    : stream_(std::move(stream)),
      renderer_(std::move(renderer)),
      socket_(socket),
      direct_(direct && socket >= 0),
      last_write_(now_seconds()) {}

StreamTotals SseStream::totals() const {
  std::lock_guard<std::mutex> lk(mu_);
  return renderer_->totals();
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
      out = renderer_->start();
    }
  }
  ChoiceEvent e;
  const bool got = stream_->next(e, kPeerCheckSeconds);
  const bool finished = stream_->finished();
  bool ok = true;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (got) out += renderer_->event(e);
    if (finished) {
      out += renderer_->end();
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
  std::string sse = renderer_->event(e);
  if (last) {
    sse += renderer_->end();
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
    queue_and_send(renderer_->start());
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

}  // namespace md::server
