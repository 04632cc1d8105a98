// The CUDA executors through the host simulation of the CUDA execution model: cuda-megakernel
// and cuda-opbyop agree bit for bit with each other (same tiles, same blocks) under every
// scheduling seed, and with the CPU reference path within fp32 reordering; batches of 1, 3 and 8
// with sequences joining and leaving; multi-row steps; the watchdog. Then the simulation itself:
// barriers, warp collectives, bulk copies with byte checks, the deadlock detector.
//
// Tolerance against the reference (FP32 precision, where no bf16 rounding point can flip): the
// tiles sum every dot product of length n in another order than the CPU kernels, an error of at
// most n * 2^-24 of the sum of the products' magnitudes per matrix (Higham's bound); with n up to
// 512 here and a handful of layers that is below 1e-4 of the logits' scale, the bound the test
// uses. In BF16 precision a reordering can move a value across a bf16 rounding boundary (2^-8
// relative) and the difference propagates; there the test checks the greedy tokens where the
// reference's top two logits are further apart than 2^-6 of their scale, and bit-identity between
// the two CUDA executors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "../exec/exec_test_util.h"
#include "cuda_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/engine/prefix_cache.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/exec/reference_executor.h"
#include "megadecode/kernels/cuda/sim.h"
#include "test_util.h"

