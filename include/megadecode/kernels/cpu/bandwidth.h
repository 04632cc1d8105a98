// Memory read bandwidth of this machine, measured the way decode uses memory: every thread of the
// pool streams its contiguous share of a buffer much larger than the last-level cache. Kernel
// throughput is judged against this number rather than a datasheet figure, and because the
// bandwidth of a shared (virtualised) host drifts over minutes, callers re-measure it next to
// their timings instead of caching one value.
#pragma once
#include <cstddef>

#include "megadecode/base/threads.h"

namespace md::cpu {

// Streams `bytes` (rounded down to whole 4 KiB pages per thread) with 64-byte loads whose sum is
// kept live, `reps` times after one untimed warm-up pass, and returns the median rate in GB/s
// (1e9 bytes per second). The buffer is allocated (with transparent huge pages where allowed) and
// filled on first use, then kept for later calls of the same size; release it with
// release_bandwidth_buffer().
double measure_read_bandwidth_gbps(ThreadPool& pool, size_t bytes = size_t{1} << 30, int reps = 5);

// Frees the buffer kept by measure_read_bandwidth_gbps (a no-op when there is none).
void release_bandwidth_buffer();

// Streams [p, p + n) (n a multiple of 64, p 64-byte aligned) once and returns a value depending
// on every byte, so the loads cannot be elided. Exposed for the benchmarks. Uses 64-byte loads at
// the avx512 ISA level and above (cpu_features.h), 16-byte loads below.
unsigned long long stream_read_sum(const void* p, size_t n);

namespace detail {
unsigned long long stream_read_sum_portable(const void* p, size_t n);
unsigned long long stream_read_sum_avx512(const void* p, size_t n);  // avx512 level only
}  // namespace detail

}  // namespace md::cpu
