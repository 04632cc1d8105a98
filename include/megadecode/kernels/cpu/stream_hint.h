// Where a GEMV call's last prefetches go: the streams this thread reads next.
//
// The GEMV kernels prefetch their rows a whole tile or more ahead (tile_prefetch.h), so the last
// tiles of a call prefetch past its own rows. When the next call reads the rows right after them
// (a worker's run of tiles of one matrix) those prefetches are what it needs; when it reads
// another matrix (the up projection after the gate, the next expert, the next op) they are wasted,
// and the next call starts cold: its first tile comes from the hardware prefetchers alone. On the
// Emerald Rapids host a bf16 GEMV in calls of 64 rows (295 KB) at scattered places read at 74% of
// the one-thread probe against 91% for the same calls back to back (bench/RESULTS.md, "The GEMV's
// last prefetches go to the next call").
//
// So the executor lists, before each instruction, the weight streams it is about to read in order
// (the instruction's own, then the next instruction's first), and every call through linear_rows
// drops its own stream from the front of the list and sends the prefetches that run past its end
// to the first stream left. Only addresses change: what is computed, and how, does not.
#pragma once
#include <cstddef>

namespace md::cpu {

struct ByteSpan {
  const char* begin = nullptr;
  const char* end = nullptr;
};

inline constexpr int kMaxUpcomingStreams = 4;

// Replaces this thread's list of upcoming streams (in the order they will be read; at most
// kMaxUpcomingStreams are kept). Empty spans are skipped.
void set_upcoming_streams(const ByteSpan* spans, int n);

// One GEMV call over the stored bytes [begin, end) (the codes or values of its rows), for its
// lifetime: the upcoming streams that overlap it are dropped from the list, and the kernels'
// prefetches past `end` go to the first one left (none: past `end`, as without a list).
class StreamCall {
 public:
  StreamCall(const void* begin, const void* end);
  ~StreamCall();
  StreamCall(const StreamCall&) = delete;
  StreamCall& operator=(const StreamCall&) = delete;
};

// Where the GEMV kernels' prefetch of address p goes on this thread now (a tile's region ahead
// that starts at p): p, or inside a StreamCall whose rows end before p, the same distance into the
// first upcoming stream. (What TilePrefetch applies; exposed for the tests.)
const void* run_off_target(const void* p);

}  // namespace md::cpu
