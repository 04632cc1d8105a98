#include "megadecode/kernels/cpu/attn_res.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "megadecode/base/bf16.h"

namespace md::cpu {

void attn_res_mix(const float* const* src, int S, const float* w, int64_t D, float eps, float* out,
                  bool round) {
  std::vector<double> p(static_cast<size_t>(S));
  double best = -INFINITY;
  for (int j = 0; j < S; ++j) {
    double ss = 0, dot = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double v = src[j][d];
      ss += v * v;
      dot += v * double(w[d]);
    }
    p[j] = dot / std::sqrt(ss / double(D) + double(eps));
    best = std::max(best, p[j]);
  }
  double sum = 0;
  for (int j = 0; j < S; ++j) sum += (p[j] = std::exp(p[j] - best));
  for (int j = 0; j < S; ++j) p[j] /= sum;
  for (int64_t d = 0; d < D; ++d) {
    double acc = 0;
    for (int j = 0; j < S; ++j) acc += p[j] * double(src[j][d]);
    out[d] = round ? round_bf16(float(acc)) : float(acc);
  }
}

}  // namespace md::cpu
