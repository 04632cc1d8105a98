// Helpers shared by the executor tests: reference-path options and bitwise comparisons of logits
// and sequence states.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "megadecode/engine/model.h"

namespace md::test {

// The reference runs on one thread: its results do not depend on the thread count
// (ModelTest.ThreadCountDoesNotChangeBits), and a single thread keeps it fast on a loaded machine.
inline ModelOptions opts(Precision p) {
  ModelOptions o;
  o.precision = p;
  o.threads = 1;
  o.pin_threads = false;
  return o;
}

inline bool same_bits(const float* a, const float* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(float)) == 0;  // (empty: data() may be null)
}

inline void expect_same_bits(const float* a, const float* b, size_t n, const std::string& what) {
  if (same_bits(a, b, n)) return;
  size_t i = 0;
  while (i < n && std::memcmp(a + i, b + i, sizeof(float)) == 0) ++i;
  ADD_FAILURE() << what << ": first difference at " << i << ": " << a[i] << " vs " << b[i];
}

// Position, KDA states, conv caches and MLA caches, bit for bit.
inline void expect_same_state(const SequenceState& a, const SequenceState& b,
                              const std::string& what) {
  EXPECT_EQ(a.pos, b.pos) << what;
  for (auto member :
       {&SequenceState::kda_state, &SequenceState::conv_cache, &SequenceState::mla_cache}) {
    const auto& x = a.*member;
    const auto& y = b.*member;
    ASSERT_EQ(x.size(), y.size()) << what;
    for (size_t l = 0; l < x.size(); ++l) {
      ASSERT_EQ(x[l].size(), y[l].size()) << what << " layer " << l;
      expect_same_bits(x[l].data(), y[l].data(), x[l].size(),
                       what + " state, layer " + std::to_string(l));
    }
  }
}

}  // namespace md::test
