// The draft plans on the CUDA executors, through the host simulation (Executor::draft_step,
// kernels/cuda/tiles_draft.cuh), with rings in the executor's memory (new_draft_ring):
//  * cuda-megakernel and cuda-opbyop agree bit for bit (rings, hidden rows, base and biased
//    logits, drafts), for batches of sequences with different contexts, context steps of up to
//    16 rows, and a window that wraps;
//  * against DraftModel's host forward, FP32: every ring value, hidden row and logit within
//    1e-4 of its vector's scale (the fp32 reordering bound of test_cuda_sim.cpp: the tiles' GEMVs
//    and norms sum in the block's order), and the drafts equal the host's up to the first slot
//    whose top two biased logits are closer than 1e-3 of their scale (a tie the reordering may
//    break either way; later slots follow from it). BF16: the drafts, under the same rule with
//    2^-6 (a bf16 rounding point can flip, as in test_cuda_sim.cpp's BF16 checks);
//  * speculative greedy decoding with the draft on the CUDA executor emits plain greedy
//    decoding's tokens on that executor.
// CudaGpu.DraftsAsTheHostDraftModelDoes and CudaGpu.SpeculativeDecodingWithTheDraftOnTheDevice*
// are the same checks on a GPU (skipped, saying why, without one; bench/gpu-check.sh runs them).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "../exec/exec_test_util.h"
#include "cuda_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/base/xoshiro.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cuda/sim.h"
#include "megadecode/model/presets.h"
#include "megadecode/spec/dspark_drafter.h"
#include "megadecode/spec/speculative.h"
#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

using test::SimConfig;

std::string golden(const std::string& name) {
  return test::data_dir() + "/data/golden/" + name;
}

void write_draft(const std::string& dir, const ModelConfig& target, int window, uint64_t seed) {
  DraftConfig d = draft_config_for_target(target);
  if (window > 0) d.window = window;
  ThreadPool pool(2, false);
  make_random_draft(d, dir, seed, pool);
}

std::vector<float> random_aux(const DraftConfig& c, int rows, uint64_t seed) {
  Xoshiro256 rng(seed);
  std::vector<float> v(size_t(rows) * size_t(c.context_width()));
  for (float& x : v) x = float(rng.uniform(-2.0, 2.0));
  return v;
}

// One executor's results for every sequence.
struct DraftRun {
  std::vector<std::vector<float>> keys, values, hidden, base, biased;
  std::vector<std::vector<int32_t>> positions, drafts;
};

// Sequences with the given histories: their context rows in draft steps of up to `chunk` rows
// (the last with a block of G), rings from the executor.
DraftRun run_draft(Executor& ex, const DraftModel& draft, const std::vector<int>& history, int G,
                   int chunk) {
  const DraftConfig& c = draft.config();
  ex.attach_draft(c, draft.weights());
  const size_t B = history.size();
  const int64_t CW = c.context_width(), V = c.vocab_size, D = c.hidden_size;
  std::vector<std::unique_ptr<DraftRingMemory>> rings;
  std::vector<std::vector<float>> aux;
  for (size_t b = 0; b < B; ++b) {
    rings.push_back(ex.new_draft_ring(c));
    aux.push_back(random_aux(c, history[b], 100 + b));
  }
  DraftRun out;
  out.drafts.assign(B, std::vector<int32_t>(size_t(G)));
  out.hidden.assign(B, std::vector<float>(size_t(G) * size_t(D)));
  out.base.assign(B, std::vector<float>(size_t(G) * size_t(V)));
  out.biased.assign(B, std::vector<float>(size_t(G) * size_t(V)));
  std::vector<int> done(B, 0);
  std::vector<std::vector<int32_t>> pos_of(B);
  for (bool last = false; !last;) {
    last = true;
    std::vector<DraftStepSeq> qs(B);
    for (size_t b = 0; b < B; ++b) {
      const int left = history[b] - done[b], n = std::min(left, chunk);
      if (left > chunk) last = false;
      pos_of[b].resize(size_t(n));
      for (int i = 0; i < n; ++i) pos_of[b][size_t(i)] = done[b] + i;
      DraftStepSeq& q = qs[b];
      q.ring = rings[b]->ring();
      q.ctx_aux = std::span<const float>(aux[b]).subspan(size_t(done[b]) * size_t(CW),
                                                         size_t(n) * size_t(CW));
      q.ctx_positions = pos_of[b];
      done[b] += n;
    }
    if (last)
      for (size_t b = 0; b < B; ++b) {
        DraftStepSeq& q = qs[b];
        q.anchor = int32_t((b * 37 + 5) % size_t(V));
        q.anchor_position = history[b];
        q.tokens = out.drafts[b];
        q.hidden = out.hidden[b].data();
        q.base_logits = out.base[b].data();
        q.biased_logits = out.biased[b].data();
      }
    ex.draft_step(qs);
  }
  out.keys.resize(B);
  out.values.resize(B);
  out.positions.resize(B);
  for (size_t b = 0; b < B; ++b) rings[b]->read(out.keys[b], out.values[b], out.positions[b]);
  return out;
}

