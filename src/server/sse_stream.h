// A streamed response (private to src/server): the engine's events of one request turned into
// server-sent events, and how they reach the client's socket.
//
// Why the engine thread writes them itself. On a host with few cores, the decode workers spin on
// every core during a step. A token handed to an HTTP thread wakes that thread, which preempts a
// worker; the worker's partners then wait for it at the next counter, so each streamed token
// cost a preemption of a synchronisation-bound step (bench/RESULTS.md, issue 11). Here the
// engine thread renders a token's chunk and sends it between two steps, with a non-blocking
// send: nothing else wakes. What the socket does not take at once (a slow reader) stays in a
// bounded buffer that the response's HTTP thread flushes with blocking writes; the engine never
// waits on a client.
//
// The HTTP thread keeps everything else: it writes the first bytes (httplib sends the status and
// headers before it calls the content provider, so the engine's writes start only after that),
// looks at the connection every kPeerCheckSeconds (a client that left cancels its request), sends
// SSE comments as keep-alives, and ends the chunked body. The two threads take turns under one
// mutex, and the engine writes only while the response is open: once the HTTP thread is done
// with the socket (which httplib may close and the kernel reuse), the engine drops the events.
//
// The chunked framing of the engine's writes is HTTP/1.1's (size in hex, CRLF, data, CRLF),
// written to the socket where httplib would have written it (httplib never compresses
// text/event-stream, so the body is the chunks as they are). Where the socket cannot be found
// (connection_socket returns -1), or with ServerOptions::engine_writes_streams off, the HTTP
// thread takes the events from the RequestStream's queue and writes them through httplib.
//
// Every event that carries tokens gets a chunk, also when its text is held back (an incomplete
// UTF-8 sequence, a possible stop string): the chunk then has empty text, as vLLM sends it, so
// a client sees each token arrive and measures inter-token latency per token.
#pragma once
#include <httplib.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "megadecode/server/engine_loop.h"
#include "stream_renderer.h"

namespace md::server {

// How often a waiting handler looks at its connection.
constexpr double kPeerCheckSeconds = 0.05;

// True when the client of connection `fd` has closed or reset it (false for fd < 0).
bool peer_closed(int fd);

class SseStream : public std::enable_shared_from_this<SseStream> {
 public:
  // renderer: what the events become (stream_renderer.h). socket: the connection's descriptor
  // (connection_socket), -1 when unknown. direct: the engine thread writes the chunks (needs the
  // socket); false: the queued path.
  SseStream(std::shared_ptr<RequestStream> stream, std::unique_ptr<StreamRenderer> renderer,
            int socket, bool direct);

  // One call of httplib's chunked content provider (the response's HTTP thread): false ends the
  // response (the client is gone; the request is cancelled).
  bool provide(httplib::DataSink& sink);
  // httplib is done with the response (its resource releaser): the engine stops writing.
  void close();

  StreamTotals totals() const;

  // Bytes an unread response may hold before the client counts as gone.
  static constexpr size_t kMaxBufferedBytes = size_t(8) << 20;
  // How long a flush may wait for a client that reads nothing (httplib's write timeout).
  static constexpr double kWriteTimeoutSeconds = 5.0;

 private:
  bool provide_queued(httplib::DataSink& sink);
  bool provide_direct(httplib::DataSink& sink);
  // The engine's event (engine thread; the HTTP thread for events queued before the handover).
  void on_event(ChoiceEvent&& e, bool last);

  // Appends `sse` to out_ as one HTTP chunk and sends what the socket takes without waiting.
  void queue_and_send(const std::string& sse);
  void fail();  // the client is gone (under mu_)

  const std::shared_ptr<RequestStream> stream_;
  const std::unique_ptr<StreamRenderer> renderer_;  // used under mu_
  const int socket_;
  const bool direct_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool started_ = false;   // the first provide() ran: the headers are out
  bool ended_ = false;     // the last chunk is rendered
  bool failed_ = false;    // the client is gone
  bool closed_ = false;    // the HTTP thread is done with the socket
  bool flushing_ = false;  // the HTTP thread is writing bytes taken from out_
  std::string out_;        // framed chunks the socket has not taken yet (direct mode)
  double last_write_;
};

}  // namespace md::server
