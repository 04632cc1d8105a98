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

// A third path exists for AVX-512 CPUs without BF16 ("avx512": fp32 FMA for both X modes), and
// MEGADECODE_ISA=avx512 selects it on BF16 machines too. set_matmul_isa picks a path by name
// ("portable", "avx512", "avx512bf16", or "auto" for the best the CPU supports) and returns false,
// changing nothing, when the CPU lacks it. set_matmul_isa_portable(false) means "auto". Not meant
// to be called while other threads run matmuls.
bool set_matmul_isa(const char* name);

namespace detail {
// The AVX-512 entry points (matmul_avx512.cpp); only call them after checking the CPU.
void matmul_bf16_avx512bf16(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                            int64_t ldx, float* Y, int64_t ldy, bool x_is_bf16);
void matmul_bf16_avx512(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                        int64_t ldx, float* Y, int64_t ldy);
void matmul_f32_avx512(const float* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                       int64_t ldx, float* Y, int64_t ldy);
}  // namespace detail

}  // namespace md::cpu
