// Kimi K3's block attention residuals: the input of each attention, each FFN and the final norm
// is a learned softmax mix over depth of "sources" (the completed block summaries and the current
// block's partial sum), not the plain residual stream. See ModelConfig::attn_res_block_size and
// the bookkeeping in engine/model.cpp.
#pragma once
#include <cstdint>

namespace md::cpu {

// out[d] = sum_j p_j * src_j[d], with p = softmax_j(score_j) and
//   score_j = (sum_d src_j[d] * w[d]) * rsqrt(mean_d(src_j[d]^2) + eps),
// i.e. w . RMSNorm(src_j) with the norm's weight folded into w (w = res_norm.weight *
// res_proj.weight). The raw sources are mixed, not their normalised values. Statistics, scores,
// softmax and the mix are computed in double (the official code uses fp32 throughout), so the
// result is within a few fp32 ulps of the exact value; with round_bf16 it is then rounded to bf16
// (the official bf16 model casts the mix back to the activation dtype). S >= 1 sources of D values.
void attn_res_mix(const float* const* sources, int S, const float* w, int64_t D, float eps,
                  float* out, bool round_bf16);

}  // namespace md::cpu