namespace md {
namespace {

using test::expect_same_bits;
using test::opts;
using test::SimConfig;
using ::testing::HasSubstr;

std::string model(const std::string& name) {
  const int seed = name == "tiny" ? 21 : name == "small" ? 22 : name == "k3-tiny" ? 23 : 24;
  return test::shared_checkpoint(name, uint64_t(seed));
}

std::vector<SequenceState> prefilled(Model& m, int n) {
  const int64_t V = m.config().vocab_size;
  std::vector<SequenceState> out;
  for (int i = 0; i < n; ++i) {
    SequenceState s = m.new_sequence();
    const int len = (i * 7 + 3) % 19;
    std::vector<int32_t> ids(static_cast<size_t>(len));
    for (int t = 0; t < len; ++t) ids[size_t(t)] = int32_t((i * 131 + t * 17 + 1) % (V - 1));
    if (len > 0) m.forward(s, ids, nullptr, false);
    out.push_back(std::move(s));
  }
  return out;
}

double max_abs(const float* x, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, double(std::fabs(x[i])));
  return m;
}

// Both CUDA executors step batches of 1, 3 and 8 with sequences joining and leaving; they must
// agree bit for bit, and with Model::forward within the tolerance above.
void check_executors(const std::string& name, Precision prec, int sms, uint64_t seed,
                     CudaTarget target = CudaTarget::kSim) {
  SimConfig sc(sms, seed);
  Model m(model(name), opts(prec));
  const int64_t V = m.config().vocab_size;
  std::vector<SequenceState> ref = prefilled(m, 9);
  CudaExecutor emk(m, 8, ExecutorKind::kMegakernel, target);
  CudaExecutor eob(m, 8, ExecutorKind::kOpByOp, target);
  if (target == CudaTarget::kSim) {
    EXPECT_EQ(emk.workers(), sms);
  }
  std::vector<SequenceState> mk = test::copies(emk, ref), ob = test::copies(eob, ref);
  const std::vector<std::vector<int>> batches = {
      {0}, {1, 2, 0}, {0, 1, 2, 3, 4, 5, 6, 7}, {8, 5, 2}, {3}};
  std::vector<float> want(static_cast<size_t>(V));
  test::step_in_lockstep(
      emk, eob, mk, ob, batches, V,
      [&](int id, int step) { return int32_t((id * 37 + step * 101 + 7) % (V - 1)); },
      [&](const test::LockstepStep& t) {
        for (size_t b = 0; b < t.ids.size(); ++b) {
          m.forward(ref[size_t(t.ids[b])], std::span(&t.tokens[b], 1), want.data(), false);
          test::expect_cuda_row(t, b, V, want, prec == Precision::FP32,
                                name + " step " + std::to_string(t.step) + " seq " +
                                    std::to_string(t.ids[b]) + " seed " + std::to_string(seed));
        }
      });
}

TEST(CudaSim, TinyFp32BothExecutorsAgreeAndMatchReference) {
  check_executors("tiny", Precision::FP32, 4, 0);
}
TEST(CudaSim, TinyBf16BothExecutorsAgree) {
  check_executors("tiny", Precision::BF16, 3, 0);
}
TEST(CudaSim, SmallFp32BothExecutorsAgreeAndMatchReference) {
  check_executors("small", Precision::FP32, 8, 0);
}
TEST(CudaSim, SmallBf16BothExecutorsAgree) {
  check_executors("small", Precision::BF16, 4, 0);
}
TEST(CudaSim, K3TinyFp32BothExecutorsAgreeAndMatchReference) {
  check_executors("k3-tiny", Precision::FP32, 4, 0);
}
TEST(CudaSim, K3TinyBf16BothExecutorsAgree) {
  check_executors("k3-tiny", Precision::BF16, 3, 0);
}

// The committed golden models (tests/data/golden: tiny, small, K3 tiny, official-model outputs):
// prefill through the plan, then decode the golden ids; in FP32 the logits stay within the
// tolerance of Model::forward (which matches the official implementation), and the greedy token
// is the reference's wherever its top two logits are clearly apart.
void golden_models_match_reference(CudaTarget target) {
  for (const char* name : {"tiny", "small", "k3-tiny"}) {
    const std::string dir = test::data_dir() + "/data/golden/" + name;
    std::ifstream f(dir + "/golden.json");
    ASSERT_TRUE(f.good()) << dir;
    const nlohmann::json meta = nlohmann::json::parse(f);
    std::vector<int32_t> prompt, decode;
    for (auto& v : meta["prompt_ids"]) prompt.push_back(v.get<int32_t>());
    for (auto& v : meta["decode_ids"]) decode.push_back(v.get<int32_t>());
    Model m(dir, opts(Precision::FP32));
    const int64_t V = m.config().vocab_size;
    for (ExecutorKind k : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
      CudaExecutor ex(m, 1, k, target);
      SequenceState r = m.new_sequence(), s = ex.new_sequence();
      std::vector<float> want(static_cast<size_t>(V)), got(static_cast<size_t>(V));
      m.forward(r, prompt, want.data(), false);
      ex.prefill(s, prompt, got.data(), 8);
      for (size_t i = 0; i <= decode.size(); ++i) {
        const std::string what = std::string(name) + " " + std::string(executor_name(k)) +
                                 " position " + std::to_string(s.pos);
        const double scale = max_abs(want.data(), want.size());
        double err = 0;
        for (size_t j = 0; j < want.size(); ++j)
          err = std::max(err, double(std::fabs(got[j] - want[j])));
        EXPECT_LE(err, 1e-4 * scale) << what;
        std::vector<float> sorted(want);
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
        if (sorted[0] - sorted[1] > scale / 64) {
          EXPECT_EQ(std::max_element(got.begin(), got.end()) - got.begin(),
                    std::max_element(want.begin(), want.end()) - want.begin())
              << what;
        }
        if (i == decode.size()) break;
        m.forward(r, std::span(&decode[i], 1), want.data(), false);
        SequenceState* seqs[] = {&s};
        ex.step(seqs, std::span(&decode[i], 1), got.data());
      }
    }
  }
}

SIM_AND_GPU_TEST(GoldenModelsMatchReference, 4, golden_models_match_reference)

// The same on a GPU, when there is one.
TEST(CudaGpu, TinyAndSmallBothExecutorsAgreeAndMatchReference) {
  MD_NEED_GPU();
  for (const char* name : {"tiny", "small"})
    for (Precision p : {Precision::FP32, Precision::BF16})
      check_executors(name, p, 4, 0, CudaTarget::kGpu);
  for (Precision p : {Precision::FP32, Precision::BF16})
    check_executors("k3-tiny", p, 4, 0, CudaTarget::kGpu);
}

// Random scheduling of the simulated threads and blocks: a missing wait or barrier shows up as a
// different result (or a TSan report) under some order.
TEST(CudaSim, RandomSchedulesGiveTheSameBits) {
  for (uint64_t seed : {1, 2, 3}) check_executors("tiny", Precision::FP32, 5, seed);
}

// The weight stream's schedule (gemv.cuh): in the megakernel every GEMV op's first chunks are
// issued ahead of it, most of them while the previous instruction still runs (its last GEMV's
// tail, or its whole run when it streams no weights), and no prefetch is ever wasted; the phase
// kernel prefetches each tile's own first chunks before the previous phase ends (and within a
// tile, each GEMV the next one's, as the gate the up matrix).
TEST(CudaSim, WeightPrefetchesAreIssuedAheadAndAllUsed) {
  SimConfig sc(4);
  Model m(model("tiny"), opts(Precision::BF16));
  using cuda::sim::Event;
  for (ExecutorKind k : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
    SCOPED_TRACE(executor_name(k));
    CudaExecutor ex(m, 2, k, CudaTarget::kSim);
    std::vector<SequenceState> seqs;
    for (int b = 0; b < 2; ++b) seqs.push_back(ex.new_sequence());
    std::vector<SequenceState*> ptrs = {&seqs[0], &seqs[1]};
    const std::vector<int32_t> tokens = {3, 17};
    std::vector<float> logits(size_t(2 * m.config().vocab_size));
    ex.step(ptrs, tokens, logits.data());  // plans compiled, first use
    const cuda::sim::LaunchStats before = cuda::sim::stats();
    ex.step(ptrs, tokens, logits.data());
    const cuda::sim::LaunchStats& after = cuda::sim::stats();
    auto delta = [&](Event e) { return after.count(e) - before.count(e); };
    EXPECT_EQ(delta(Event::kPrefetchDrained), 0u);
    // Every non-expert GEMV instruction of the step starts from a prefetch.
    const plan::Plan& p = ex.plan(2);
    uint64_t gemv_ops = 0;
    for (const plan::Instr& in : p.instrs)
      gemv_ops += in.op == plan::Op::kKdaProj || in.op == plan::Op::kMlaProj ||
                  in.op == plan::Op::kAttnOut || in.op == plan::Op::kDenseGateUp ||
                  in.op == plan::Op::kSharedGateUp || in.op == plan::Op::kDenseDown ||
                  in.op == plan::Op::kSharedDown || in.op == plan::Op::kLmHead;
    const uint64_t used = delta(Event::kPrefetchUsed) + delta(Event::kPrefetchUsedNextTile);
    EXPECT_GE(used, gemv_ops);
    if (k == ExecutorKind::kMegakernel)
      EXPECT_GE(delta(Event::kPrefetchUsedNextTile), gemv_ops * 3 / 4);
    else
      EXPECT_EQ(delta(Event::kPrefetchUsedNextTile), 0u);
  }
}

// A prefill of several rows per step (the plan's multi-row steps) leaves the same state and
// last-row logits as one row at a time, within the tolerance.
void multi_row_prefill_matches_reference(CudaTarget target) {
  Model m(model("tiny"), opts(Precision::FP32));
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 13; ++i) prompt.push_back(int32_t((i * 29 + 5) % (V - 1)));
  std::vector<float> want(static_cast<size_t>(V)), got(static_cast<size_t>(V));
  SequenceState r = m.new_sequence();
  m.forward(r, prompt, want.data(), false);
  for (ExecutorKind k : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
    CudaExecutor ex(m, 2, k, target);
    SequenceState s = ex.new_sequence();
    ex.prefill(s, prompt, got.data(), 5);  // 5 + 5 + 3 rows
    EXPECT_EQ(s.pos, 13);
    double err = 0;
    for (int64_t i = 0; i < V; ++i)
      err = std::max(err, double(std::fabs(got[size_t(i)] - want[size_t(i)])));
    EXPECT_LE(err, 1e-4 * max_abs(want.data(), size_t(V))) << executor_name(k);
  }
}

