// Integer dot-product matmul: int4, int8 or MXFP4 weights (int4.h, int8.h, mxfp4.h: the same codes
// and scales) times activations quantized to int8 (W4A8 / W8A8), the scheme llama.cpp's CPU kernels
// use for every quantized type (its Q8_0 / Q8_K activations), or to int16. Opt-in (--act-quant
// int8 | int16, docs/quantization.md): it adds the activations' rounding error to the weights', and
// in exchange the products become integer dot products (AVX-512 VNNI vpdpbusd: 64 multiply-adds
// per instruction; AVX2 vpmaddubsw + vpmaddwd: 32), which takes the 4- and 8-bit GEMVs from
// compute-bound towards memory-bound.
//
// int16 activations keep the same byte-wise dot products: t (|t| <= 32385 = 127 x 255) is split
// as t = 255 h + l with h = round(t / 255) and l = t - 255 h, both in [-127, 127], so each is a
// signed byte; the kernels form the two byte dot products and combine them exactly in int32
// (255 H + L). Twice the multiply-adds of int8, and a rounding 256 times finer (d = a / 32385):
// at most 1/64770 of the sub-group's largest magnitude, ~100x below bf16's own rounding of the
// large values that dominate a dot product.
//
// Numerics, for a weight row r (integers q_k, scale s_g of group g) and a vector x. MXFP4's e2m1
// values are half-integers: q_k is twice the value and s_g half the E8M0 scale (both exact).
//  * x is quantized per 32-column sub-group j: a_j = max |x_k| over the sub-group,
//    d_j = a_j / T (fp32), and t_k = clamp(round-half-even(x_k / d_j), -T, T) (all zero when
//    a_j is 0), with T = 127 (int8) or 32385 (int16). quantize_activations_int8 / _int16 are this
//    definition, and every path computes it exactly (IEEE division and rounding), so all ISAs see
//    the same t and d.
//  * Each path forms exact int32 partial dot products of q and t over a fixed set of columns of one
//    sub-group (AVX-512 and AVX2: 8 columns for int4 / MXFP4, 4 for int8; portable: the whole
//    sub-group), converts each to fp32 (exact: |partial| < 2^24, even for int16 activations,
//    4 x 128 x 32385 < 2^24; the portable path's whole int8 x int16 sub-group may round once
//    there), multiplies it by d_j (one
//    rounding) and adds it times s_g into a fp32 lane accumulator (an fma; the portable path a
//    multiply and an add), then reduces the lanes in a fixed order. So Y[b, r] is one fixed
//    sequence of fp32 operations that depends only on row r, vector b, K and g: splitting rows,
//    batching and threads give bit-identical results; ISAs agree within the fp32 accumulation
//    bound.
#pragma once
#include <cstdint>

#include "megadecode/base/bf16.h"

namespace md::cpu {

enum class QdotCodes : uint8_t {
  kInt4,   // int4.h: packed nibbles c (q = c - 8), bf16 scales per group
  kInt8,   // int8.h: codes c (q = c - 128), bf16 scales per group
  kMxfp4,  // mxfp4.h: packed e2m1 nibbles, one E8M0 scale byte per 32 columns (group 32)
};

// The activations' integer format (a property of the call, carried in QdotWeights).
enum class QdotActs : uint8_t { kInt8, kInt16 };

struct QdotWeights {
  const uint8_t* codes = nullptr;   // row 0: packed [N, K/2] (int4, MXFP4) or [N, K] (int8)
  const uint8_t* scales = nullptr;  // row 0: bf16 [N, K/group] as bytes, or E8M0 [N, K/32]
  int64_t K = 0;                    // a positive multiple of 32
  int group = 32;                   // a multiple of 32 dividing K (MXFP4: 32)
  QdotCodes kind = QdotCodes::kInt4;
  QdotActs acts = QdotActs::kInt8;  // the vector's quantization for this call
  int64_t code_row_bytes() const { return kind == QdotCodes::kInt8 ? K : K / 2; }
  int64_t scale_row_bytes() const { return kind == QdotCodes::kMxfp4 ? K / 32 : K / group * 2; }
};

// Y[b * ldy + r] = sum_k W[r][k] * X[b * ldx + k] with X quantized as above, for r in [r0, r1),
// b in [0, B). codes/scales point at row 0 of the matrix.
void matmul_qdot(const QdotWeights& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
                 float* Y, int64_t ldy);

// The activation quantization of one vector of K values (K a multiple of 32): K codes t and K/32
// scales d, as defined above.
void quantize_activations_int8(const float* x, int64_t K, int8_t* t, float* d);
void quantize_activations_int16(const float* x, int64_t K, int16_t* t, float* d);

// int16 activations' largest code, and the split each SIMD kernel uses: t = 255 h + l.
inline constexpr int kQdotInt16Max = 32385;

// Which implementation matmul_qdot uses at the active ISA level: "avx512vnni" (the avx512bf16
// level, which includes VNNI), "avx2" (vpmaddubsw; the avx2 and avx512 levels) or "portable".
const char* matmul_qdot_isa();

}  // namespace md::cpu
