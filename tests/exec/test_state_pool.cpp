// The state pool (engine/state_pool.h): slot and page budgets with errors that name them, reuse
// of freed slots and pages (a reused slot starts from zero state; a reused page's stale rows are
// never read), copies between pools of different page sizes, the storage type per precision, and
// sequences stepped by an executor through a pool too small for them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <tuple>

#include "exec/exec_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/engine/state_pool.h"
#include "megadecode/exec/cpu_executor.h"
#include "test_util.h"

namespace md {
namespace {

using test::expect_same_bits;
using test::expect_same_state;
using test::opts;
using ::testing::HasSubstr;

std::string tiny() {
  return test::shared_checkpoint("tiny", 21);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

std::vector<int32_t> ids_of(const Model& m, int n, int salt) {
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) ids[size_t(t)] = int32_t((salt * 131 + t * 17 + 5) % (V - 1));
  return ids;
}

TEST(StatePool, SlotsRunOutWithAnErrorNamingTheBudgetAndAreReused) {
  Model m(tiny(), opts(Precision::BF16));
  PoolOptions po;
  po.max_sequences = 2;
  StatePool pool(m.config(), true, po);
  EXPECT_EQ(pool.max_sequences(), 2);
  SequenceState a = pool.acquire();
  {
    SequenceState b = pool.acquire();
    EXPECT_EQ(pool.sequences_in_use(), 2);
    EXPECT_NE(a.slot(), b.slot());
    const std::string e = error_of([&] { (void)pool.acquire(); });
    EXPECT_THAT(e, HasSubstr("all 2 sequence slots are in use"));
    EXPECT_THAT(e, HasSubstr("--max-sequences 2"));
  }
  EXPECT_EQ(pool.sequences_in_use(), 1);
  SequenceState c = pool.acquire();  // the freed slot
  EXPECT_EQ(pool.sequences_in_use(), 2);
  // Moving a state moves its slot; assigning over one frees the old slot.
  SequenceState d = std::move(c);
  EXPECT_FALSE(c.valid());
  d = SequenceState();
  EXPECT_EQ(pool.sequences_in_use(), 1);
}

TEST(StatePool, PagesRunOutWithAnErrorNamingTheBudgetAndAreReused) {
  Model m(tiny(), opts(Precision::BF16));
  PoolOptions po;
  po.max_sequences = 3;
  po.cache_tokens = 64;
  po.page_rows = 16;
  StatePool pool(m.config(), true, po);
  ASSERT_GT(m.config().num_mla_layers(), 0);
  EXPECT_EQ(pool.total_pages(), 4);
  SequenceState a = pool.acquire(), b = pool.acquire();
  a.reserve(40);  // 3 pages
  EXPECT_EQ(a.pages().size(), 3u);
  EXPECT_EQ(a.capacity(), 48);
  EXPECT_EQ(pool.free_pages(), 1);
  const std::string e = error_of([&] { b.reserve(32); });
  EXPECT_THAT(e, HasSubstr("out of latent-cache pages"));
  EXPECT_THAT(e, HasSubstr("--cache-tokens 64"));
  EXPECT_TRUE(b.pages().empty());  // nothing taken
  EXPECT_EQ(pool.free_pages(), 1);
  a.truncate(10);  // keeps the page of rows [0, 16)
  EXPECT_EQ(a.pages().size(), 1u);
  b.reserve(32);
  EXPECT_EQ(pool.free_pages(), 1);
  // The page ids handed out are distinct.
  std::vector<int32_t> all(a.pages().begin(), a.pages().end());
  all.insert(all.end(), b.pages().begin(), b.pages().end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end());
  b = SequenceState();
  EXPECT_EQ(pool.free_pages(), 3);
}

TEST(StatePool, BadOptionsAreErrors) {
  Model m(tiny(), opts(Precision::BF16));
  for (auto [seqs, tokens, rows, commit, what] :
       {std::tuple{0, int64_t(0), 64, 16, "--max-sequences 0"},
        std::tuple{4, int64_t(0), 24, 16, "page of 24 rows"},
        std::tuple{4, int64_t(-5), 64, 16, "--cache-tokens -5"},
        std::tuple{4, int64_t(0), 64, 65, "row log of 65 rows"}}) {
    PoolOptions po;
    po.max_sequences = seqs;
    po.cache_tokens = tokens;
    po.page_rows = rows;
    po.commit_rows = commit;
    EXPECT_THAT(error_of([&] { StatePool p(m.config(), true, po); }), HasSubstr(what));
  }
}

TEST(StatePool, CacheStorageFollowsThePrecision) {
  for (Precision p : {Precision::BF16, Precision::FP32}) {
    Model m(tiny(), opts(p));
    EXPECT_EQ(m.states().cache_bf16(), p == Precision::BF16);
    SequenceState s = m.new_sequence();
    m.forward(s, ids_of(m, 5, 1), nullptr, false);
    for (int l = 0; l < m.config().num_layers; ++l) {
      if (m.config().attn_kind[size_t(l)] == AttnKind::MLA) {
        EXPECT_EQ(s.latent(l).elem_bytes(), p == Precision::BF16 ? 2u : 4u);
      }
    }
  }
}

// The reference path over a budget: an error naming it, the sequence unchanged; a reused slot
// and reused pages (holding another sequence's rows) give the bits of a fresh model.
TEST(StatePool, ReferencePathReusesSlotsAndPagesExactly) {
  ModelOptions o = opts(Precision::BF16);
  o.states.max_sequences = 2;
  o.states.cache_tokens = 48;
  o.states.page_rows = 16;
  Model m(tiny(), o);
  const int64_t V = m.config().vocab_size;
  const std::vector<int32_t> p = ids_of(m, 20, 2), q = ids_of(m, 30, 3);
  std::vector<float> want(static_cast<size_t>(V)), got(static_cast<size_t>(V));
  {
    Model fresh(tiny(), opts(Precision::BF16));
    SequenceState s = fresh.new_sequence();
    fresh.forward(s, p, want.data(), false);
  }
  SequenceState x = m.new_sequence();
  m.forward(x, q, nullptr, false);  // 2 of 3 pages
  SequenceState y = m.new_sequence();
  EXPECT_THAT(error_of([&] { m.forward(y, p, nullptr, false); }), HasSubstr("--cache-tokens 48"));
  EXPECT_EQ(y.pos, 0);
  x = SequenceState();  // slot and pages back, rows and state left behind in them
  SequenceState z = m.new_sequence();
  m.forward(z, p, got.data(), false);
  expect_same_bits(got.data(), want.data(), size_t(V), "reused slot and pages");
}

// Copies between pools (another page size, the executor's pool) continue exactly.
TEST(StatePool, CopiesBetweenPoolsContinueExactly) {
  Model m(tiny(), opts(Precision::FP32));
  const int64_t V = m.config().vocab_size;
  PoolOptions po;
  po.page_rows = 32;
  StatePool other(m.config(), false, po);
  SequenceState a = m.new_sequence();
  m.forward(a, ids_of(m, 45, 4), nullptr, false);
  SequenceState b = other.acquire();
  b.copy_from(a);
  expect_same_state(a, b, "copy");
  const std::vector<int32_t> more = ids_of(m, 3, 5);
  std::vector<float> la(3 * size_t(V)), lb(3 * size_t(V));
  m.forward(a, more, la.data(), true);
  m.forward(b, more, lb.data(), true);
  expect_same_bits(la.data(), lb.data(), la.size(), "after the copy");
  StatePool bf16_pool(m.config(), true, {});
  SequenceState c = bf16_pool.acquire();
  EXPECT_THAT(error_of([&] { c.copy_from(a); }), HasSubstr("different models or cache types"));
}

// An executor's steps over its pool's page budget: an error naming it before anything changes;
// freeing another sequence lets the step run, and the result equals the reference's bits.
TEST(StatePool, ExecutorStepsOverTheBudgetAreErrorsAndRecover) {
  Model m(tiny(), opts(Precision::BF16));
  const int64_t V = m.config().vocab_size;
  ExecutorOptions eo;
  eo.workers = 2;
  eo.states.max_sequences = 2;
  eo.states.cache_tokens = 64;
  eo.states.page_rows = 16;
  CpuExecutor ex(m, 2, ExecutorKind::kMegakernel, eo);
  EXPECT_EQ(ex.states().total_pages(), 4);
  const std::vector<int32_t> p = ids_of(m, 40, 6), q = ids_of(m, 33, 7);
  SequenceState a = ex.new_sequence(), b = ex.new_sequence();
  EXPECT_THAT(error_of([&] { (void)ex.new_sequence(); }), HasSubstr("--max-sequences 2"));
  std::vector<float> la(static_cast<size_t>(V)), lb(static_cast<size_t>(V)),
      want(static_cast<size_t>(V));
  ex.prefill(a, p, la.data(), 8);  // 3 pages
  // b's first two chunks fit in the one free page; the third (rows 16..23) needs another.
  const std::string e = error_of([&] { ex.prefill(b, q, lb.data(), 8); });
  EXPECT_THAT(e, HasSubstr("out of latent-cache pages"));
  EXPECT_THAT(e, HasSubstr("--cache-tokens 64"));
  const int64_t stopped = b.pos;
  EXPECT_EQ(stopped, 16);  // the chunk that found no page changed nothing
  a = SequenceState();
  ex.prefill(b, std::span(q).subspan(size_t(stopped)), lb.data(), 8);
  SequenceState r = m.new_sequence();
  for (int32_t id : q) m.forward(r, std::span(&id, 1), want.data(), false);
  expect_same_bits(lb.data(), want.data(), size_t(V), "after the pages were freed");
  expect_same_state(b, r, "state after the pages were freed");
}

}  // namespace
}  // namespace md
