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
// call's last rows prefetch past them (into the next rows or off the end: a prefetch never
// faults); the first tile of a call is left to the hardware prefetchers.
#pragma once
#include <xmmintrin.h>

#include <cstdint>

namespace md::cpu::detail {
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
  }
  // Step s of the tile (s = 0, 1, ..): the lines of bytes [s, s + 1) x NR x StepBytes of the
  // region ahead.
  void step(int64_t s) const {
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
