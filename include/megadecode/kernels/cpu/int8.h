// Matrix-vector / matrix-matrix products against int8 weights with group-wise bf16 scales (W8A16,
// compressed-tensors "pack-quantized" with num_bits 8, symmetric), decoded on the fly from the
// codes: no matrix is ever dequantised into memory.
//
// Format, for a weight of N rows and K columns and a group size g (a multiple of 32 dividing K):
//  * codes uint8 [N, K]: code c holds the integer q = c - 128 in [-128, 127] (compressed-tensors'
//    pack_to_int32 adds 2^(bits-1) and packs four codes an int32 from the least significant
//    byte, so its int32 weight_packed [N, K/4] is this byte array on a little-endian machine).
//  * scales bf16 [N, K/g]: one per group of g consecutive columns of a row. W[r][k] =
//    q * scale[r][k / g].
#pragma once
#include <cstdint>

#include "megadecode/base/bf16.h"

namespace md::cpu {

// Y[b * ldy + r] = sum_k W[r][k] * X[b * ldx + k]   for r in [r0, r1), b in [0, B).
// codes/scales point at row 0 of the matrix (not at row r0). Accumulation is fp32.
//
// Numerics (the 4-bit kernels' contract, mxfp4.h "Numerics"): each 32-column sub-group of a row is
// reduced in short runs of fp32 products of unscaled integers q and activations (q * x is exact in
// fp32 when x is a bf16 value: 8 + 8 significant bits), and the run is multiplied by its group's scale once
// (an fma into the accumulator; the portable path a multiply and an add). Portable: 8 lanes, runs
// of 4 products. AVX2: 8 lanes, runs of 4 (columns 8s + l, s = 0..3). AVX-512: 16 lanes, runs of
// 2 (columns 16s + l). Then a fixed pairwise reduction of the lanes. So Y[b, r] is one fixed sequence of fp32
// operations that depends only on row r, vector b, K and g: splitting rows, batching and threads
// give bit-identical results; ISAs agree within the fp32 accumulation bound.
void matmul_int8(const uint8_t* codes, const bf16* scales, int64_t K, int group, int64_t r0,
                 int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy);

// Row of K decoded values (tests and reference code only).
void dequantize_int8_row(const uint8_t* codes, const bf16* scales, int64_t K, int group,
                         float* out);

// Quantizes one row of K bf16 weights the way compressed-tensors' min-max observer does for
// symmetric int8 (num_bits 8, strategy group or channel): per group, scale = max|w| / 127.5 (the
// half range of [-128, 127]) rounded to bf16 and at least fp32 epsilon, then q = clamp(round-half-
// even(w / scale), -128, 127). Writes K codes (q + 128) and K/group scales.
void quantize_int8_row(const bf16* w, int64_t K, int group, uint8_t* codes, bf16* scales);

// Which implementation matmul_int8 uses at the active ISA level: "avx512" (the avx512 and
// avx512bf16 levels), "avx2" or "portable".
const char* matmul_int8_isa();

}  // namespace md::cpu