SIM_AND_GPU_TEST(MultiRowPrefillMatchesReference, 4, multi_row_prefill_matches_reference)

// A verify-style step of 4 rows kept for a commit, cut back to its first 2 on the device: the
// sequence's states are bit for bit those of a step of the 2 rows alone (the replay runs the
// step's own delta-rule code), decoding on from there gives that sequence's logits bit for bit,
// and the reference's within the fp32 tolerance.
void commit_to_a_prefix_then_decode(CudaTarget target) {
  Model m(model("tiny"), opts(Precision::FP32));
  const int64_t V = m.config().vocab_size;
  const std::vector<int32_t> prompt = {5, 9, 2, 33, 7}, draft = {11, 4, 19, 8};
  const int32_t next = 21;
  std::vector<float> want(static_cast<size_t>(V)), got(static_cast<size_t>(V)),
      alone(static_cast<size_t>(V));
  SequenceState r = m.new_sequence();
  m.forward(r, prompt, nullptr, false);
  m.forward(r, std::span(draft.data(), 2), nullptr, false);
  m.forward(r, std::span(&next, 1), want.data(), false);
  for (ExecutorKind k : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
    SCOPED_TRACE(executor_name(k));
    CudaExecutor ex(m, 1, k, target);
    SequenceState s = ex.new_sequence(), t = ex.new_sequence();
    ex.prefill(s, prompt, nullptr, 5);
    ex.prefill(t, prompt, nullptr, 5);
    std::vector<float> all(4 * static_cast<size_t>(V));
    StepOptions so;
    so.keep_for_commit = true;
    const StepSeq q{&s, draft, LogitRows::kAll};
    ex.step(std::span(&q, 1), all.data(), nullptr, {}, so);
    EXPECT_EQ(s.pos, 9);
    ex.commit(s, 2);
    EXPECT_EQ(s.pos, 7);
    const StepSeq q2{&t, std::span(draft.data(), 2), LogitRows::kNone};
    ex.step(std::span(&q2, 1), nullptr);
    if (target == CudaTarget::kSim)  // (a GPU's pool is not host memory)
      test::expect_same_state(s, t, "committed vs fed 2 rows");
    SequenceState* seqs[] = {&s};
    ex.step(seqs, std::span(&next, 1), got.data());
    SequenceState* seqs2[] = {&t};
    ex.step(seqs2, std::span(&next, 1), alone.data());
    expect_same_bits(got.data(), alone.data(), size_t(V), "logits after the commit");
    double err = 0;
    for (int64_t i = 0; i < V; ++i)
      err = std::max(err, double(std::fabs(got[size_t(i)] - want[size_t(i)])));
    EXPECT_LE(err, 1e-4 * max_abs(want.data(), size_t(V)));
    EXPECT_THROW(ex.commit(s, 1), Error);  // nothing kept any more
  }
}

