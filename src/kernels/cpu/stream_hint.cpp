// This thread's upcoming streams and the run-off target of its current GEMV call
// (stream_hint.h; read by TilePrefetch, tile_prefetch.h).
#include "megadecode/kernels/cpu/stream_hint.h"

#include "tile_prefetch.h"

namespace md::cpu {

namespace detail {
constinit thread_local RunOff t_run_off;
}  // namespace detail

namespace {
struct Upcoming {
  ByteSpan s[kMaxUpcomingStreams];
  int n = 0, head = 0;
};
thread_local Upcoming t_upcoming;
}  // namespace

void set_upcoming_streams(const ByteSpan* spans, int n) {
  Upcoming& u = t_upcoming;
  u.n = u.head = 0;
  for (int i = 0; i < n && u.n < kMaxUpcomingStreams; ++i)
    if (spans[i].begin && spans[i].end > spans[i].begin) u.s[u.n++] = spans[i];
}

StreamCall::StreamCall(const void* begin, const void* end) {
  const char* b = static_cast<const char*>(begin);
  const char* e = static_cast<const char*>(end);
  Upcoming& u = t_upcoming;
  // Streams this call reads (its own rows, or a part of them) are done once it runs.
  while (u.head < u.n && u.s[u.head].begin < e && u.s[u.head].end > b) ++u.head;
  detail::RunOff& r = detail::t_run_off;
  r.end = e;
  r.next = u.head < u.n ? u.s[u.head].begin : nullptr;
}

StreamCall::~StreamCall() {
  detail::t_run_off = detail::RunOff{};
}

}  // namespace md::cpu

namespace md::cpu {

const void* run_off_target(const void* p) {
  return detail::run_off_target(detail::t_run_off, static_cast<const char*>(p));
}

}  // namespace md::cpu
