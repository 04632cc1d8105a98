// Matrix-vector / matrix-matrix products against bf16 (or fp32) weights with fp32 accumulation.
// These carry most of the bytes of a decode step, so they have AVX2+FMA, AVX-512 and AVX-512 BF16
// (vdpbf16ps) paths chosen at run time (cpu_features.h) and a portable path; all compute the same
// function (see the unit tests for the tolerance between them: accumulation order only).
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

// Which implementation matmul_bf16 uses at the active ISA level (cpu_features.h): "portable",
// "avx2", "avx512" or "avx512bf16" (the level's name; matmul_f32 uses the avx512 kernel at the
// avx512bf16 level). Select a level with set_isa / ScopedIsa or MEGADECODE_ISA.
const char* matmul_isa();

// Numerics shared by every path, which is what lets the engine split work freely:
//  * Each output Y[b, r] is computed by one fixed sequence of fp32 operations that depends only on
//    W's row r, X's vector b and K: not on [r0, r1), on B, on the other rows or vectors, or on
//    the thread. Splitting rows across calls or threads, or running a vector alone or in a batch,
//    gives bit-identical results (the unit tests check this).
//  * The sequence differs between ISAs (lane count, FMA or not, vdpbf16ps), so ISAs agree only
//    to within the fp32 accumulation error bound, not bitwise.
//  * vdpbf16ps (the avx512bf16 path with x_is_bf16) treats denormal inputs as zero and flushes
//    denormal results, whatever MXCSR says. Weights and activations of a trained model are far
//    from the denormal range, so this only matters for contrived inputs.
//  * On the avx512bf16 path the two X modes are different sequences (vdpbf16ps vs fp32 FMA), so
//    x_is_bf16 = true and false agree within the bound, not bitwise, even for bf16-valued X.
//
// Performance (Xeon "model 207" under KVM, one core, weights in L2, CPU time): B = 1 streams
// ~65-70 GB/s with x_is_bf16 and ~40-45 GB/s without, both above one core's DRAM rate, so GEMV is
// memory bound. vdpbf16ps sustains only ~0.4 per cycle there (vs ~2 fp32 FMAs), so for B >= 4,
// where the kernel is compute bound, the x_is_bf16 = false path is up to ~1.4x faster; a caller
// that prefers prefill speed to bitwise agreement with the decode path may pass false.

// The paths, by level:
//  * portable: 8 fp32 lanes, separate multiply and add (the baseline has no FMA).
//  * avx2: 8 fp32 lanes (one ymm) per output, fp32 FMAs, X always used in fp32 (there is no bf16
//    dot product in AVX2, and converting bf16-valued X would gain nothing), so both X modes give
//    identical results.
//  * avx512: 16 fp32 lanes, fp32 FMAs for both X modes.
//  * avx512bf16: vdpbf16ps when x_is_bf16, otherwise the avx512 kernel.

namespace detail {
// The ISA entry points; only matmul.cpp calls them, after checking the level (cpu_features.h).
// matmul_avx2.cpp (AVX2 + FMA):
void matmul_bf16_avx2(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                      int64_t ldx, float* Y, int64_t ldy);
void matmul_f32_avx2(const float* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                     int64_t ldx, float* Y, int64_t ldy);
// matmul_avx512.cpp (AVX-512 F/BW/VL/DQ):
void matmul_bf16_avx512(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                        int64_t ldx, float* Y, int64_t ldy);
void matmul_f32_avx512(const float* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                       int64_t ldx, float* Y, int64_t ldy);
// matmul_avx512bf16.cpp (+ AVX-512 BF16), for bf16-valued X only:
void matmul_bf16_avx512bf16(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                            int64_t ldx, float* Y, int64_t ldy);
}  // namespace detail

}  // namespace md::cpu
