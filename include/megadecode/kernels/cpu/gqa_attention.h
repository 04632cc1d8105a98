// Softmax attention with grouped KV heads (GQA) for one query row over explicit key/value rows,
// as the eager attention of transformers computes it: scores in fp32, scaled, softmax in fp32,
// probabilities (optionally) rounded to bf16, then the fp32 weighted sum of the values. Kimi's
// own attention is MLA (kernels/cpu/mla.h); the speculative draft (spec/) is the user.
#pragma once
#include <cstdint>
#include <span>

namespace md::cpu {

// Key/value rows of one segment: row j of the segment is k + idx(j) * ld (and v likewise), with
// idx(j) = rows[j], or j when rows is null. Each row holds Hkv heads of head_dim values.
struct KvSegment {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t ld = 0;
  const int32_t* rows = nullptr;
  int64_t n = 0;
};

// out[h][d] for query heads h in [h0, h1) of q [H][head_dim]: head h reads KV head
// h / (H / Hkv). Scores over the segments' rows in order, times `scale`; softmax in fp32 (max
// subtracted); with round_probs each probability is rounded to bf16 before the value sum. With no
// row at all the output is zero. The caller rounds `out` where its reference does.
void gqa_attend(const float* q, int H, int Hkv, int head_dim, int h0, int h1,
                std::span<const KvSegment> segments, float scale, bool round_probs, float* out);

}  // namespace md::cpu