SIM_AND_GPU_TEST(CommitToAPrefixThenDecode, 4, commit_to_a_prefix_then_decode)

// The serving loop's prefix cache over a device pool: a state kept after 70 prompt tokens (two
// 64-row pages, copied page run by page run through the device memory) and restored into a new
// sequence continues with the bits of a whole prefill (chunks of at most 16 rows run row by row,
// so where they start does not matter).
void prefix_cache_restores_on_the_device(CudaTarget target) {
  Model m(model("tiny"), opts(Precision::BF16));
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 90; ++i) prompt.push_back(int32_t(1 + (i * 13) % 61));
  std::vector<float> want(static_cast<size_t>(V)), got(static_cast<size_t>(V));
  CudaExecutor ex(m, 1, ExecutorKind::kMegakernel, target);
  PrefixCache cache(ex.states(), 2, 1);
  {
    SequenceState e = ex.new_sequence();
    ex.prefill(e, std::span(prompt.data(), 70), nullptr, 16);
    ASSERT_TRUE(cache.insert(std::span(prompt.data(), 70), e));
  }
  SequenceState whole = ex.new_sequence();
  ex.prefill(whole, prompt, want.data(), 16);
  SequenceState s = ex.new_sequence();
  const PrefixCache::Match hit = cache.match(prompt);
  ASSERT_EQ(hit.cached, 70);
  cache.restore(hit, s);
  ex.prefill(s, std::span(prompt).subspan(70), got.data(), 16);
  expect_same_bits(got.data(), want.data(), size_t(V), "logits after the restored prefix");
  if (target == CudaTarget::kSim) test::expect_same_state(s, whole, "restored vs whole");
}

SIM_AND_GPU_TEST(PrefixCacheRestoresOnTheDevice, 4, prefix_cache_restores_on_the_device)

// The megakernel's watchdog: a stalled tile becomes an md::Error naming the instruction; the
// executor recovers for the next step.
void watchdog_reports_a_stalled_tile(CudaTarget target) {
  Model m(model("tiny"), opts(Precision::BF16));
  CudaExecutor ex(m, 1, ExecutorKind::kMegakernel, target);
  ex.set_watchdog_seconds(0.01);
  const plan::Plan& p = ex.plan(1);
  const uint32_t id = uint32_t(p.instrs.size() / 2);
  ex.edit_instr_for_testing(1, id, [](plan::Instr& in) { in.flags |= plan::kFlagTestStall; });
  SequenceState s = ex.new_sequence();
  std::vector<float> logits(static_cast<size_t>(m.config().vocab_size));
  SequenceState* seqs[] = {&s};
  const int32_t tok = 3;
  try {
    ex.step(seqs, std::span(&tok, 1), logits.data());
    FAIL() << "the stalled step did not fail";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("stuck"));
    EXPECT_THAT(e.what(), HasSubstr("stalled (test hook)"));
  }
  ex.edit_instr_for_testing(1, id, [](plan::Instr& in) { in.flags &= ~plan::kFlagTestStall; });
  SequenceState s2 = ex.new_sequence();
  SequenceState* seqs2[] = {&s2};
  EXPECT_NO_THROW(ex.step(seqs2, std::span(&tok, 1), logits.data()));
}

