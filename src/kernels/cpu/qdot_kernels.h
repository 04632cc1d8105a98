// The integer dot-product kernels' entry points (private to src/kernels/cpu; qdot.h has the
// contract). Only matmul_qdot (qdot.cpp) calls them, after checking the ISA level.
#pragma once
#include <cstdint>

#include "megadecode/kernels/cpu/qdot.h"

namespace md::cpu::detail {

// qdot_avx512bf16.cpp (the avx512bf16 level, which includes AVX-512 VNNI):
void matmul_qdot_avx512vnni(const QdotWeights& w, int64_t r0, int64_t r1, const float* X, int B,
                            int64_t ldx, float* Y, int64_t ldy);
// qdot_avx2.cpp (the avx2 and avx512 levels: CPUs without AVX-512 VNNI):
void matmul_qdot_avx2(const QdotWeights& w, int64_t r0, int64_t r1, const float* X, int B,
                      int64_t ldx, float* Y, int64_t ldy);
// qdot.cpp (the x86-64 baseline level):
void matmul_qdot_portable(const QdotWeights& w, int64_t r0, int64_t r1, const float* X, int B,
                          int64_t ldx, float* Y, int64_t ldy);

}  // namespace md::cpu::detail
