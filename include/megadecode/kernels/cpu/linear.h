// The one entry from a weight matrix of any format to its kernel: bf16 / fp32 values
// (matmul.h), MXFP4 (mxfp4.h), int4 (int4.h), int8 (int8.h) or FP8 (fp8.h) codes. The reference path (engine/model.cpp) and
// the plan's CPU tiles (exec/cpu/tiles.cpp) both call it, so a format is added in one place.
#pragma once
#include <cstddef>
#include <cstdint>

#include "megadecode/base/dtype.h"

namespace md::cpu {

struct LinearWeights {
  const void* data = nullptr;       // row 0 of the values or codes
  const uint8_t* scales = nullptr;  // row 0 of the scales (quantized formats)
  DType dtype = DType::BF16;        // BF16 or F32 values; U8 for codes
  WeightQuant quant = WeightQuant::kNone;
  int64_t cols = 0;
  int32_t group = 0;  // int4 / int8 / FP8: columns per scale
  uint8_t int_act_bits = 0;  // int4 / int8 / MXFP4: 8 (W4A8 / W8A8) or 16 (qdot.h); 0: off
  // int4 with zero points (asymmetric): row 0 of z = zc - 8, int8 [rows, cols / group] (int4.h,
  // int4_zero_point_terms).
  const int8_t* zero_points = nullptr;
  // Activation-ordered columns (model/weights.h Mat::col_perm): stored column j multiplies
  // X[col_perm[j]]; the call gathers each vector in that order first.
  const int32_t* col_perm = nullptr;
};

// Y[b * ldy + r] = sum_k W[r][k] * X[b * ldx + k]  for r in [r0, r1), b in [0, B), with each
// format's numerics (one fixed fp32 sequence per output: row splits and batches do not change
// results), int4 / int8 / MXFP4 with int_act_bits those of qdot.h. x_is_bf16 as in matmul_bf16.
// Every call is a StreamCall (stream_hint.h) over its rows' stored bytes.
void linear_rows(const LinearWeights& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
                 float* Y, int64_t ldy, bool x_is_bf16);

// Bytes of one row's values or codes as stored (the scales, a few percent more, apart): two
// 4-bit codes a byte (int4, MXFP4), one a byte (int8, FP8), the value type's size otherwise.
size_t stored_row_bytes(WeightQuant quant, DType dtype, int64_t cols);

}  // namespace md::cpu
