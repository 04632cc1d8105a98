// AVX-512 variant of the bandwidth stream: one full cache line per load, as the matmul kernels do.
// Compiled for the avx512 level (AVX-512 F/BW/VL/DQ) and entered only there.
#include <immintrin.h>

#include "megadecode/kernels/cpu/bandwidth.h"

namespace md::cpu::detail {

unsigned long long stream_read_sum_avx512(const void* p, size_t n) {
  const __m512i* v = static_cast<const __m512i*>(p);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t lines = n / 64, i = 0;
  for (; i + 4 <= lines; i += 4) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(v + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(v + i + 1));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(v + i + 2));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(v + i + 3));
  }
  for (; i < lines; ++i) a0 = _mm512_add_epi64(a0, _mm512_load_si512(v + i));
  __m512i s = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
  // Stored and summed in scalar code: GCC 12's _mm512_reduce_add_epi64 trips -Wuninitialized (PR
  // 105593).
  alignas(64) unsigned long long lanes[8];
  _mm512_store_si512(lanes, s);
  unsigned long long r = 0;
  for (unsigned long long l : lanes) r += l;
  return r;
}

}  // namespace md::cpu::detail