// Every element of got within tol of want's scale (its largest magnitude).
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0, worst = 0;
  for (float x : want) scale = std::max(scale, double(std::fabs(x)));
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::fabs(double(got[i]) - double(want[i])));
  EXPECT_LE(worst, tol * std::max(scale, 1e-30)) << what << ": scale " << scale;
}

// The host's drafts and the slots whose choice is clear: slot k's top two biased logits are
// more than margin * scale apart (its first unclear slot ends the comparison).
int clear_slots(const std::vector<float>& biased, int64_t V, int G, double margin) {
  for (int k = 0; k < G; ++k) {
    const float* row = biased.data() + int64_t(k) * V;
    float a = -INFINITY, b = -INFINITY, scale = 0;
    for (int64_t i = 0; i < V; ++i) {
      scale = std::max(scale, std::fabs(row[i]));
      if (row[i] > a) {
        b = a;
        a = row[i];
      } else if (row[i] > b) {
        b = row[i];
      }
    }
    if (double(a) - double(b) <= margin * double(scale)) return k;
  }
  return G;
}

void check_draft(const std::string& preset, Precision prec, int window,
                 const std::vector<int>& history, int G, int chunk,
                 CudaTarget target = CudaTarget::kSim) {
  SCOPED_TRACE(preset + (prec == Precision::BF16 ? " bf16" : " fp32") + " window " +
               std::to_string(window));
  SimConfig sc(4);
  Model m(golden(preset), test::opts(prec));
  test::TempDir dir("cuda_draft");
  write_draft(dir.path(), m.config(), window, 11);
  DraftModel draft(dir.path(), m.config(), test::opts(prec));
  const DraftConfig& c = draft.config();
  const int64_t V = c.vocab_size, CW = c.context_width();
  CudaExecutor mk(m, 4, ExecutorKind::kMegakernel, target);
  CudaExecutor ob(m, 4, ExecutorKind::kOpByOp, target);
  const DraftRun a = run_draft(mk, draft, history, G, chunk);
  const DraftRun b = run_draft(ob, draft, history, G, chunk);
  for (size_t s = 0; s < history.size(); ++s) {
    SCOPED_TRACE("sequence " + std::to_string(s));
    // The two CUDA executors: the same tiles, the same bits.
    EXPECT_EQ(a.positions[s], b.positions[s]);
    EXPECT_EQ(a.drafts[s], b.drafts[s]);
    test::expect_same_bits(a.keys[s].data(), b.keys[s].data(), a.keys[s].size(), "ring keys");
    test::expect_same_bits(a.values[s].data(), b.values[s].data(), a.values[s].size(),
                           "ring values");
    test::expect_same_bits(a.hidden[s].data(), b.hidden[s].data(), a.hidden[s].size(), "hidden");
    test::expect_same_bits(a.biased[s].data(), b.biased[s].data(), a.biased[s].size(), "biased");
    // The host forward.
    DraftState host = draft.new_state();
    const std::vector<float> aux = random_aux(c, history[s], 100 + s);
    std::vector<int32_t> pos(size_t(history[s]));
    for (size_t i = 0; i < pos.size(); ++i) pos[i] = int32_t(i);
    draft.update_context(host, std::span<const float>(aux).first(pos.size() * size_t(CW)), pos);
    std::vector<int32_t> want(static_cast<size_t>(G));
    std::vector<float> h(a.hidden[s].size()), bl(a.base[s].size()), bb(a.biased[s].size());
    draft.draft(host, int32_t((s * 37 + 5) % size_t(V)), history[s], want,
                DraftOutputs{h.data(), bl.data(), bb.data()});
    EXPECT_EQ(a.positions[s], host.positions);
    const int clear = clear_slots(bb, V, G, prec == Precision::FP32 ? 1e-3 : 1.0 / 64);
    for (int k = 0; k < clear; ++k) EXPECT_EQ(a.drafts[s][size_t(k)], want[size_t(k)]) << "slot " << k;
    if (prec == Precision::FP32) {
      expect_close(a.keys[s], host.keys, 1e-4, "ring keys");
      expect_close(a.values[s], host.values, 1e-4, "ring values");
      expect_close(a.hidden[s], h, 1e-4, "hidden rows");
      expect_close(a.base[s], bl, 1e-4, "base logits");
      // Up to the first unclear slot the previous tokens agree, so the biases do too.
      const size_t n = size_t(clear) * size_t(V);
      expect_close(std::vector<float>(a.biased[s].begin(), a.biased[s].begin() + int64_t(n)),
                   std::vector<float>(bb.begin(), bb.begin() + int64_t(n)), 1e-4, "biased logits");
    }
  }
}

