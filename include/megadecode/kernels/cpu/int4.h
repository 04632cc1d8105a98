// Matrix-vector / matrix-matrix products against int4 weights with group-wise bf16 scales (W4A16,
// the compressed-tensors "pack-quantized" int4 format, symmetric or with zero points), decoded on
// the fly from the packed codes: no matrix is ever dequantised into memory. These share their
// kernels with MXFP4 (mxfp4.h; src/kernels/cpu/q4_kernels.h): only the code table and the scales
// differ.
//
// Format, for a weight of N rows and K columns and a group size g (a multiple of 32 dividing K):
//  * packed uint8 [N, K/2]: two codes per byte, the low nibble is column 2j, the high nibble
//    column 2j+1 (compressed-tensors' int32 weight_packed [N, K/8], eight codes per int32 from
//    the least significant nibble, is this byte array on a little-endian machine). Code c holds
//    the integer q = c - 8 in [-8, 7].
//  * scales bf16 [N, K/g]: one per group of g consecutive columns of a row. W[r][k] =
//    q * scale[r][k / g].
#pragma once
#include <cstdint>

#include "megadecode/base/bf16.h"

namespace md::cpu {

// Y[b * ldy + r] = sum_k W[r][k] * X[b * ldx + k]   for r in [r0, r1), b in [0, B).
// packed/scales point at row 0 of the matrix (not at row r0). Accumulation is fp32. The numerics
// are those of matmul_mxfp4 (mxfp4.h, "Numerics"): each 32-column run's sum of unscaled q * x
// products is multiplied by its group's scale once per run (an fma into the accumulator: one
// rounding), so Y[b, r] is one fixed sequence of fp32 operations that depends only on row r,
// vector b, K and g: splitting rows, batching and threads give bit-identical results; ISAs agree
// within the fp32 accumulation bound.
void matmul_int4(const uint8_t* packed, const bf16* scales, int64_t K, int group, int64_t r0,
                 int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy);

// Asymmetric int4 (compressed-tensors `symmetric: false`, the AWQ layout): W[r][k] =
// (c - zc) * scale = q * scale - z * scale with q = c - 8 as above and z = zc - 8 the group's zero
// point offset, int8 [N, K/g] in [-8, 7]. matmul_int4 (or the W4A8 matmul_qdot) computes the
// first term; this subtracts the second from Y for rows [r0, r1):
//   Y[b * ldy + r] -= sum_g (scale[r][g] * z[r][g]) * xs[b][g],   xs[b][g] = sum_{k in g} X[b][k].
// Each scale * z is exact in fp32 (8 + 4 significant bits); xs is summed in 16 lanes (lane k % 16)
// and a fixed tree, then the groups' terms in 16 lanes (lane g % 16) and the same tree: a fixed
// sequence per row and vector, so row splits and batches give the same bits. AVX-512 and AVX2
// fuse each lane's multiply-add (one rounding), the portable path rounds twice.
void int4_zero_point_terms(const bf16* scales, const int8_t* z, int64_t K, int group, int64_t r0,
                           int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy);

// Asymmetric int4 as int8 codes (int8.h's format, the same scales): out[r][k] = (c - 8) - z + 128,
// exactly (c - zc in [-15, 15]); for backends without the zero-point terms (the CUDA executors).
void int4_zero_points_to_int8_codes(const uint8_t* packed, const int8_t* z, int64_t rows, int64_t K,
                                    int group, uint8_t* out);

// Row of K decoded values (tests and reference code only): (c - 8 - z) * scale, with z the
// row's zero points (int8 [K/group], as Mat::zero_points holds them) or 0 when null.
void dequantize_int4_row(const uint8_t* packed, const bf16* scales, int64_t K, int group,
                         float* out, const int8_t* zero_points = nullptr);

// Quantizes one row of K bf16 weights the way compressed-tensors' min-max observer does
// (num_bits 4, strategy group; calculate_qparams), per group with lo = min(w, 0), hi = max(w, 0):
//  * symmetric (zero_points null): scale = max(-lo, hi) / 7.5 (the half range of [-8, 7]);
//  * asymmetric: scale = (hi - lo) / 15, and the group's zero point
//    z = clamp(round-half-even(-8 - lo / scale), -8, 7), written to zero_points[K/group];
// the scale rounded to bf16 and at least fp32 epsilon, then
// q = round-half-even(clamp(w / scale + z, -8, 7)) (z = 0 when symmetric), so w ~ (q - z) * scale.
// Writes K/2 packed bytes (code q + 8) and K/group scales.
void quantize_int4_row(const bf16* w, int64_t K, int group, uint8_t* packed, bf16* scales,
                       int8_t* zero_points = nullptr);

// Which implementation matmul_int4 uses at the active ISA level (the MXFP4 one: "avx512",
// "avx2" or "portable").
const char* matmul_int4_isa();

}  // namespace md::cpu
