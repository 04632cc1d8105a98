// Matrix-vector / matrix-matrix products against bf16 (or fp32) weights with fp32 accumulation.
// These carry most of the bytes of a decode step, so they have an AVX-512 BF16 path (vdpbf16ps)
// chosen at run time and a portable path; both compute the same function (see the unit tests for
// the tolerance between them: accumulation order only).
#pragma once
#include <cstdint>

#include "megadecode/base/bf16.h"

namespace md::cpu {

// Y[b * ldy + r] = sum_k W[r * K + k] * X[b * ldx + k]   for r in [r0, r1), b in [0, B).
// W is row-major [rows, K] (a Hugging Face Linear weight [out, in]). X holds B activation vectors.
// x_is_bf16: the caller promises every X value is exactly representable in bf16 (the reference
// rounds activations there), so the kernel may convert X to bf16 losslessly and use bf16 dot
// products; otherwise X is used in full fp32 precision. Accumulation is fp32. Any K >= 1 works
// (no alignment requirement); results are deterministic for given arguments.
void matmul_bf16(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                 int64_t ldx, float* Y, int64_t ldy, bool x_is_bf16);

// Same with fp32 weights (e.g. the router gate that the reference keeps in fp32).
void matmul_f32(const float* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                int64_t ldx, float* Y, int64_t ldy);

// Which implementation matmul_bf16 uses: "avx512bf16" or "portable". The environment variable
// MEGADECODE_ISA=portable forces the portable path (tests run both).
const char* matmul_isa();
void set_matmul_isa_portable(bool portable);  // for tests and benchmarks

}  // namespace md::cpu
