#include "megadecode/kernels/cpu/bandwidth.h"

#include <emmintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include "megadecode/base/util.h"
#include "megadecode/kernels/cpu/cpu_features.h"

namespace md::cpu {

namespace detail {

unsigned long long stream_read_sum_portable(const void* p, size_t n) {
  // Four independent accumulators so the adds never limit the load rate.
  const __m128i* v = static_cast<const __m128i*>(p);
  __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n / 16; i += 4) {
    a0 = _mm_add_epi64(a0, _mm_load_si128(v + i));
    a1 = _mm_add_epi64(a1, _mm_load_si128(v + i + 1));
    a2 = _mm_add_epi64(a2, _mm_load_si128(v + i + 2));
    a3 = _mm_add_epi64(a3, _mm_load_si128(v + i + 3));
  }
  __m128i s = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
  uint64_t out[2];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), s);
  return out[0] + out[1];
}

}  // namespace detail

unsigned long long stream_read_sum(const void* p, size_t n) {
  // 64-byte loads from the avx512 level up, as the matmul kernels stream; 16-byte ones below.
  return active_isa() >= Isa::kAvx512 ? detail::stream_read_sum_avx512(p, n)
                                      : detail::stream_read_sum_portable(p, n);
}

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;

struct Buffer {
  unsigned char* data = nullptr;
  size_t bytes = 0;
};

std::mutex g_mu;
Buffer g_buf;
volatile unsigned long long g_sink;

void free_buffer_locked() {
  std::free(g_buf.data);
  g_buf = Buffer{};
}

// Returns a filled buffer of exactly `bytes`. Each thread writes the pages it will later read:
// untouched pages would all map the shared zero page and be read from cache, and writing from the
// reading thread keeps first-touch placement right on multi-node hosts.
unsigned char* get_buffer(ThreadPool& pool, size_t bytes) {
  if (g_buf.data && g_buf.bytes == bytes) return g_buf.data;
  free_buffer_locked();
  size_t alloc = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, alloc);
  if (!p) throw std::bad_alloc();
  // Without huge pages the page walks of a 1 GiB stream measurably lower the rate; the advice is
  // best effort (THP may be disabled).
  madvise(p, alloc, MADV_HUGEPAGE);
  g_buf.data = static_cast<unsigned char*>(p);
  g_buf.bytes = bytes;
  pool.run([&](int id, int nw) {
    auto [b, e] = split_range(bytes, nw, id, kPage);
    for (size_t i = b; i < e; i += kPage) {
      std::memset(g_buf.data + i, static_cast<int>((i / kPage) & 0xff) | 1, std::min(kPage, e - i));
    }
  });
  return g_buf.data;
}

}  // namespace

void release_bandwidth_buffer() {
  std::lock_guard<std::mutex> lock(g_mu);
  free_buffer_locked();
}

double measure_read_bandwidth_gbps(ThreadPool& pool, size_t bytes, int reps) {
  std::lock_guard<std::mutex> lock(g_mu);
  const int nw = pool.size();
  // Whole pages per thread so every thread streams the same amount from aligned addresses.
  size_t per = bytes / static_cast<size_t>(nw) / kPage * kPage;
  if (per == 0) per = kPage;
  const size_t total = per * static_cast<size_t>(nw);
  unsigned char* buf = get_buffer(pool, total);
  std::atomic<unsigned long long> sink{0};
  auto pass = [&] {
    pool.run([&](int id, int) {
      unsigned long long s = stream_read_sum(buf + per * static_cast<size_t>(id), per);
      sink.fetch_add(s, std::memory_order_relaxed);
    });
  };
  pass();  // warm-up: TLB, thread wake-up, frequency ramp
  std::vector<double> gbps;
  for (int r = 0; r < std::max(1, reps); ++r) {
    double t0 = now_seconds();
    pass();
    double dt = now_seconds() - t0;
    gbps.push_back(static_cast<double>(total) / dt * 1e-9);
  }
  // Publishing the sums keeps the compiler from dropping the loads.
  g_sink = sink.load(std::memory_order_relaxed);
  std::sort(gbps.begin(), gbps.end());
  size_t m = gbps.size();
  return m % 2 ? gbps[m / 2] : 0.5 * (gbps[m / 2 - 1] + gbps[m / 2]);
}

}  // namespace md::cpu
