#include "megadecode/kernels/cpu/gqa_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "megadecode/base/bf16.h"

namespace md::cpu {

void gqa_attend(const float* q, int H, int Hkv, int head_dim, int h0, int h1,
                std::span<const KvSegment> segments, float scale, bool round_probs, float* out) {
  const int groups = H / Hkv;
  int64_t total = 0;
  for (const KvSegment& s : segments) total += s.n;
  // One score per row and head; a draft step attends over at most its window plus a block.
  thread_local std::vector<float> p;
  p.resize(size_t(total));
  for (int h = h0; h < h1; ++h) {
    const float* qh = q + int64_t(h) * head_dim;
    const int64_t kv_off = int64_t(h / groups) * head_dim;
    float* oh = out + int64_t(h) * head_dim;
    for (int d = 0; d < head_dim; ++d) oh[d] = 0;
    if (total == 0) continue;
    int64_t t = 0;
    float mx = -INFINITY;
    for (const KvSegment& s : segments)
      for (int64_t j = 0; j < s.n; ++j, ++t) {
        const float* k = s.k + (s.rows ? s.rows[j] : j) * s.ld + kv_off;
        float acc = 0;
        for (int d = 0; d < head_dim; ++d) acc += qh[d] * k[d];
        p[size_t(t)] = acc * scale;
        mx = std::max(mx, p[size_t(t)]);
      }
    float sum = 0;
    for (int64_t i = 0; i < total; ++i) sum += (p[size_t(i)] = std::exp(p[size_t(i)] - mx));
    const float inv = 1.0f / sum;
    t = 0;
    for (const KvSegment& s : segments)
      for (int64_t j = 0; j < s.n; ++j, ++t) {
        float w = p[size_t(t)] * inv;
        if (round_probs) w = round_bf16(w);
        const float* v = s.v + (s.rows ? s.rows[j] : j) * s.ld + kv_off;
        for (int d = 0; d < head_dim; ++d) oh[d] += w * v[d];
      }
  }
}

}  // namespace md::cpu
