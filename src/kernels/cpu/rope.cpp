#include "megadecode/kernels/cpu/rope.h"

#include <cmath>
#include <vector>

#include "megadecode/base/bf16.h"

namespace md::cpu {

void rope_neox(float* x, int heads, int head_dim, int64_t position, double theta, bool rnd) {
  const int half = head_dim / 2;
  // Small per call (head_dim / 2 entries), so a local table; the draft calls this once per row.
  std::vector<float> cs(size_t(2 * half));
  for (int i = 0; i < half; ++i) {
    const double angle = double(position) * std::pow(theta, -2.0 * i / head_dim);
    float c = float(std::cos(angle)), s = float(std::sin(angle));
    if (rnd) c = round_bf16(c), s = round_bf16(s);
    cs[size_t(i)] = c;
    cs[size_t(half + i)] = s;
  }
  auto r = [&](float v) { return rnd ? round_bf16(v) : v; };
  for (int h = 0; h < heads; ++h) {
    float* v = x + int64_t(h) * head_dim;
    for (int i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half], c = cs[size_t(i)], s = cs[size_t(half + i)];
      // rotate_half(x) = [-x2, x1]: lane i gets -b * sin, lane i + half gets a * sin.
      v[i] = r(r(a * c) + r(-b * s));
      v[i + half] = r(r(b * c) + r(a * s));
    }
  }
}

}  // namespace md::cpu
