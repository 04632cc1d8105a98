#include "megadecode/spec/acceptance.h"

#include "megadecode/base/error.h"

namespace md {

Acceptance accept_greedy(std::span<const int32_t> drafts, std::span<const int32_t> choices,
                         int forced) {
  const int K = int(drafts.size());
  MD_CHECK(choices.size() == drafts.size() + 1, "acceptance: {} choices for {} drafts",
           choices.size(), drafts.size());
  MD_CHECK(forced <= K, "acceptance: forced length {} exceeds the {} drafts", forced, K);
  Acceptance a;
  if (forced >= 0) {
    a.accepted = forced;
  } else {
    while (a.accepted < K && drafts[size_t(a.accepted)] == choices[size_t(a.accepted)])
      ++a.accepted;
  }
  a.token = choices[size_t(a.accepted)];
  return a;
}

Acceptance accept_sampled(std::span<const int32_t> drafts, std::span<const float> logits,
                          const std::function<SampleRow(int)>& row,
                          const std::function<double()>& uniform, SampleScratch& sc, int forced) {
  const int K = int(drafts.size());
  MD_CHECK(K >= 0 && logits.size() % size_t(K + 1) == 0 && !logits.empty(),
           "acceptance: {} logits for {} verify rows", logits.size(), K + 1);
  MD_CHECK(forced <= K, "acceptance: forced length {} exceeds the {} drafts", forced, K);
  const size_t V = logits.size() / size_t(K + 1);
  auto dist = [&](int i) {
    return sample_distribution(row(i), logits.subspan(size_t(i) * V, V), sc);
  };
  Acceptance a;
  if (forced >= 0) {
    // Benchmark mode: the drafts are taken as they are and the token after them is sampled as
    // plain sampling would sample it there.
    a.accepted = forced;
    a.token = draw_from(dist(forced), uniform());
    return a;
  }
  for (int i = 0; i < K; ++i) {
    const SampleDistribution p = dist(i);
    const int32_t x = drafts[size_t(i)];
    const double px = p.probability(x);
    // p(x) = 1 or 0 decides without a draw (greedy rows, tokens outside the top-k / top-p set),
    // so greedy rows take no uniforms from the stream.
    const bool accept = px >= 1.0 ? true : px <= 0.0 ? false : uniform() < px;
    if (!accept) {
      a.accepted = i;
      a.token = p.support.size() == 1 ? p.support[0].id : draw_from(p, uniform(), x);
      return a;
    }
  }
  a.accepted = K;
  const SampleDistribution p = dist(K);
  a.token = p.support.size() == 1 ? p.support[0].id : draw_from(p, uniform());
  return a;
}

}  // namespace md
