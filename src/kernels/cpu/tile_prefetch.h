// Software prefetch for the GEMV tiles of every weight format (bf16/fp32, 4-bit, 8-bit, integer
// dot products; AVX-512 and AVX2). A GEMV tile walks NR consecutive rows (one contiguous region
// of NR x row-bytes) in steps of StepBytes per row. While it does, this streams the region one or
// more whole tiles ahead into L2, in address order, NR x StepBytes bytes per step: by the time the
// tiles get there every line of theirs has been requested, and the core keeps a steady stream of
// line requests in flight, as a linear read does.
//
// Why not a prefetch per row a few hundred bytes ahead (what the kernels did before): with 8-16
// short rows walked side by side, every row stream restarts at each tile, the hardware prefetchers
// see 8-16 interleaved streams, and the lines in flight stay too few to use a fast memory system.
// Measured on the AMD EPYC Zen 4 host (bench/RESULTS.md, "W4A8 / W8A8 and the GEMV prefetch a tile
// ahead"): the bf16 GEMV went from 61-75% to 80-86% of the one-thread read probe and from 69-72% to
// 96-97% of the two-thread one; kl48-e32 bf16 decode from ~66% to 81-83% of its floor. Streaming
// into L1 instead (T0) was no better, and worse for the 8-bit kernels.
//
// The distance is a whole number of tiles (a tile's lines must all be requested before it
// starts), at least kMinAheadBytes so that short tiles still look far enough ahead. The tiles of a
// call's last rows prefetch past them: into the next rows, or, inside a StreamCall with a list of
// upcoming streams (stream_hint.h), into the stream this thread reads next, so that the next call's
// first tile is on its way too (a prefetch never faults, wherever it points).
#pragma once
#include <xmmintrin.h>

#include <cstdint>

namespace md::cpu::detail {

// Where the current GEMV call's prefetches past its rows go (stream_hint.cpp sets it for the call's
// lifetime): a tile's region ahead that starts at end + d starts at next + d instead.
// end == nullptr: no call is marked, prefetches go where they point.
struct RunOff {
  const char* end = nullptr;
  const char* next = nullptr;
};
// The calling thread's. constinit: no dynamic initialisation, so no TLS wrapper call. local-exec:
// the compiler addresses it off %fs itself; the default (initial-exec through the GOT, relaxed by
// the linker) fails to link where the load was folded into an AVX-512 instruction. The library
// is static and linked into executables only, where local-exec is valid.
extern constinit thread_local RunOff t_run_off __attribute__((tls_model("local-exec")));

// Where a prefetch of p made under r goes: past the call's rows, to the same offset in the next
// stream; anywhere else, p.
inline const char* run_off_target(const RunOff& r, const char* p) {
  return r.end && r.next && p >= r.end ? r.next + (p - r.end) : p;
}

namespace {

template <int NR, int StepBytes>
class TilePrefetch {
 public:
  static constexpr int64_t kMinAheadBytes = 16 << 10;
  // w: the tile's first row; rb: bytes from one row to the next.
  TilePrefetch(const void* w, int64_t rb) {
    const int64_t tile = rb * NR;
    const int64_t tiles = tile >= kMinAheadBytes ? 1 : (kMinAheadBytes + tile - 1) / tile;
    ahead_ = static_cast<const char*>(w) + tiles * tile;
    // A region ahead that starts past the call's rows moves to the stream read next. (Only here,
    // once a tile: a check in every step costs the 4-bit kernels registers they spill.)
    ahead_ = run_off_target(t_run_off, ahead_);
  }
  // Step s of the tile (s = 0, 1, ..): the lines of bytes [s, s + 1) x NR x StepBytes of the
  // region ahead. Always inlined: GCC counts a function that only prefetches as free of side
  // effects, and deletes a call to it that it did not inline.
  [[gnu::always_inline]] void step(int64_t s) const {
    constexpr int64_t kPer = int64_t{NR} * StepBytes;
    if constexpr (kPer % 64 == 0) {
      const char* p = ahead_ + s * kPer;
      for (int64_t b = 0; b < kPer; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    } else {
      for (int64_t l = (s * kPer + 63) / 64; l < ((s + 1) * kPer + 63) / 64; ++l)
        _mm_prefetch(ahead_ + 64 * l, _MM_HINT_T1);
    }
  }

 private:
  const char* ahead_;
};

}  // namespace
}  // namespace md::cpu::detail
