// The upcoming-stream list and the run-off of a GEMV call's last prefetches (stream_hint.h).
#include <gtest/gtest.h>

#include <vector>

#include "megadecode/kernels/cpu/stream_hint.h"

namespace md::cpu {
namespace {

struct Buffers {
  std::vector<char> bytes = std::vector<char>(4096);
  ByteSpan span(size_t at, size_t n) const { return {bytes.data() + at, bytes.data() + at + n}; }
  const char* at(size_t i) const { return bytes.data() + i; }
};

TEST(StreamHint, WithoutACallOrAListPrefetchesGoWhereTheyPoint) {
  Buffers b;
  set_upcoming_streams(nullptr, 0);
  EXPECT_EQ(run_off_target(b.at(100)), b.at(100));
  const StreamCall call(b.at(0), b.at(64));
  EXPECT_EQ(run_off_target(b.at(64)), b.at(64));  // no stream listed: past the end, unchanged
  EXPECT_EQ(run_off_target(b.at(200)), b.at(200));
}

TEST(StreamHint, EachCallDropsItsOwnStreamAndRunsOffIntoTheNext) {
  Buffers b;
  const ByteSpan gate = b.span(0, 256), up = b.span(1024, 256), next = b.span(3000, 512);
  const ByteSpan list[] = {gate, up, next};
  set_upcoming_streams(list, 3);
  {
    const StreamCall call(gate.begin, gate.end);  // the gate rows: the up rows come next
    EXPECT_EQ(run_off_target(b.at(10)), b.at(10));  // inside the call's rows: unchanged
    EXPECT_EQ(run_off_target(gate.end), up.begin);
    EXPECT_EQ(run_off_target(gate.end + 100), up.begin + 100);
  }
  EXPECT_EQ(run_off_target(gate.end + 100), gate.end + 100);  // the call is over
  {
    // A call over bytes no listed stream overlaps (a weight the tile reads outside the list)
    // leaves the list alone.
    const StreamCall call(b.at(2000), b.at(2100));
    EXPECT_EQ(run_off_target(b.at(2100)), up.begin);
  }
  {
    const StreamCall call(up.begin, up.end);  // the up rows: then the next tile's stream
    EXPECT_EQ(run_off_target(up.end + 64), next.begin + 64);
  }
  {
    // A call over part of the next stream (its rows split into two calls) drops it too; nothing
    // is listed after it.
    const StreamCall call(next.begin, next.begin + 128);
    EXPECT_EQ(run_off_target(next.begin + 128), next.begin + 128);
  }
}

TEST(StreamHint, EmptySpansAreSkippedAndTheListIsBounded) {
  Buffers b;
  std::vector<ByteSpan> list = {ByteSpan{}, b.span(0, 64), b.span(100, 0)};
  for (int i = 0; i < kMaxUpcomingStreams + 2; ++i) list.push_back(b.span(200 + 300 * size_t(i), 64));
  set_upcoming_streams(list.data(), int(list.size()));
  const char* own = b.at(0);
  {
    const StreamCall call(own, own + 64);  // drops span(0, 64); the empty ones were never listed
    EXPECT_EQ(run_off_target(own + 64), b.at(200));
  }
  // kMaxUpcomingStreams were kept: span(0, 64) and the first three at 200, 500, 800.
  for (int i = 0; i < kMaxUpcomingStreams - 1; ++i) {
    const char* s = b.at(200 + 300 * size_t(i));
    const StreamCall call(s, s + 64);
    const char* want = i + 1 < kMaxUpcomingStreams - 1 ? b.at(200 + 300 * size_t(i + 1)) : s + 64;
    EXPECT_EQ(run_off_target(s + 64), want) << "stream " << i;
  }
  set_upcoming_streams(nullptr, 0);
}

}  // namespace
}  // namespace md::cpu
