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
// matmul_bf16: the caller promises every X value is exactly representable in bf16, which lets the
// AVX-512 BF16 path use vdpbf16ps (every decoded code is bf16-exact). Accumulation is fp32.
void matmul_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t r0, int64_t r1,
                  const float* X, int B, int64_t ldx, float* Y, int64_t ldy, bool x_is_bf16);

// One decoded element: e2m1(code & 15) * 2^(scale - 127), correctly rounded to fp32. That is exact
// for every code when scale <= 252 (the smallest nonzero value, 0.5 * 2^-127, is an fp32
// subnormal); for scale 253 or 254 large magnitudes overflow to +-inf, as the exact value would
// round; scale 255 gives NaN.
float mxfp4_value(uint8_t code, uint8_t scale);

// Row of K decoded values (K a multiple of 32), for tests and reference code only.
void dequantize_mxfp4_row(const uint8_t* packed, const uint8_t* scales, int64_t K, float* out);

// Index of the first NaN scale (255) among n scale bytes, or -1 if there is none. Loaders call this
// to reject such checkpoints with a clear error; the kernels themselves propagate NaN (a row with a
// 255 scale in any group produces NaN for every vector), they never trap.
int64_t mxfp4_find_nan_scale(const uint8_t* scales, int64_t n);

// Which implementation matmul_mxfp4 uses: "avx512bf16", "avx512" or "portable". It follows the
// matmul selection (matmul.h): MEGADECODE_ISA and set_matmul_isa / set_matmul_isa_portable switch
// both kernels together.
const char* matmul_mxfp4_isa();

// Numerics (the same contract as matmul_bf16):
//  * Each group of 32 is reduced first: g = sum over the group of e2m1(code) * x (fp32, the
//    unscaled code values are exact in bf16 and fp32), then the group's scale is applied once,
//    acc += g * 2^(s - 127) (exact multiply unless it under- or overflows). So scales far outside
//    bf16's exponent range never touch the bf16 dot products.
//  * Y[b, r] is one fixed sequence of fp32 operations that depends only on row r, vector b and K:
//    not on [r0, r1), B, other rows or vectors, or the thread. Splitting rows or batching gives
//    bit-identical results (unit-tested).
//  * ISAs differ in lane count, FMA and vdpbf16ps, so they agree within the fp32 accumulation
//  bound,
//    not bitwise; likewise x_is_bf16 true vs false on the avx512bf16 path.
//  * vdpbf16ps treats denormal X as zero and flushes denormal partial sums (contrived inputs only).
//
// Performance (Xeon "model 207" under KVM, one thread, 3072 x 3584 GEMV from DRAM, machine heavily
// loaded so CPU time ~ half of wall): ~2.1-2.9 GB/s of packed bytes, i.e. ~5-6 G weights/s, vs
// ~3.6 G weights/s (7 GB/s) for the bf16 GEMV in the same run. The decode (byte widen + nibble
// permute, ~6-7 uops per group of 32 per row) makes it compute bound well below DRAM rate; the
// fp32-FMA variant (x_is_bf16 = false) measured ~15% faster than vdpbf16ps.

namespace detail {
// AVX-512 entry points (mxfp4_avx512.cpp); call only after checking the CPU. The bf16 variant needs
// AVX512_BF16 and is only used when x_is_bf16; otherwise both use fp32 FMAs.
void matmul_mxfp4_avx512bf16(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t r0,
                             int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy,
                             bool x_is_bf16);
void matmul_mxfp4_avx512(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t r0,
                         int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy);
// The fp32 value of each scale byte (2^(s-127), NaN for 255); shared by every path.
extern const float kMxfp4ScaleTable[256];
}  // namespace detail

}  // namespace md::cpu
