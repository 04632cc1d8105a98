// The int8 weight kernels' shared contract (private to src/kernels/cpu; the format and numerics are
// in kernels/cpu/int8.h). One dispatch (int8.cpp) picks the active ISA level's kernel.
#pragma once
#include <cstdint>

#include "megadecode/base/bf16.h"

namespace md::cpu::detail {

struct Q8Matrix {
  const uint8_t* codes = nullptr;  // row 0: [N, K], code c is q = c - 128
  const bf16* scales = nullptr;    // row 0: [N, K/group]
  int64_t K = 0;                   // a positive multiple of 32 (and of group)
  int group = 32;                  // a multiple of 32
  int64_t scales_per_row() const { return K / group; }
};

// ISA entry points; only matmul_int8 calls them, after checking the level (cpu_features.h).
// q8_avx512.cpp (AVX-512 F/BW/VL/DQ; the avx512 and avx512bf16 levels):
void matmul_q8_avx512(const Q8Matrix& w, int64_t r0, int64_t r1, const float* X, int B,
                      int64_t ldx, float* Y, int64_t ldy);
// q8_avx2.cpp (AVX2 + FMA):
void matmul_q8_avx2(const Q8Matrix& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
                    float* Y, int64_t ldy);
// int8.cpp (the x86-64 baseline):
void matmul_q8_portable(const Q8Matrix& w, int64_t r0, int64_t r1, const float* X, int B,
                        int64_t ldx, float* Y, int64_t ldy);

}  // namespace md::cpu::detail
