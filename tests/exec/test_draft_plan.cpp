// The DSpark draft as a plan (plan::compile_draft_plan, Executor::draft_step): valid plans for
// every shape, bad shapes and inputs rejected, and on both CPU executors the draft steps give
// bit for bit what DraftModel's forward gives (rings, hidden rows, base and biased logits,
// drafts) for batches of sequences with different contexts, with ring wrap-around, in BF16 and
// FP32; a plan-run DSpark drafter keeps speculative greedy decoding exact, alone and batched.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "exec/exec_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/base/xoshiro.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/model/presets.h"
#include "megadecode/plan/plan.h"
#include "megadecode/spec/dspark_drafter.h"
#include "megadecode/spec/speculative.h"
#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

std::string golden(const std::string& name) {
  return test::data_dir() + "/data/golden/" + name;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A random draft for the target (window: the ring size; 0 keeps the default 2048).
void write_draft(const std::string& dir, const ModelConfig& target, int window, uint64_t seed) {
  DraftConfig d = draft_config_for_target(target);
  if (window > 0) d.window = window;
  ThreadPool pool(2, false);
  make_random_draft(d, dir, seed, pool);
}

std::vector<float> random_aux(const DraftConfig& c, int rows, uint64_t seed) {
  Xoshiro256 rng(seed);
  std::vector<float> v(size_t(rows) * size_t(c.context_width()));
  for (float& x : v) x = float(rng.uniform(-2.0, 2.0));  // not bf16: the cast is tested too
  return v;
}

TEST(DraftPlan, CompilesValidPlansForEveryShape) {
  for (const char* preset : {"tiny", "k3-tiny", "small"}) {
    const DraftConfig d = draft_config_for_target(preset_config(preset));
    for (auto [B, C, G] : {std::tuple{1, 8, 8}, {3, 16, 4}, {2, 0, 7}, {1, 5, 0}, {4, 64, 16}})
      for (int W : {1, 2, 3, 5})
        for (plan::Scheduler s : {plan::Scheduler::kPhases, plan::Scheduler::kList}) {
          plan::PlanOptions o;
          o.batch = B;
          o.rows = G;
          o.workers = W;
          o.scheduler = s;
          const plan::Plan p = plan::compile_draft_plan(d, o, C);
          const std::vector<std::string> errs = plan::validate_plan(p);
          EXPECT_TRUE(errs.empty()) << preset << " B=" << B << " C=" << C << " G=" << G
                                    << " W=" << W << ": " << errs.front();
          EXPECT_TRUE(p.draft.on);
          EXPECT_EQ(p.draft.drafts != plan::kNone, G > 0);
          EXPECT_EQ(p.draft.aux != plan::kNone, C > 0);
          // Every layer's ring is written when there are context rows, read when a block runs.
          int writes = 0, attn = 0, picks = 0;
          for (const plan::Instr& in : p.instrs) {
            writes += in.op == plan::Op::kDraftCtxWrite;
            attn += in.op == plan::Op::kDraftAttn;
            picks += in.op == plan::Op::kDraftPick;
          }
          EXPECT_EQ(writes, C > 0 ? B * d.num_layers : 0);
          EXPECT_EQ(attn > 0, G > 0);
          EXPECT_EQ(picks >= G, true);
        }
  }
}

TEST(DraftPlan, BadShapesAreErrors) {
  DraftConfig d = draft_config_for_target(preset_config("tiny"));
  plan::PlanOptions o;
  o.rows = 17;
  EXPECT_THAT(error_of([&] { plan::compile_draft_plan(d, o, 4); }), HasSubstr("block rows 17"));
  o.rows = 4;
  EXPECT_THAT(error_of([&] { plan::compile_draft_plan(d, o, 65); }),
              HasSubstr("context rows 65"));
  o.rows = 0;
  EXPECT_THAT(error_of([&] { plan::compile_draft_plan(d, o, 0); }),
              HasSubstr("neither context rows nor a block"));
  d.window = 8;
  o.rows = 4;
  EXPECT_THAT(error_of([&] { plan::compile_draft_plan(d, o, 16); }),
              HasSubstr("exceed the draft's window of 8"));
}

// Sequences with different histories: each one's context rows go in through draft steps (in
// chunks of up to `chunk` rows, the last with the block) and through DraftModel's update_context,
// then both draft; everything must agree bit for bit.
void check_against_draft_model(const std::string& preset, Precision prec, ExecutorKind kind,
                               int window, const std::vector<int>& history, int G, int chunk) {
  SCOPED_TRACE(preset + (prec == Precision::BF16 ? " bf16 " : " fp32 ") +
               std::string(executor_name(kind)) + " window " + std::to_string(window) +
               " G " + std::to_string(G));
  Model m(golden(preset), test::opts(prec));
  test::TempDir dir("draft_plan");
  write_draft(dir.path(), m.config(), window, 11);
  DraftModel draft(dir.path(), m.config(), test::opts(prec));
  const DraftConfig& c = draft.config();
  CpuExecutor ex(m, 4, 3, kind);
  ex.attach_draft(c, draft.weights());
  const int B = int(history.size());
  const int64_t CW = c.context_width(), V = c.vocab_size, D = c.hidden_size;
  std::vector<DraftState> host, plan;
  std::vector<std::vector<float>> aux;
  for (int b = 0; b < B; ++b) {
    host.push_back(draft.new_state());
    plan.push_back(draft.new_state());
    aux.push_back(random_aux(c, history[size_t(b)], 100 + uint64_t(b)));
  }
  // Host: all rows at once (update_context takes any count).
  for (int b = 0; b < B; ++b) {
    std::vector<int32_t> pos(size_t(history[size_t(b)]));
    for (size_t i = 0; i < pos.size(); ++i) pos[i] = int32_t(i);
    draft.update_context(host[size_t(b)], aux[size_t(b)], pos);
  }
  // Plan: context-only steps of `chunk` rows for every sequence together, then the block step
  // with the last rows.
  const size_t nb = static_cast<size_t>(B);
  std::vector<int> done(nb, 0);
  std::vector<std::vector<int32_t>> pos_of(nb), tokens(nb, std::vector<int32_t>(static_cast<size_t>(G)));
  std::vector<std::vector<float>> hid(nb), base(nb), biased(nb);
  for (bool last = false; !last;) {
    last = true;
    std::vector<DraftStepSeq> qs(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) {
      const int left = history[size_t(b)] - done[size_t(b)];
      const int n = std::min(left, chunk);
      if (left > chunk) last = false;
      pos_of[size_t(b)].resize(size_t(n));
      for (int i = 0; i < n; ++i) pos_of[size_t(b)][size_t(i)] = done[size_t(b)] + i;
      DraftStepSeq& q = qs[size_t(b)];
      DraftState& s = plan[size_t(b)];
      q.ring = {s.keys.data(), s.values.data(), s.positions.data()};
      q.ctx_aux = std::span<const float>(aux[size_t(b)]).subspan(size_t(done[size_t(b)]) * size_t(CW),
                                                                 size_t(n) * size_t(CW));
      q.ctx_positions = pos_of[size_t(b)];
      done[size_t(b)] += n;
    }
    if (last) {
      for (int b = 0; b < B; ++b) {
        DraftStepSeq& q = qs[size_t(b)];
        q.anchor = int32_t((b * 37 + 5) % V);
        q.anchor_position = history[size_t(b)];
        q.tokens = tokens[size_t(b)];
        hid[size_t(b)].assign(size_t(G) * size_t(D), 0.0f);
        base[size_t(b)].assign(size_t(G) * size_t(V), 0.0f);
        biased[size_t(b)].assign(size_t(G) * size_t(V), 0.0f);
        q.hidden = hid[size_t(b)].data();
        q.base_logits = base[size_t(b)].data();
        q.biased_logits = biased[size_t(b)].data();
      }
    }
    ex.draft_step(qs);
  }
  for (int b = 0; b < B; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    EXPECT_EQ(plan[size_t(b)].positions, host[size_t(b)].positions);
    test::expect_same_bits(plan[size_t(b)].keys.data(), host[size_t(b)].keys.data(),
                           host[size_t(b)].keys.size(), "ring keys");
    test::expect_same_bits(plan[size_t(b)].values.data(), host[size_t(b)].values.data(),
                           host[size_t(b)].values.size(), "ring values");
    std::vector<int32_t> want(static_cast<size_t>(G));
    std::vector<float> h(size_t(G) * size_t(D)), bl(size_t(G) * size_t(V)), bb(size_t(G) * size_t(V));
    draft.draft(host[size_t(b)], int32_t((b * 37 + 5) % V), history[size_t(b)], want,
                DraftOutputs{h.data(), bl.data(), bb.data()});
    EXPECT_EQ(tokens[size_t(b)], want);
    test::expect_same_bits(hid[size_t(b)].data(), h.data(), h.size(), "hidden rows");
    test::expect_same_bits(base[size_t(b)].data(), bl.data(), bl.size(), "base logits");
    test::expect_same_bits(biased[size_t(b)].data(), bb.data(), bb.size(), "biased logits");
  }
}

TEST(DraftPlan, DraftsWhatDraftModelDraftsBitForBit) {
  // Three sequences of different lengths (one empty: no context), blocks of 8, context steps
  // of up to 16 rows (so several steps, and sequences that run out of rows early).
  for (ExecutorKind k : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
    check_against_draft_model("tiny", Precision::BF16, k, 0, {23, 0, 9}, 8, 16);
    check_against_draft_model("k3-tiny", Precision::BF16, k, 0, {5, 17}, 8, 16);
  }
  check_against_draft_model("tiny", Precision::FP32, ExecutorKind::kMegakernel, 0, {12, 30}, 5,
                            64);
  check_against_draft_model("small", Precision::BF16, ExecutorKind::kMegakernel, 0, {40}, 16, 64);
}

TEST(DraftPlan, RingWrapsAroundItsWindow) {
  // A window of 16: 45 rows wrap the ring twice; only the last 16 positions stay visible.
  check_against_draft_model("tiny", Precision::BF16, ExecutorKind::kMegakernel, 16, {45, 20}, 7,
                            16);
  check_against_draft_model("k3-tiny", Precision::FP32, ExecutorKind::kOpByOp, 16, {33}, 4, 8);
}

TEST(DraftPlan, BadInputIsAnErrorBeforeAnythingChanges) {
  Model m(golden("tiny"), test::opts(Precision::BF16));
  test::TempDir dir("draft_plan_bad");
  write_draft(dir.path(), m.config(), 0, 3);
  DraftModel draft(dir.path(), m.config(), test::opts(Precision::BF16));
  CpuExecutor ex(m, 2, 2, ExecutorKind::kMegakernel);
  DraftState s = draft.new_state(), s2 = draft.new_state();
  std::vector<int32_t> out(4), out3(3);
  DraftStepSeq q;
  q.ring = {s.keys.data(), s.values.data(), s.positions.data()};
  q.tokens = out;
  EXPECT_THAT(error_of([&] { ex.draft_step(std::span(&q, 1)); }), HasSubstr("no draft is attached"));
  ex.attach_draft(draft.config(), draft.weights());
  const std::vector<float> aux = random_aux(draft.config(), 2, 1);
  const std::vector<int32_t> pos = {0, 1}, neg = {0, -1};
  q.ctx_aux = aux;
  q.ctx_positions = std::span<const int32_t>(pos).subspan(0, 1);
  EXPECT_THAT(error_of([&] { ex.draft_step(std::span(&q, 1)); }), HasSubstr("aux values"));
  q.ctx_positions = neg;
  EXPECT_THAT(error_of([&] { ex.draft_step(std::span(&q, 1)); }), HasSubstr("context position -1"));
  q.ctx_positions = pos;
  q.anchor = int32_t(m.config().vocab_size);
  EXPECT_THAT(error_of([&] { ex.draft_step(std::span(&q, 1)); }), HasSubstr("outside the vocabulary"));
  q.anchor = 1;
  DraftStepSeq q2 = q;
  q2.ring = {s2.keys.data(), s2.values.data(), s2.positions.data()};
  q2.tokens = out3;
  const DraftStepSeq two[2] = {q, q2};
  EXPECT_THAT(error_of([&] { ex.draft_step(two); }), HasSubstr("a step's blocks are equal"));
  q2.tokens = out;
  q2.ring = q.ring;
  const DraftStepSeq same[2] = {q, q2};
  EXPECT_THAT(error_of([&] { ex.draft_step(same); }), HasSubstr("share a ring"));
  const DraftStepSeq three[3] = {q, q, q};
  EXPECT_THAT(error_of([&] { ex.draft_step(three); }), HasSubstr("3 sequences"));
  // Nothing was written.
  for (int32_t p : s.positions) EXPECT_EQ(p, -1);
  // Against a draft of another hidden size.
  test::TempDir other("draft_plan_other");
  write_draft(other.path(), preset_config("small"), 0, 3);
  DraftModel od(other.path(), preset_config("small"), test::opts(Precision::BF16));
  EXPECT_THAT(error_of([&] { ex.attach_draft(od.config(), od.weights()); }),
              HasSubstr("does not fit the target"));
}

std::vector<int32_t> prompt_of(const Model& m, int n, int salt) {
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> ids(size_t(n), 0);
  for (int t = 0; t < n; ++t) ids[size_t(t)] = int32_t((salt * 131 + t * 17 + 5) % (V - 1));
  return ids;
}

int32_t argmax(const std::vector<float>& l) {
  int32_t b = 0;
  for (size_t i = 1; i < l.size(); ++i)
    if (l[i] > l[size_t(b)]) b = int32_t(i);
  return b;
}

// Speculative greedy decoding of sequences side by side, batched (step_batch), with DSpark
// drafters on the executor and on the host: the same tokens as plain greedy decoding, the same
// drafts step by step (equal acceptance counts), and equal rings at the end.
TEST(DraftPlan, SpeculativeDecodingWithThePlanDraftIsExact) {
  for (const char* name : {"tiny", "k3-tiny"}) {
    for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
      SCOPED_TRACE(std::string(name) + " " + std::string(executor_name(kind)));
      Model m(golden(name), test::opts(Precision::BF16));
      test::TempDir dir("draft_plan_spec");
      write_draft(dir.path(), m.config(), 0, 5);
      DraftModel draft(dir.path(), m.config(), test::opts(Precision::BF16));
      CpuExecutor ex(m, 3, 2, kind);
      const int B = 3, n = 24;
      SpeculativeOptions o;
      o.num_draft_tokens = 5;
      // Plain greedy references.
      std::vector<std::vector<int32_t>> prompts, want;
      std::vector<float> logits(size_t(m.config().vocab_size));
      for (int b = 0; b < B; ++b) {
        prompts.push_back(prompt_of(m, 9 + 7 * b, b + 1));
        SequenceState s = ex.new_sequence();
        ex.prefill(s, prompts.back(), logits.data());
        std::vector<int32_t> t = {argmax(logits)};
        SequenceState* p = &s;
        while (int(t.size()) < n) {
          int32_t next = -1;
          ex.step(std::span(&p, 1), std::span(&t.back(), 1), nullptr, &next);
          t.push_back(next);
        }
        want.push_back(t);
      }
      std::vector<DraftState> exec_rings;  // the executor run's (first), for the host run
      int64_t exec_accepted = -1;
      for (bool on_executor : {true, false}) {
        SCOPED_TRACE(on_executor ? "draft on the executor" : "draft on the host");
        SpeculativeDecoder dec(ex, draft.config().aux_layer_ids, o);
        std::vector<std::unique_ptr<DSparkDrafter>> ds;
        std::vector<SequenceState> seqs;
        std::vector<std::vector<int32_t>> hist(static_cast<size_t>(B)), got(static_cast<size_t>(B));
        for (int b = 0; b < B; ++b) {
          ds.push_back(std::make_unique<DSparkDrafter>(draft, on_executor ? &ex : nullptr));
          EXPECT_EQ(ds.back()->on_executor(), on_executor);
          seqs.push_back(ex.new_sequence());
          SpeculativeDecoder one(ex, *ds.back(), o);
          one.prefill(seqs.back(), prompts[size_t(b)], logits.data());
          hist[size_t(b)] = prompts[size_t(b)];
          hist[size_t(b)].push_back(argmax(logits));
          got[size_t(b)].push_back(hist[size_t(b)].back());
        }
        std::vector<Drafter*> dp;
        for (auto& d : ds) dp.push_back(d.get());
        test::speculate_batch(dec, seqs, hist, got, dp, n, 40);
        for (int b = 0; b < B; ++b) EXPECT_EQ(got[size_t(b)], want[size_t(b)]) << "sequence " << b;
        for (auto& d : ds) d->flush();
        if (on_executor) {
          exec_rings.clear();
          for (auto& d : ds) exec_rings.push_back(d->state());
          exec_accepted = dec.stats().accepted;
        } else {
          // The executor run (first) and the host run drafted the same tokens and built the
          // same rings.
          EXPECT_EQ(dec.stats().accepted, exec_accepted);
          for (int b = 0; b < B; ++b) {
            EXPECT_EQ(exec_rings[size_t(b)].positions, ds[size_t(b)]->state().positions);
            EXPECT_EQ(exec_rings[size_t(b)].rows_written, ds[size_t(b)]->state().rows_written);
            test::expect_same_bits(exec_rings[size_t(b)].keys.data(),
                                   ds[size_t(b)]->state().keys.data(),
                                   exec_rings[size_t(b)].keys.size(), "ring keys");
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace md
