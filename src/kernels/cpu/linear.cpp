// Format dispatch of linear_rows (linear.h).
#include "megadecode/kernels/cpu/linear.h"

#include <vector>

#include "megadecode/kernels/cpu/fp8.h"
#include "megadecode/kernels/cpu/int4.h"
#include "megadecode/kernels/cpu/int8.h"
#include "megadecode/kernels/cpu/matmul.h"
#include "megadecode/kernels/cpu/mxfp4.h"
#include "megadecode/kernels/cpu/qdot.h"
#include "megadecode/kernels/cpu/stream_hint.h"

namespace md::cpu {

size_t stored_row_bytes(WeightQuant quant, DType dtype, int64_t cols) {
  switch (quant) {
    case WeightQuant::kMxfp4:
    case WeightQuant::kInt4:
      return size_t(cols) / 2;
    case WeightQuant::kInt8:
    case WeightQuant::kFp8:
      return size_t(cols);
    case WeightQuant::kNone:
      break;
  }
  return size_t(cols) * dtype_size(dtype);
}

namespace {

// Asymmetric int4: the zero points' terms after the symmetric product (int4.h). They use the
// vectors as given (fp32), with int8 activations too: only the q * scale part is W4A8.
void add_zero_point_terms(const LinearWeights& w, int64_t r0, int64_t r1, const float* X, int B,
                          int64_t ldx, float* Y, int64_t ldy) {
  if (!w.zero_points) return;
  int4_zero_point_terms(reinterpret_cast<const bf16*>(w.scales), w.zero_points, w.cols, w.group, r0,
                        r1, X, B, ldx, Y, ldy);
}

}  // namespace

void linear_rows(const LinearWeights& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
                 float* Y, int64_t ldy, bool x_is_bf16) {
  if (w.col_perm) {
    // Activation order: the vectors in the stored columns' order, then the plain layout's path.
    thread_local std::vector<float> xp;
    xp.resize(size_t(B) * size_t(w.cols));
    for (int b = 0; b < B; ++b)
      for (int64_t j = 0; j < w.cols; ++j)
        xp[size_t(b) * size_t(w.cols) + size_t(j)] = X[b * ldx + w.col_perm[j]];
    LinearWeights plain = w;
    plain.col_perm = nullptr;
    return linear_rows(plain, r0, r1, xp.data(), B, w.cols, Y, ldy, x_is_bf16);
  }
  const size_t rb = stored_row_bytes(w.quant, w.dtype, w.cols);
  const char* base = static_cast<const char*>(w.data);
  const StreamCall call(base + size_t(r0) * rb, base + size_t(r1) * rb);
  switch (w.quant) {
    case WeightQuant::kMxfp4:
      if (w.int_act_bits) break;
      matmul_mxfp4(static_cast<const uint8_t*>(w.data), w.scales, w.cols, r0, r1, X, B, ldx, Y, ldy,
                   x_is_bf16);
      return;
    case WeightQuant::kInt4:
      if (w.int_act_bits) break;
      matmul_int4(static_cast<const uint8_t*>(w.data), reinterpret_cast<const bf16*>(w.scales),
                  w.cols, w.group, r0, r1, X, B, ldx, Y, ldy);
      add_zero_point_terms(w, r0, r1, X, B, ldx, Y, ldy);
      return;
    case WeightQuant::kInt8:
      if (w.int_act_bits) break;
      matmul_int8(static_cast<const uint8_t*>(w.data), reinterpret_cast<const bf16*>(w.scales),
                  w.cols, w.group, r0, r1, X, B, ldx, Y, ldy);
      return;
    case WeightQuant::kFp8:
      matmul_fp8(static_cast<const uint8_t*>(w.data), reinterpret_cast<const float*>(w.scales),
                 w.cols, w.group, r0, r1, X, B, ldx, Y, ldy);
      return;
    case WeightQuant::kNone:
      break;
  }
  if (w.int_act_bits) {
    QdotWeights q;
    q.codes = static_cast<const uint8_t*>(w.data);
    q.scales = w.scales;
    q.K = w.cols;
    q.group = w.quant == WeightQuant::kMxfp4 ? 32 : w.group;
    q.kind = w.quant == WeightQuant::kInt4   ? QdotCodes::kInt4
             : w.quant == WeightQuant::kInt8 ? QdotCodes::kInt8
                                             : QdotCodes::kMxfp4;
    q.acts = w.int_act_bits == 16 ? QdotActs::kInt16 : QdotActs::kInt8;
    matmul_qdot(q, r0, r1, X, B, ldx, Y, ldy);
    add_zero_point_terms(w, r0, r1, X, B, ldx, Y, ldy);
    return;
  }
  if (w.dtype == DType::F32) {
    matmul_f32(static_cast<const float*>(w.data), w.cols, r0, r1, X, B, ldx, Y, ldy);
  } else {
    matmul_bf16(static_cast<const bf16*>(w.data), w.cols, r0, r1, X, B, ldx, Y, ldy, x_is_bf16);
  }
}

}  // namespace md::cpu