TEST(CudaDraft, DraftsAsTheHostDraftModelDoes) {
  // Three sequences (one without context), blocks of 8, context steps of up to 16 rows.
  check_draft("tiny", Precision::FP32, 0, {23, 0, 9}, 8, 16);
  check_draft("tiny", Precision::BF16, 0, {23, 0, 9}, 8, 16);
  check_draft("k3-tiny", Precision::FP32, 0, {17, 5}, 6, 16);
}

TEST(CudaDraft, RingWrapsAroundItsWindow) {
  check_draft("tiny", Precision::FP32, 16, {45, 20}, 7, 16);
}

TEST(CudaGpu, DraftsAsTheHostDraftModelDoes) {
  MD_NEED_GPU();
  check_draft("tiny", Precision::FP32, 0, {23, 0, 9}, 8, 16, CudaTarget::kGpu);
  check_draft("tiny", Precision::BF16, 16, {45, 20}, 8, 16, CudaTarget::kGpu);
  check_draft("k3-tiny", Precision::FP32, 0, {17, 5}, 6, 16, CudaTarget::kGpu);
}

TEST(CudaDraft, RingsAndBadInput) {
  SimConfig sc(2);
  Model m(golden("tiny"), test::opts(Precision::FP32));
  test::TempDir dir("cuda_draft_bad");
  write_draft(dir.path(), m.config(), 16, 3);
  DraftModel draft(dir.path(), m.config(), test::opts(Precision::FP32));
  CudaExecutor ex(m, 2, ExecutorKind::kMegakernel, CudaTarget::kSim);
  EXPECT_TRUE(ex.runs_drafts());
  std::unique_ptr<DraftRingMemory> ring = ex.new_draft_ring(draft.config());
  DraftStepSeq q;
  q.ring = ring->ring();
  std::vector<int32_t> out(4);
  q.tokens = out;
  try {
    ex.draft_step(std::span(&q, 1));
    ADD_FAILURE() << "a draft step before attach_draft";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("no draft is attached"));
  }
  ex.attach_draft(draft.config(), draft.weights());
  q.anchor = int32_t(m.config().vocab_size);
  try {
    ex.draft_step(std::span(&q, 1));
    ADD_FAILURE() << "an anchor outside the vocabulary";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("outside the vocabulary"));
  }
  // A fresh ring is empty; clear() empties a used one.
  std::vector<float> k, v;
  std::vector<int32_t> p;
  ring->read(k, v, p);
  EXPECT_EQ(p, std::vector<int32_t>(16, -1));
  const std::vector<float> aux = random_aux(draft.config(), 3, 1);
  const std::vector<int32_t> pos = {0, 1, 2};
  q.anchor = 1;
  q.anchor_position = 3;
  q.ctx_aux = aux;
  q.ctx_positions = pos;
  ex.draft_step(std::span(&q, 1));
  ring->read(k, v, p);
  EXPECT_EQ(std::vector<int32_t>(p.begin(), p.begin() + 4), (std::vector<int32_t>{0, 1, 2, -1}));
  ring->clear();
  ring->read(k, v, p);
  EXPECT_EQ(p, std::vector<int32_t>(16, -1));
  EXPECT_TRUE(std::all_of(k.begin(), k.end(), [](float x) { return x == 0.0f; }));
}

