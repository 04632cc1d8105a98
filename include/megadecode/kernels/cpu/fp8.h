// Matrix-vector / matrix-matrix products against FP8 e4m3 weights with group-wise fp32 scales
// (W8A16: DeepSeek-style `fp8` checkpoints with 128 x 128 block scales, compressed-tensors
// `float-quantized` with channel, block or tensor scales; the loader expands any of them to one
// scale per row and group of columns), decoded on the fly.
//
// Format, for a weight of N rows and K columns and a group size g (a multiple of 32 dividing K):
//  * values uint8 [N, K]: e4m3 ("float8_e4m3fn": sign, 4 exponent bits with bias 7, 3 mantissa
//    bits; no infinities; 0x7f and 0xff are NaN, which loaders reject).
//  * scales fp32 [N, K/g]. W[r][k] = e4m3(values[r][k]) * scale[r][k / g].
#pragma once
#include <cstdint>

namespace md::cpu {

// Y[b * ldy + r] = sum_k W[r][k] * X[b * ldx + k]   for r in [r0, r1), b in [0, B). Pointers at
// row 0. The int8 kernels' tiling and numerics (int8.h): per 32-column sub-group a short run of
// fp32 products of the unscaled values and the activations, scaled once per run. The SIMD paths
// decode e4m3 through fp16 (the byte's fields moved into fp16 positions is the value / 256,
// widened exactly by vcvtph2ps; the 256 goes into the scale, exactly), so every product is the
// same as with the value itself. Row splits, batches and threads give identical bits; ISAs agree
// within the fp32 accumulation bound.
void matmul_fp8(const uint8_t* values, const float* scales, int64_t K, int group, int64_t r0,
                int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy);

// The exact value of an e4m3 byte (NaN for 0x7f and 0xff).
float fp8_e4m3_value(uint8_t b);

// Row of K decoded values (tests and reference code only).
void dequantize_fp8_row(const uint8_t* values, const float* scales, int64_t K, int group,
                        float* out);

// Index of the first NaN byte (0x7f or 0xff) among n, or -1.
int64_t fp8_find_nan(const uint8_t* values, int64_t n);

// Which implementation matmul_fp8 uses at the active ISA level ("avx512", "avx2", "portable").
const char* matmul_fp8_isa();

}  // namespace md::cpu
