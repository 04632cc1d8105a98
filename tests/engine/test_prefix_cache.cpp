// The prefix cache (engine/prefix_cache.h): which entry a prompt restores (the longest proper
// prefix), where it departs from the entries, least-recently-used eviction, giving way to a full
// pool, and a restored sequence continuing with the bits of one that consumed the whole prompt.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "exec/exec_test_util.h"
#include "megadecode/engine/model.h"
#include "megadecode/engine/prefix_cache.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/plan/plan.h"
#include "test_util.h"

namespace md {
namespace {

using test::expect_same_bits;
using test::expect_same_state;

struct Fixture {
  Model m{test::shared_checkpoint("tiny", 21), test::opts(Precision::BF16)};
  // Tokens 0..n-1 of a fixed pseudo-random prompt (salt: which one).
  std::vector<int32_t> ids(int n, int salt = 1) const {
    const int64_t V = m.config().vocab_size;
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int t = 0; t < n; ++t) v[size_t(t)] = int32_t((salt * 131 + t * 17 + 5) % (V - 1));
    return v;
  }
  SequenceState consumed(std::span<const int32_t> tokens) {
    SequenceState s = m.new_sequence();
    m.forward(s, tokens, nullptr, false);
    return s;
  }
};

std::span<const int32_t> first(const std::vector<int32_t>& v, size_t n) {
  return {v.data(), n};
}

TEST(PrefixCache, MatchesTheLongestProperPrefixAndReportsWhereThePromptDeparts) {
  Fixture f;
  PrefixCache cache(f.m.states(), 4, 4);
  const std::vector<int32_t> p = f.ids(40);
  EXPECT_EQ(cache.match(p).entry, -1);
  ASSERT_TRUE(cache.insert(first(p, 10), f.consumed(first(p, 10))));
  ASSERT_TRUE(cache.insert(first(p, 25), f.consumed(first(p, 25))));
  EXPECT_FALSE(cache.insert(first(p, 3), f.consumed(first(p, 3)))) << "below min_tokens";
  EXPECT_FALSE(cache.insert(first(p, 25), f.consumed(first(p, 25)))) << "already kept";
  EXPECT_EQ(cache.size(), 2);

  PrefixCache::Match m = cache.match(p);
  EXPECT_EQ(m.cached, 25);
  EXPECT_EQ(m.shared, 25);
  // Exactly an entry's tokens: that entry is no proper prefix (the last token must be fed).
  m = cache.match(first(p, 25));
  EXPECT_EQ(m.cached, 10);
  EXPECT_EQ(m.shared, 25);
  // Departing inside the longer entry: the shorter one restores, and the departure is reported.
  std::vector<int32_t> q = p;
  q[17] = q[17] + 1;
  m = cache.match(q);
  EXPECT_EQ(m.cached, 10);
  EXPECT_EQ(m.shared, 17);
  // Departing before either: nothing.
  q = p;
  q[5] = q[5] + 1;
  m = cache.match(q);
  EXPECT_EQ(m.entry, -1);
  EXPECT_EQ(m.cached, 0);
  EXPECT_EQ(m.shared, 5);
  // A prompt shorter than every entry shares its whole self.
  m = cache.match(first(p, 8));
  EXPECT_EQ(m.entry, -1);
  EXPECT_EQ(m.shared, 8);
}

// A restored sequence fed the rest of the prompt gives the logits and state of one fed the whole
// prompt, bit for bit, on a plan executor whose prompt steps run row by row (chunks of at most
// plan::kMaxChainedRows rows): the restored one's chunks start at the entry's end, the other's at
// multiples of the chunk, so this is also the executors' chunking invariance. (Longer chunks run
// KDA's chunked form, whose fp32 sums depend on where a chunk starts: docs/server.md.)
TEST(PrefixCache, ARestoredSequenceContinuesWithTheBitsOfAWholePrefill) {
  Fixture f;
  ExecutorOptions eo;
  eo.workers = 2;
  eo.pin = false;
  CpuExecutor ex(f.m, 1, ExecutorKind::kMegakernel, eo);
  PrefixCache cache(ex.states(), 2, 1);
  const std::vector<int32_t> p = f.ids(50, 3);
  const size_t V = size_t(f.m.config().vocab_size);
  const int chunk = plan::kMaxChainedRows;
  {
    SequenceState e = ex.new_sequence();
    ex.prefill(e, first(p, 33), nullptr, chunk);
    ASSERT_TRUE(cache.insert(first(p, 33), e));
  }
  SequenceState whole = ex.new_sequence();
  std::vector<float> want(V), got(V);
  ex.prefill(whole, p, want.data(), chunk);

  SequenceState s = ex.new_sequence();
  const PrefixCache::Match m = cache.match(p);
  ASSERT_EQ(m.cached, 33);
  cache.restore(m, s);
  EXPECT_EQ(s.pos, 33);
  ex.prefill(s, std::span<const int32_t>(p).subspan(33), got.data(), chunk);
  expect_same_bits(got.data(), want.data(), V, "logits after the restored prefix");
  expect_same_state(s, whole, "after the restored prefix");
  // The entry itself is untouched by the restored sequence's steps: restoring again works too.
  s = ex.new_sequence();
  cache.restore(cache.match(p), s);
  ex.prefill(s, std::span<const int32_t>(p).subspan(33), got.data(), chunk);
  expect_same_bits(got.data(), want.data(), V, "logits after a second restore");
}

TEST(PrefixCache, EvictsTheLeastRecentlyUsedEntry) {
  Fixture f;
  PrefixCache cache(f.m.states(), 2, 1);
  const std::vector<int32_t> a = f.ids(20, 1), b = f.ids(20, 2), c = f.ids(20, 3);
  cache.insert(first(a, 10), f.consumed(first(a, 10)));
  cache.insert(first(b, 10), f.consumed(first(b, 10)));
  SequenceState s = f.m.new_sequence();
  cache.restore(cache.match(a), s);  // a is now the most recently used
  cache.insert(first(c, 10), f.consumed(first(c, 10)));
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(cache.match(a).cached, 10);
  EXPECT_EQ(cache.match(b).entry, -1) << "b was the least recently used";
  EXPECT_EQ(cache.match(c).cached, 10);
  // Inserting what is kept touches it: a is touched, so b's return evicts c.
  cache.insert(first(a, 10), f.consumed(first(a, 10)));
  cache.insert(first(b, 10), f.consumed(first(b, 10)));
  EXPECT_EQ(cache.match(a).cached, 10);
  EXPECT_EQ(cache.match(c).entry, -1);
  const size_t one =
      f.m.states().slot_bytes() + size_t(f.m.states().pages_for(10)) * f.m.states().page_bytes();
  EXPECT_EQ(cache.bytes(), 2 * one);
  cache.clear();
  EXPECT_EQ(cache.size(), 0);
}

// The cache never takes what the pool lacks: with every slot but the source's taken it gives way
// (entries evicted, then nothing kept), and free_a_slot() evicts entries for a new sequence.
TEST(PrefixCache, GivesWayToAFullPool) {
  Fixture f;
  PoolOptions po;
  po.max_sequences = 3;
  StatePool pool(f.m.config(), true, po);
  PrefixCache cache(pool, 8, 1);
  const std::vector<int32_t> p = f.ids(12);
  SequenceState src = pool.acquire();
  f.m.forward(src, p, nullptr, false);
  EXPECT_TRUE(cache.insert(first(p, 12), src));
  SequenceState other = pool.acquire();  // the pool is full: src, other and the entry
  EXPECT_EQ(pool.sequences_in_use(), 3);
  const std::vector<int32_t> q = f.ids(12, 5);
  SequenceState src2 = f.m.new_sequence();
  f.m.forward(src2, q, nullptr, false);
  // The new entry takes the old one's slot.
  EXPECT_TRUE(cache.insert(q, src2));
  EXPECT_EQ(cache.size(), 1);
  EXPECT_EQ(cache.match(f.ids(13, 5)).cached, 12);
  EXPECT_EQ(cache.match(f.ids(13)).entry, -1);
  cache.free_a_slot();
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(pool.sequences_in_use(), 2);
  SequenceState third = pool.acquire();
  EXPECT_FALSE(cache.insert(q, src2)) << "no slot: nothing kept";
  EXPECT_EQ(cache.size(), 0);
}

}  // namespace
}  // namespace md
