// Draft-free drafting by prompt lookup: the continuation of the most recent earlier occurrence of
// the context's longest suffix n-gram (n from max_n down to 1). Text that repeats itself (code,
// quoted input, lists, a random model's loops) is drafted for free; when nothing matches, the
// last token is proposed again (cheap, valid, and right whenever the output repeats a token).
#pragma once
#include <cstdint>
#include <span>
#include <string_view>

#include "megadecode/spec/drafter.h"

namespace md {

struct NgramOptions {
  int max_n = 3;  // longest suffix n-gram looked up (1 .. 16)
};

class NgramDrafter : public Drafter {
 public:
  explicit NgramDrafter(NgramOptions o = {});
  std::string_view name() const override { return "ngram"; }
  void reset() override {}
  void observe(std::span<const int32_t>, int64_t, std::span<const float>) override {}
  void propose(std::span<const int32_t> context, std::span<int32_t> out) override;

 private:
  NgramOptions o_;
};

}  // namespace md
