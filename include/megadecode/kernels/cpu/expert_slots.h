// The distinct routed experts chosen by a set of token rows, in ascending id: the order in which
// the reference path runs its expert groups and the plan's expert slots run theirs (slot u is the
// u-th distinct expert), so both read each chosen expert once and sum in the same order.
#pragma once
#include <cstddef>
#include <cstdint>

namespace md::cpu {

// Row t's top-k ids are ids[t * row_stride .. + k). Writes the distinct ids, ascending, to out
// (at least min(E, rows * k) entries) and returns their count. mark: E ints of scratch.
inline int distinct_experts(const int32_t* ids, size_t row_stride, int rows, int k, int E,
                            int* mark, int32_t* out) {
  for (int e = 0; e < E; ++e) mark[e] = 0;
  for (int t = 0; t < rows; ++t)
    for (int j = 0; j < k; ++j) mark[ids[size_t(t) * row_stride + size_t(j)]] = 1;
  int n = 0;
  for (int e = 0; e < E; ++e)
    if (mark[e]) out[n++] = e;
  return n;
}

}  // namespace md::cpu
