// Matrix-vector / matrix-matrix products against MXFP4 weights (Kimi K3's routed experts), decoded
// on the fly from the packed codes and scales: no matrix is ever dequantised into memory.
//
// Format (compressed-tensors "mxfp4-pack-quantized", group 32), for a weight of N rows and K
// columns:
//  * packed uint8 [N, K/2]: two e2m1 codes per byte, the low nibble is column 2j, the high nibble
//    column 2j+1. Code bits: bit 3 = sign, bits 0..2 = magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6.
//  * scales uint8 [N, K/32]: E8M0, one per group of 32 consecutive columns of a row, value
//    2^(s - 127). s = 255 is NaN (OCP MX spec).
//  * K must be a positive multiple of 32 (rows are whole groups). Row r starts at packed + r * K/2
//    and scales + r * K/32; the functions below take the matrix base pointers.
#pragma once
#include <cstdint>

namespace md::cpu {

// Y[b * ldy + r] = sum_k W[r][k] * X[b * ldx + k]   for r in [r0, r1), b in [0, B).
// packed/scales point at row 0 of the matrix (not at row r0). x_is_bf16 has the meaning of
// matmul_bf16: the caller promises every X value is exactly representable in bf16, which would let
// a kernel use vdpbf16ps (every decoded code is bf16-exact); the current kernels do not need it
// and treat both modes alike. Accumulation is fp32.
void matmul_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t r0, int64_t r1,
                  const float* X, int B, int64_t ldx, float* Y, int64_t ldy, bool x_is_bf16);

// One decoded element: e2m1(code & 15) * 2^(scale - 127), correctly rounded to fp32. That is exact
// for every code when scale <= 252 (the smallest nonzero value, 0.5 * 2^-127, is an fp32
// subnormal); for scale 253 or 254 large magnitudes overflow to +-inf, as the exact value would
// round; scale 255 gives NaN.
float mxfp4_value(uint8_t code, uint8_t scale);

// Row of K decoded values (K a multiple of 32), for tests and reference code only.
void dequantize_mxfp4_row(const uint8_t* packed, const uint8_t* scales, int64_t K, float* out);

// Quantizes one row of K bf16 weights (K a multiple of 32) to MXFP4 as compressed-tensors does
// (mxfp4_utils.generate_mxfp4_scales and FP4_E2M1_DATA.cast_to_fp4): per group of 32, the largest
// magnitude m is rounded to a power of two 2^e by adding 1 << 5 to its bf16 bits and dropping the
// mantissa (so 1.75 * 2^k and up round to 2^(k+1)), the scale byte is e + 127 - 2 (clamped to
// 0..254; an all-zero group gets 0), and each w / 2^(scale - 127) (exact) is rounded to the
// nearest e2m1 magnitude with ties to the even code (|v| > 5 saturates at 6); a zero magnitude is
// code 0. Writes K/2 packed bytes and K/32 scale bytes.
void quantize_mxfp4_row(const uint16_t* w, int64_t K, uint8_t* packed, uint8_t* scales);

// Index of the first NaN scale (255) among n scale bytes, or -1 if there is none. Loaders call this
// to reject such checkpoints with a clear error; the kernels themselves propagate NaN (a row with a
// 255 scale in any group produces NaN for every vector), they never trap.
int64_t mxfp4_find_nan_scale(const uint8_t* scales, int64_t n);

// Which implementation matmul_mxfp4 uses at the active ISA level (cpu_features.h): "avx512" (at the
// avx512 and avx512bf16 levels), "avx2" or "portable".
const char* matmul_mxfp4_isa();

// Numerics (the same contract as matmul_bf16):
//  * Each group of 32 is reduced first, in short runs per lane: r = sum of some of the group's
//    e2m1(code) * x products (fp32; the unscaled code values are exact in bf16 and fp32), then the
//    group's scale is applied once per run, acc += r * 2^(s - 127) (exact multiply unless it
//    under- or overflows). So scales far outside bf16's exponent range never touch the products.
//    (Portable: runs of 4 products, 8 lanes. AVX-512: runs of 8 products, 16 lanes, each lane
//    covering 8 columns of one group in a chunk of 4 groups; see q4_avx512.cpp. AVX2: the same
//    with 8 lanes and chunks of 2 groups; see q4_avx2.cpp. The kernels are shared with int4,
//    int4.h.)
//  * Y[b, r] is one fixed sequence of fp32 operations that depends only on row r, vector b and K:
//    not on [r0, r1), B, other rows or vectors, or the thread. Splitting rows or batching gives
//    bit-identical results (unit-tested).
//  * ISAs differ in lane count and FMA, so they agree within the fp32 accumulation bound, not
//    bitwise. The AVX2 and AVX-512 kernels use fp32 FMAs for both X modes (vdpbf16ps was measured
//    slower on this CPU, see below), so there x_is_bf16 true and false give identical results.
//
// Performance (Xeon "model 207" under KVM, 2 vCPUs shared with other jobs, load average ~9-13, so
// wall time is ~2x CPU time; 3072 x 3584 GEMV, weights cycled through a 1 GiB pool, median of 3;
// see bench/bench_kernels.cpp K3ExpertMxfp4), old kernel vs this one in the same session, one
// thread, B = 1: 3072 x 3584 1.75 -> 1.34-1.55 ms wall (1.15 -> 0.89-0.93 ms CPU): 6.3 -> 7-8 G
// weights/s wall, 9.6 -> 11.8-12.3 G weights/s (5.1 -> 6.3-6.5 GB/s packed) per CPU-second; 3584 x
// 3072 9.1 -> 11.2-12.0 G weights/s per CPU-second; B = 4 3.0 -> 2.0-2.3 ms CPU; B = 8 2.9-3.5 ms
// CPU (~3.1-3.8 G weights/s, ~25 G MAC/s, compute bound like the bf16 GEMV at B = 8). The bf16 GEMV
// streamed ~7.5-9 GB/s in the same runs (read bandwidth ~8-9 GB/s), so MXFP4 at 4.25 bits is still
// below DRAM rate per CPU-second on this loaded host, though faster per weight than bf16.
// The decode is one shift + one vpermps per 16 weights straight from the packed cache line (no
// widening), the scale one vpermps + one FMA per 128 weights; in L2 the kernel runs at ~15-24 G
// weights/s per CPU-second at B = 1. vdpbf16ps sustains one per ~2.3 cycles here (two fp32 FMAs
// per cycle), which made a bf16 variant no faster at B = 1 and ~1.5x slower at B = 4..8.

}  // namespace md::cpu
