// The 8-bit weight kernels' shared contract (private to src/kernels/cpu): int8 codes with bf16 group
// scales (kernels/cpu/int8.h) and FP8 e4m3 values with fp32 group scales (kernels/cpu/fp8.h) share
// the tiling, differing only in the decode and the scale type. One dispatch (int8.cpp) picks the
// active ISA level's kernel.
#pragma once
#include <cstdint>

#include "megadecode/base/bf16.h"

namespace md::cpu::detail {

enum class Q8Codes : uint8_t {
  kInt8,  // code c is the integer c - 128; bf16 scales
  kFp8,   // byte b is an e4m3 value; fp32 scales
};

struct Q8Matrix {
  const uint8_t* codes = nullptr;  // row 0: [N, K]
  const void* scales = nullptr;    // row 0: [N, K/group], bf16 (int8) or fp32 (FP8)
  int64_t K = 0;                   // a positive multiple of 32 (and of group)
  int group = 32;                  // a multiple of 32
  Q8Codes kind = Q8Codes::kInt8;
  int64_t scales_per_row() const { return K / group; }
};

// The dispatch (int8.cpp) and the fp32 value of each e4m3 byte (exact; NaN for 0x7f and 0xff).
void matmul_q8(const Q8Matrix& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
               float* Y, int64_t ldy);
extern const float kE4m3Values[256];

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