SIM_AND_GPU_TEST(WatchdogReportsAStalledTile, 3, watchdog_reports_a_stalled_tile)

// The draw the sample tile makes, written plainly: sampler.cpp's candidate sets (top-k by
// (x desc, id asc), the smallest best-first top-p prefix, min-p), then the token where u * mass
// falls, scanning the kept set in id order (the CPU scans in its partition order: the same
// distribution, another order).
int32_t reference_draw(const SampleRow& r, std::vector<float> l) {
  apply_penalties(r, l);
  const int64_t V = int64_t(l.size());
  if (r.greedy()) return int32_t(std::max_element(l.begin(), l.end()) - l.begin());
  const float inv_t = 1.0f / r.temperature;
  std::vector<int> order(static_cast<size_t>(V));
  for (int i = 0; i < V; ++i) order[size_t(i)] = i;
  auto x = [&](int i) { return l[size_t(i)] * inv_t; };
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return x(a) > x(b) || (x(a) == x(b) && a < b); });
  const float mx = x(order[0]);
  const int64_t k = r.top_k > 0 && r.top_k < V ? r.top_k : V;
  order.resize(size_t(k));
  if (r.top_p < 1.0f) {
    double z = 0;
    for (int i : order) z += double(std::exp(x(i) - mx));
    double acc = 0;
    size_t keep = order.size();
    for (size_t j = 0; j < order.size(); ++j) {
      acc += double(std::exp(x(order[j]) - mx));
      if (acc >= double(r.top_p) * z) {
        keep = j + 1;
        break;
      }
    }
    order.resize(keep);
  }
  std::sort(order.begin(), order.end());
  double total = 0;
  for (int i : order)
    if (std::exp(x(i) - mx) >= r.min_p) total += double(std::exp(x(i) - mx));
  double u = r.uniform * total;
  int32_t last = order[0];
  for (int i : order) {
    const float w = std::exp(x(i) - mx);
    if (w < r.min_p) continue;
    last = i;
    u -= w;
    if (u < 0) break;
  }
  return last;
}

// Sampling on the device: penalties, temperature, top-k, top-p and min-p rows beside greedy
// ones; both executors draw the same tokens, and the tokens are those of the plain reference
// draw above over the returned logits.
void sampling_on_the_device(CudaTarget target) {
  Model m(model("tiny"), opts(Precision::BF16));
  const int64_t V = m.config().vocab_size;
  const int B = 4;
  CudaExecutor emk(m, B, ExecutorKind::kMegakernel, target);
  CudaExecutor eob(m, B, ExecutorKind::kOpByOp, target);
  std::vector<SequenceState> mk, ob;
  for (int b = 0; b < B; ++b) {
    mk.push_back(emk.new_sequence());
    ob.push_back(eob.new_sequence());
  }
  const std::vector<PenaltyCount> pens = {{3, 2}, {11, 0}, {17, 1}, {40, 3}};
  int drawn = 0, off_greedy = 0;
  for (int step = 0; step < 10; ++step) {
    std::vector<SampleRow> rows(B);
    rows[0] = SampleRow{};  // greedy
    rows[1].temperature = 0.8f;
    rows[1].top_k = 7;
    rows[1].uniform = (step * 0.137) - std::floor(step * 0.137);
    rows[2].temperature = 1.3f;
    rows[2].top_p = 0.6f;
    rows[2].min_p = 0.05f;
    rows[2].uniform = (0.5 + step * 0.291) - std::floor(0.5 + step * 0.291);
    rows[3].temperature = step % 2 ? 0.0f : 1.0f;  // greedy with penalties, then a full draw
    rows[3].repetition_penalty = 1.3f;
    rows[3].frequency_penalty = 0.4f;
    rows[3].presence_penalty = 0.2f;
    rows[3].penalties = pens.data();
    rows[3].num_penalties = uint32_t(pens.size());
    rows[3].top_k = 30;
    rows[3].top_p = 0.9f;
    rows[3].uniform = (0.25 + step * 0.173) - std::floor(0.25 + step * 0.173);
    std::vector<int32_t> tokens;
    std::vector<SequenceState*> pm, po;
    for (int b = 0; b < B; ++b) {
      tokens.push_back(int32_t((b * 13 + step * 7 + 1) % (V - 1)));
      pm.push_back(&mk[size_t(b)]);
      po.push_back(&ob[size_t(b)]);
    }
    std::vector<float> lm(size_t(B) * size_t(V)), lo(size_t(B) * size_t(V));
    std::vector<int32_t> nm(size_t(B), -1), no(size_t(B), -1);
    emk.step(pm, tokens, lm.data(), nm.data(), rows);
    eob.step(po, tokens, lo.data(), no.data(), rows);
    for (int b = 0; b < B; ++b) {
      EXPECT_EQ(nm[size_t(b)], no[size_t(b)]) << "step " << step << " row " << b;
      const std::vector<float> row(lm.begin() + b * V, lm.begin() + (b + 1) * V);
      const int32_t want = reference_draw(rows[size_t(b)], row);
      EXPECT_EQ(nm[size_t(b)], want) << "step " << step << " row " << b;
      if (!rows[size_t(b)].greedy()) {
        ++drawn;
        off_greedy += want != int32_t(std::max_element(row.begin(), row.end()) - row.begin());
      }
    }
  }
  EXPECT_GT(drawn, 0);
  EXPECT_GT(off_greedy, 0) << "no draw left the argmax: the test cannot tell a draw from greedy";
}

