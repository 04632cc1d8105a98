#include "megadecode/spec/ngram_drafter.h"

#include <algorithm>

#include "megadecode/base/error.h"

namespace md {

NgramDrafter::NgramDrafter(NgramOptions o) : o_(o) {
  MD_CHECK(o_.max_n >= 1 && o_.max_n <= 16, "n-gram drafter: max n {} is not in 1..16", o_.max_n);
}

void NgramDrafter::propose(std::span<const int32_t> context, std::span<int32_t> out) {
  MD_CHECK(!context.empty(), "n-gram drafter: empty context");
  const int64_t L = int64_t(context.size());
  // The token at i of the context followed by what has been proposed so far: a continuation may
  // run into the proposal itself (a periodic text continues its period).
  auto at = [&](int64_t i) { return i < L ? context[size_t(i)] : out[size_t(i - L)]; };
  int64_t from = -1;  // where the continuation starts
  for (int n = int(std::min<int64_t>(o_.max_n, L - 1)); n >= 1 && from < 0; --n) {
    // The most recent earlier occurrence of the last n tokens (s: its first token).
    for (int64_t s = L - n - 1; s >= 0; --s) {
      int t = 0;
      while (t < n && context[size_t(s + t)] == context[size_t(L - n + t)]) ++t;
      if (t == n) {
        from = s + n;
        break;
      }
    }
  }
  for (size_t j = 0; j < out.size(); ++j)
    out[j] = from >= 0 ? at(from + int64_t(j)) : context.back();
}

}  // namespace md
