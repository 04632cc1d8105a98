// The masks of a grammar element (engine/token_constraint.h, kGrammar) over a vocabulary:
// per stack of the grammar's state, the tokens its top frame's rule reads whole by itself, and
// the few whose bytes may leave that rule partway (a call or a return), which alone are run
// through the whole pushdown automaton. The split depends only on the top frame (rule, state),
// so it is computed once per frame and kept: a mask then costs a bit-or per stack plus the
// uncertain tokens' runs. Private to src/engine; one per TokenConstraint (not shared between
// threads).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "megadecode/engine/grammar.h"

namespace md::detail {

// The vocabulary's bytes as ConstraintVocab keeps them.
struct TokenBytes {
  const uint32_t* offset;  // per id + 1: the id's bytes in `bytes`
  const char* bytes;
  const uint8_t* special;  // per id: 0 ordinary, 1 special, 2 never
  int64_t size;
};

class GrammarMasks {
 public:
  // Sets mask[id] for every ordinary id that `stacks` reads whole. `bytes_follow`: what comes
  // after the answer can begin with bytes; then an id that finishes the answer partway (the root
  // read whole, bytes left over) is `fallback(id)`'s to judge. (Otherwise no such id is allowed:
  // a stop or marker token follows.) Returns how many entries it set.
  int64_t add(const Grammar& g, const Grammar::Stacks& stacks, const TokenBytes& v,
              std::span<uint8_t> mask, bool bytes_follow,
              const std::function<bool(int32_t)>& fallback);

 private:
  struct Split {
    std::vector<uint64_t> whole;     // bit per id: read whole inside the frame's rule
    std::vector<int32_t> uncertain;  // may leave the rule partway (in byte order)
  };
  // Splits kept at most (~20 KB each on a 163,840-id vocabulary, plus the uncertain ids); the
  // cache starts over when full (a grammar whose generation visits more frames recomputes).
  static constexpr size_t kMaxSplits = 256;
  const Split& split(const Grammar& g, Grammar::Frame top, const TokenBytes& v);
  std::map<std::pair<int32_t, int32_t>, Split> cache_;
};

}  // namespace md::detail