SIM_AND_GPU_TEST(SamplingOnTheDevice, 4, sampling_on_the_device)

// A step that asks only for the drawn tokens (logits null, next_ids set): the CPU, reference and
// CUDA executors return the greedy tokens of the same step with logits, and without next_ids either
// the call is an error naming the problem.
TEST(CudaSim, TokensOnlyStep) {
  SimConfig sc(4);
  Model m(model("tiny"), opts(Precision::BF16));
  const int64_t V = m.config().vocab_size;
  ExecutorOptions cpu;
  cpu.workers = 2;
  std::vector<std::unique_ptr<Executor>> exs;
  exs.push_back(make_executor(m, ExecutorKind::kMegakernel, 2, cpu));
  exs.push_back(std::make_unique<ReferenceExecutor>(m, 2));
  exs.push_back(std::make_unique<CudaExecutor>(m, 2, ExecutorKind::kMegakernel, CudaTarget::kSim));
  exs.push_back(std::make_unique<CudaExecutor>(m, 2, ExecutorKind::kOpByOp, CudaTarget::kSim));
  for (auto& ex : exs) {
    SCOPED_TRACE(std::string(ex->name()));
    std::vector<SequenceState> a, b;
    for (int i = 0; i < 2; ++i) {
      a.push_back(ex->new_sequence());
      b.push_back(ex->new_sequence());
    }
    std::vector<SequenceState*> pa = {&a[0], &a[1]}, pb = {&b[0], &b[1]};
    std::vector<int32_t> ta = {4, 90}, tb = ta;
    std::vector<float> logits(size_t(2 * V));
    for (int step = 0; step < 3; ++step) {
      std::vector<int32_t> ids(2, -1);
      ex->step(pa, ta, logits.data());
      ex->step(pb, tb, nullptr, ids.data());
      for (int i = 0; i < 2; ++i) {
        const float* l = logits.data() + size_t(i) * size_t(V);
        ta[size_t(i)] = int32_t(std::max_element(l, l + V) - l);
        EXPECT_EQ(ids[size_t(i)], ta[size_t(i)]) << "step " << step << " row " << i;
      }
      tb = ids;
    }
    try {
      ex->step(pa, ta, nullptr);
      FAIL() << "a step returning nothing was accepted";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("no logits buffer"));
    }
  }
}

TEST(CudaSim, GpuTargetWithoutAGpuIsAClearError) {
  Model m(model("tiny"), opts(Precision::BF16));
  try {
    CudaExecutor ex(m, 1, ExecutorKind::kOpByOp, CudaTarget::kGpu);
    GTEST_SKIP() << "a CUDA device is present: " << ex.device_name();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("no CUDA device"));
  }
}

}  // namespace
}  // namespace md