// Speculative greedy decoding on cuda-megakernel with the draft as plan steps on it, two
// sequences batched: plain greedy decoding's tokens on the same executor.
void check_speculative(CudaTarget target) {
  Model m(golden("tiny"), test::opts(Precision::BF16));
  test::TempDir dir("cuda_draft_spec");
  write_draft(dir.path(), m.config(), 0, 5);
  DraftModel draft(dir.path(), m.config(), test::opts(Precision::BF16));
  CudaExecutor ex(m, 2, ExecutorKind::kMegakernel, target);
  const int B = 2, n = 14;
  const int64_t V = m.config().vocab_size;
  SpeculativeOptions o;
  o.num_draft_tokens = 4;
  std::vector<std::vector<int32_t>> prompts, want;
  std::vector<float> logits(static_cast<size_t>(V));
  auto argmax = [&] { return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()); };
  for (int b = 0; b < B; ++b) {
    std::vector<int32_t> p;
    for (int t = 0; t < 7 + 5 * b; ++t) p.push_back(int32_t((b * 131 + t * 17 + 5) % (V - 1)));
    prompts.push_back(p);
    SequenceState s = ex.new_sequence();
    ex.prefill(s, p, logits.data());
    std::vector<int32_t> t = {argmax()};
    SequenceState* sp = &s;
    while (int(t.size()) < n) {
      int32_t next = -1;
      ex.step(std::span(&sp, 1), std::span(&t.back(), 1), nullptr, &next);
      t.push_back(next);
    }
    want.push_back(t);
  }
  SpeculativeDecoder dec(ex, draft.config().aux_layer_ids, o);
  std::vector<std::unique_ptr<DSparkDrafter>> ds;
  std::vector<SequenceState> seqs;
  std::vector<std::vector<int32_t>> hist(static_cast<size_t>(B)), got(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) {
    ds.push_back(std::make_unique<DSparkDrafter>(draft, &ex));
    EXPECT_TRUE(ds.back()->on_executor());
    seqs.push_back(ex.new_sequence());
    SpeculativeDecoder one(ex, *ds.back(), o);
    one.prefill(seqs.back(), prompts[size_t(b)], logits.data());
    hist[size_t(b)] = prompts[size_t(b)];
    hist[size_t(b)].push_back(argmax());
    got[size_t(b)].push_back(hist[size_t(b)].back());
  }
  std::vector<Drafter*> dp;
  for (auto& d : ds) dp.push_back(d.get());
  test::speculate_batch(dec, seqs, hist, got, dp, n, 3 * n);
  for (int b = 0; b < B; ++b) EXPECT_EQ(got[size_t(b)], want[size_t(b)]) << "sequence " << b;
  // The rings hold the committed positions (a host copy read back from the executor).
  for (auto& d : ds) {
    d->flush();
    EXPECT_GT(d->state().rows_written, 0);
    EXPECT_EQ(d->state().positions[0], 0);
  }
}

TEST(CudaDraft, SpeculativeDecodingIsExact) {
  SimConfig sc(4);
  check_speculative(CudaTarget::kSim);
}

TEST(CudaGpu, SpeculativeDecodingWithTheDraftOnTheDeviceIsExact) {
  MD_NEED_GPU();
  check_speculative(CudaTarget::kGpu);
}

}  // namespace
}  // namespace md
