// The CPU executors against the reference path, bit for bit: megakernel and op-by-op, batches of
// 1, 2, 3 and 8 sequences at different positions (prefilled with different prompt lengths),
// sequences leaving and joining between steps, 1, 2, 3 and 5 workers (more than the CPUs), both
// precisions, random tiny/small checkpoints (Kimi Linear and Kimi K3) and the golden models. Then
// the watchdog and bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>

#include "exec/exec_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/base/threads.h"
#include "megadecode/base/util.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/model/presets.h"
#include "test_util.h"

namespace md {
namespace {

using test::expect_same_bits;
using test::expect_same_state;
using test::opts;
using ::testing::HasSubstr;

class Executor : public ::testing::Test {
 protected:
  // Random checkpoints shared by every test process (test::shared_checkpoint).
  static std::string model(const std::string& name) {
    const int seed = name == "tiny" ? 21 : name == "small" ? 22 : name == "k3-tiny" ? 23 : 24;
    return test::shared_checkpoint(name, uint64_t(seed));
  }
};

// Sequences prefilled through Model::forward with prompts of different lengths (0: fresh).
std::vector<SequenceState> prefilled(Model& m, int n) {
  const int64_t V = m.config().vocab_size;
  std::vector<SequenceState> out;
  for (int i = 0; i < n; ++i) {
    SequenceState s = m.new_sequence();
    const int len = (i * 7 + 3) % 19;  // 3, 10, 17, 5, 12, 0, 7, ...
    std::vector<int32_t> ids(static_cast<size_t>(len));
    for (int t = 0; t < len; ++t) ids[size_t(t)] = int32_t((i * 131 + t * 17 + 1) % (V - 1));
    if (len > 0) m.forward(s, ids, nullptr, false);
    out.push_back(std::move(s));
  }
  return out;
}

// Both executors step the same schedule of batches; every sequence's logits must equal, bit for
// bit, Model::forward decoding that sequence alone, and so must the states at the end.
void check_equivalence(Model& m, int workers, ExecutorOptions eo = {}) {
  const int64_t V = m.config().vocab_size;
  std::vector<SequenceState> ref = prefilled(m, 12);
  eo.workers = workers;
  CpuExecutor emk(m, 8, ExecutorKind::kMegakernel, eo);
  CpuExecutor eob(m, 8, ExecutorKind::kOpByOp, eo);
  std::vector<SequenceState> mk = test::copies(emk, ref), ob = test::copies(eob, ref);
  const std::vector<std::vector<int>> batches = {
      {0}, {0, 1},   {1, 2, 0}, {0, 1, 2, 3, 4, 5, 6, 7}, {2, 8, 5}, {9, 3, 10, 11, 4, 6, 7, 0},
      {8}, {11, 10}, {5, 1, 9}};
  std::vector<float> want(static_cast<size_t>(V));
  test::step_in_lockstep(
      emk, eob, mk, ob, batches, V,
      [&](int id, int step) { return int32_t((id * 37 + step * 101 + 7) % (V - 1)); },
      [&](const test::LockstepStep& t) {
        for (size_t b = 0; b < t.ids.size(); ++b) {
          m.forward(ref[size_t(t.ids[b])], std::span(&t.tokens[b], 1), want.data(), false);
          const std::string what = "W=" + std::to_string(workers) + " step " +
                                   std::to_string(t.step) + " seq " + std::to_string(t.ids[b]);
          // The plan's kSample tiles (no sampler: greedy, ties to the lowest id).
          const int32_t greedy = int32_t(std::max_element(want.begin(), want.end()) - want.begin());
          EXPECT_EQ(t.na[b], greedy) << "megakernel next id, " << what;
          EXPECT_EQ(t.nb[b], greedy) << "opbyop next id, " << what;
          expect_same_bits(t.la.data() + b * size_t(V), want.data(), size_t(V),
                           "megakernel " + what);
          expect_same_bits(t.lb.data() + b * size_t(V), want.data(), size_t(V), "opbyop " + what);
        }
        const StepStats& st = emk.last_step_stats();
        EXPECT_EQ(st.batch, int(t.ids.size()));
        EXPECT_GT(st.weight_bytes, 0);
      });
  for (size_t i = 0; i < ref.size(); ++i) {
    expect_same_state(mk[i], ref[i], "megakernel seq " + std::to_string(i));
    expect_same_state(ob[i], ref[i], "opbyop seq " + std::to_string(i));
  }
}

TEST_F(Executor, TinyBf16MatchesReferenceBitForBit) {
  Model m(model("tiny"), opts(Precision::BF16));
  for (int w : {1, 2, 3, 5}) check_equivalence(m, w);
}

TEST_F(Executor, TinyFp32MatchesReferenceBitForBit) {
  Model m(model("tiny"), opts(Precision::FP32));
  for (int w : {1, 2, 3, 5}) check_equivalence(m, w);
}

TEST_F(Executor, SmallBf16MatchesReferenceBitForBit) {
  Model m(model("small"), opts(Precision::BF16));
  for (int w : {1, 2, 3, 5}) check_equivalence(m, w);
}

TEST_F(Executor, SmallFp32MatchesReferenceBitForBit) {
  Model m(model("small"), opts(Precision::FP32));
  for (int w : {1, 2, 3, 5}) check_equivalence(m, w);
}

// Kimi K3 (block attention residuals, full-rank KDA gate and bounded decay, q LoRA and the MLA
// output gate, latent MoE with MXFP4 experts, SiTU): the same standard.
TEST_F(Executor, K3TinyBf16MatchesReferenceBitForBit) {
  Model m(model("k3-tiny"), opts(Precision::BF16));
  for (int w : {1, 2, 3, 5}) check_equivalence(m, w);
}

TEST_F(Executor, K3TinyFp32MatchesReferenceBitForBit) {
  Model m(model("k3-tiny"), opts(Precision::FP32));
  for (int w : {1, 2, 3, 5}) check_equivalence(m, w);
}

TEST_F(Executor, K3SmallBf16MatchesReferenceBitForBit) {
  Model m(model("k3-small"), opts(Precision::BF16));
  for (int w : {1, 2, 3, 5}) check_equivalence(m, w);
}

TEST_F(Executor, K3SmallFp32MatchesReferenceBitForBit) {
  Model m(model("k3-small"), opts(Precision::FP32));
  for (int w : {1, 2, 3, 5}) check_equivalence(m, w);
}

// Tiles far below the defaults: heads cut in parts, every matrix in many row blocks.
TEST_F(Executor, FineTilesMatchReference) {
  for (const char* name : {"small", "k3-small"}) {
    Model m(model(name), opts(Precision::BF16));
    ExecutorOptions eo;
    eo.plan.tile_bytes = 2048;
    eo.plan.min_tile_bytes = 0;
    for (int w : {2, 3}) check_equivalence(m, w, eo);
  }
}

// K3 variants the presets do not cover: bf16 experts, no latent norm, no shared expert, top-3
// of 8 (B * k > E from batch 3 on), plain MLA q (no q LoRA), unbounded decay, one layer per
// residual block.
TEST_F(Executor, K3OtherGeometryMatchesReference) {
  ModelConfig c = preset_config("k3-tiny");
  c.experts_mxfp4 = false;
  c.latent_norm = false;
  c.num_shared_experts = 0;
  c.num_experts_per_token = 3;
  c.q_lora_rank = 0;
  c.kda_bounded_decay = false;
  c.kda_gate_lower_bound = 0;
  c.attn_res_block_size = 1;
  test::TempDir d("exec_k3_geom");
  {
    ThreadPool pool(2, false);
    make_random_checkpoint(c, d.path(), 6, 1, pool);
  }
  for (Precision p : {Precision::BF16, Precision::FP32}) {
    Model m(d.path(), opts(p));
    for (int w : {1, 3}) check_equivalence(m, w);
  }
}

// The bytes a K3 step moves count each distinct expert once, its MXFP4 matrices at 4.25 bits
// per weight (codes + E8M0 scales), and the latent projections and gates with the fixed weights.
TEST_F(Executor, K3StepBytesCountMxfp4Experts) {
  Model m(model("k3-small"), opts(Precision::BF16));
  const ModelConfig& c = m.config();
  const std::vector<int64_t> pos = {3, 5};
  const StepStats a = decode_step_bytes(m, pos, 0), b = decode_step_bytes(m, pos, 7);
  const double expert = 3.0 * double(c.moe_intermediate_size) * double(c.latent_size) * 4.25 / 8;
  EXPECT_DOUBLE_EQ(b.weight_bytes - a.weight_bytes, 7 * expert);
  // Non-expert weights: every bf16 matrix but the embedding, plus two embedding rows.
  const ModelWeights& w = m.weights();
  double fixed = double(w.lm_head.bytes()) + 2.0 * double(c.hidden_size) * 2;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    for (const Mat* x :
         {&L.kda.q,           &L.kda.k,           &L.kda.v,           &L.kda.f_a,
          &L.kda.f_b,         &L.kda.b,           &L.kda.g,           &L.kda.o,
          &L.mla.q_a,         &L.mla.q_b,         &L.mla.g,           &L.mla.kv_a,
          &L.mla.kv_b,        &L.mla.o,           &L.dense.gate,      &L.dense.up,
          &L.dense.down,      &L.moe.router,      &L.moe.shared.gate, &L.moe.shared.up,
          &L.moe.shared.down, &L.moe.latent_down, &L.moe.latent_up})
      fixed += double(x->bytes());
  }
  EXPECT_DOUBLE_EQ(a.weight_bytes, fixed);
  // Run through an executor: the distinct experts of the step are counted from the router.
  CpuExecutor ex(m, 2, 2, ExecutorKind::kMegakernel);
  SequenceState s0 = ex.new_sequence(), s1 = ex.new_sequence();
  std::vector<SequenceState*> seqs = {&s0, &s1};
  std::vector<int32_t> toks = {5, 9};
  std::vector<float> logits(2 * size_t(c.vocab_size));
  ex.step(seqs, toks, logits.data());
  const StepStats& st = ex.last_step_stats();
  const int moe_layers = int(std::count(c.ffn_kind.begin(), c.ffn_kind.end(), FfnKind::MoE));
  EXPECT_GE(st.distinct_experts, moe_layers * c.num_experts_per_token);
  EXPECT_LE(st.distinct_experts, moe_layers * 2 * c.num_experts_per_token);
  EXPECT_DOUBLE_EQ(st.weight_bytes, fixed + st.distinct_experts * expert);
}

// Sampling inside the plan: each sequence's sampler draws from its logits in the kSample tile.
// Samplers with the same parameters and seed, fed the same logits and history outside the
// executor, must draw the same ids; both executors agree step by step.
TEST_F(Executor, SamplingInThePlanMatchesTheSamplerOutside) {
  Model m(model("small"), opts(Precision::BF16));
  const int64_t V = m.config().vocab_size;
  SamplingParams sp;
  sp.temperature = 0.9f;
  sp.top_p = 0.95f;
  sp.top_k = 50;
  sp.repetition_penalty = 1.1f;
  sp.frequency_penalty = 0.3f;
  const int B = 3;
  ExecutorOptions eo;
  eo.workers = 2;
  CpuExecutor emk(m, B, ExecutorKind::kMegakernel, eo);
  CpuExecutor eob(m, B, ExecutorKind::kOpByOp, eo);
  const std::vector<SequenceState> start = prefilled(m, B);
  std::vector<SequenceState> mk = test::copies(emk, start), ob = test::copies(eob, start);
  std::vector<Sampler> smk, sob, sref;
  std::vector<std::vector<int32_t>> hist(B);
  for (int b = 0; b < B; ++b) {
    sp.seed = 1000 + uint64_t(b);
    smk.emplace_back(sp, V);
    sob.emplace_back(sp, V);
    sref.emplace_back(sp, V);
    hist[size_t(b)] = {int32_t(b + 1), int32_t(2 * b + 5)};  // a "prompt"
  }
  std::vector<int32_t> tokens = {7, 8, 9};
  int differs_from_greedy = 0;
  for (int step = 0; step < 12; ++step) {
    std::vector<SequenceState*> pm, po;
    std::vector<SampleRow> qm, qo;
    for (int b = 0; b < B; ++b) {
      pm.push_back(&mk[size_t(b)]);
      po.push_back(&ob[size_t(b)]);
      qm.push_back(smk[size_t(b)].prepare(hist[size_t(b)]));
      qo.push_back(sob[size_t(b)].prepare(hist[size_t(b)]));
    }
    std::vector<float> lm(size_t(B * V)), lo(size_t(B * V));
    std::vector<int32_t> nm(B, -1), no(B, -1);
    emk.step(pm, tokens, lm.data(), nm.data(), qm);
    eob.step(po, tokens, lo.data(), no.data(), qo);
    expect_same_bits(lm.data(), lo.data(), lm.size(), "step " + std::to_string(step));
    for (int b = 0; b < B; ++b) {
      std::span<const float> row(lm.data() + size_t(b) * size_t(V), size_t(V));
      const int32_t want = sref[size_t(b)].sample(row, hist[size_t(b)]);
      EXPECT_EQ(nm[size_t(b)], want) << "megakernel step " << step << " seq " << b;
      EXPECT_EQ(no[size_t(b)], want) << "opbyop step " << step << " seq " << b;
      differs_from_greedy +=
          want != int32_t(std::max_element(row.begin(), row.end()) - row.begin());
      hist[size_t(b)].push_back(want);
      tokens[size_t(b)] = want;
    }
  }
  EXPECT_GT(differs_from_greedy, 0) << "the samplers never left greedy: the test cannot tell";
  // Bad sampling input is an error before anything changes.
  std::vector<SequenceState*> pm = {&mk[0], &mk[1], &mk[2]};
  std::vector<float> lm(size_t(B * V));
  std::vector<int32_t> nm(B);
  const PenaltyCount outside{int32_t(V), 1};
  std::vector<SampleRow> bad(3);
  bad[1].repetition_penalty = 1.2f;
  bad[1].penalties = &outside;
  bad[1].num_penalties = 1;
  const int64_t pos0 = mk[0].pos;
  EXPECT_THROW(emk.step(pm, tokens, lm.data(), nm.data(), bad), Error);  // id outside
  bad[1] = SampleRow{};
  bad[2].top_p = 0;
  EXPECT_THROW(emk.step(pm, tokens, lm.data(), nm.data(), bad), Error);  // top_p out of range
  std::vector<SampleRow> shortv(1);
  EXPECT_THROW(emk.step(pm, tokens, lm.data(), nm.data(), shortv), Error);
  EXPECT_EQ(mk[0].pos, pos0);
}

// MLA split over the cache rows (partials + merge instructions): the two executors agree bit for
// bit; against Model::forward (unsplit) only the fp32 summation order differs, so in FP32 the
// logits agree within 1e-4 of their RMS (the golden fp32 bound; measured ~1e-7). Contexts of
// 33..70 rows give 3..5 blocks of 16, so 3 splits are uneven and 8 splits include empty ones.
TEST_F(Executor, MlaKvSplitsMatchReference) {
  for (const char* name : {"small", "k3-small"})
    for (Precision prec : {Precision::FP32, Precision::BF16}) {
      Model m(model(name), opts(prec));
      const int64_t V = m.config().vocab_size;
      for (int splits : {3, 8}) {
        ExecutorOptions eo;
        eo.workers = 2;
        eo.plan.mla_kv_splits = splits;
        CpuExecutor emk(m, 4, ExecutorKind::kMegakernel, eo);
        CpuExecutor eob(m, 4, ExecutorKind::kOpByOp, eo);
        const plan::Plan& pl = emk.plan(3);
        // Every (MLA layer, sequence, head) is merged exactly once, from `splits` partials.
        std::map<std::tuple<int, int, uint32_t>, int> merged;
        for (const plan::Instr& in : pl.instrs)
          if (in.op == plan::Op::kMlaMerge) {
            EXPECT_EQ(in.splits, uint32_t(splits));
            for (uint32_t h = in.r0; h < in.r1; ++h) ++merged[{in.layer, in.seq, h}];
          }
        EXPECT_EQ(merged.size(),
                  size_t(3 * m.config().num_mla_layers() * m.config().mla_num_heads));
        for (const auto& kv : merged) EXPECT_EQ(kv.second, 1);
        std::vector<SequenceState> ref, mk, ob;
        for (int i = 0; i < 3; ++i) {
          SequenceState s = m.new_sequence();
          std::vector<int32_t> ids(size_t(33 + 18 * i));
          for (size_t t = 0; t < ids.size(); ++t)
            ids[t] = int32_t((i * 131 + t * 17 + 1) % (V - 1));
          m.forward(s, ids, nullptr, false);
          ref.push_back(std::move(s));
        }
        mk = test::copies(emk, ref);
        ob = test::copies(eob, ref);
        std::vector<float> want(static_cast<size_t>(V));
        for (int step = 0; step < 4; ++step) {
          std::vector<int32_t> tokens;
          std::vector<SequenceState*> pm, po;
          for (int b = 0; b < 3; ++b) {
            tokens.push_back(int32_t((b * 37 + step * 101 + 7) % (V - 1)));
            pm.push_back(&mk[size_t(b)]);
            po.push_back(&ob[size_t(b)]);
          }
          std::vector<float> lm(size_t(3 * V)), lo(size_t(3 * V));
          emk.step(pm, tokens, lm.data());
          eob.step(po, tokens, lo.data());
          expect_same_bits(lm.data(), lo.data(), lm.size(),
                           "splits " + std::to_string(splits) + " step " + std::to_string(step));
          if (prec != Precision::FP32) continue;
          for (int b = 0; b < 3; ++b) {
            m.forward(ref[size_t(b)], std::span(&tokens[size_t(b)], 1), want.data(), false);
            double ss = 0, worst = 0;
            for (int64_t v = 0; v < V; ++v) {
              ss += double(want[size_t(v)]) * want[size_t(v)];
              worst = std::max(worst, std::abs(double(lm[size_t(b * V + v)]) - want[size_t(v)]));
            }
            EXPECT_LE(worst, 1e-4 * std::sqrt(ss / double(V)))
                << name << " splits " << splits << " step " << step << " seq " << b;
          }
        }
      }
    }
}

// A geometry the presets do not cover: no shared expert, top-3 of 8 experts (B * k > E from
// batch 3 on), wider heads.
TEST_F(Executor, OtherGeometryMatchesReference) {
  ModelConfig c = preset_config("tiny");
  c.num_shared_experts = 0;
  c.num_experts_per_token = 3;
  c.kda_head_dim = 48;
  c.v_head_dim = 24;
  test::TempDir d("exec_geom");
  {
    ThreadPool pool(2, false);
    make_random_checkpoint(c, d.path(), 5, 1, pool);
  }
  for (Precision p : {Precision::BF16, Precision::FP32}) {
    Model m(d.path(), opts(p));
    for (int w : {1, 3}) check_equivalence(m, w);
  }
}

// The golden models (tests/data/golden, checked against the official implementation by
// test_golden.cpp, and k3-tiny against the float64 K3 reference by test_golden_k3.cpp): the
// golden prompt is prefilled through Model::forward, then its decode ids
// are teacher-forced through each executor in a batch with two other sequences; the golden
// sequence's logits must equal Model::forward's decode bit for bit.
TEST(ExecutorGolden, BitEqualToModelForward) {
  for (const char* name : {"tiny", "small", "k3-tiny"})
    for (Precision prec : {Precision::BF16, Precision::FP32}) {
      const std::string dir = test::data_dir() + "/data/golden/" + name;
      std::ifstream f(dir + "/golden.json");
      ASSERT_TRUE(f.good()) << dir;
      const nlohmann::json meta = nlohmann::json::parse(f);
      std::vector<int32_t> prompt, decode;
      for (auto& v : meta["prompt_ids"]) prompt.push_back(v.get<int32_t>());
      for (auto& v : meta["decode_ids"]) decode.push_back(v.get<int32_t>());
      ASSERT_FALSE(decode.empty());
      Model m(dir, opts(prec));
      const int64_t V = m.config().vocab_size;
      // Reference: prefill, then one decode call per id.
      std::vector<float> want(decode.size() * size_t(V));
      {
        SequenceState s = m.new_sequence();
        m.forward(s, prompt, nullptr, false);
        for (size_t i = 0; i < decode.size(); ++i)
          m.forward(s, std::span(&decode[i], 1), want.data() + i * size_t(V), false);
      }
      for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
        CpuExecutor ex(m, 3, 3, kind);
        SequenceState g0 = m.new_sequence(), a0 = m.new_sequence(), b0 = m.new_sequence();
        m.forward(g0, prompt, nullptr, false);
        m.forward(a0, std::span(prompt.data(), prompt.size() / 2), nullptr, false);
        m.forward(b0, std::span(prompt.data() + 3, 5), nullptr, false);
        SequenceState g = test::copy_of(ex, g0), a = test::copy_of(ex, a0),
                      b = test::copy_of(ex, b0);
        std::vector<float> out(3 * size_t(V));
        for (size_t i = 0; i < decode.size(); ++i) {
          std::vector<SequenceState*> seqs = {&a, &g, &b};
          std::vector<int32_t> toks = {decode[(i + 1) % decode.size()], decode[i],
                                       decode[(i + 2) % decode.size()]};
          if (i % 3 == 2) {  // the golden sequence alone now and then
            seqs = {&g};
            toks = {decode[i]};
          }
          ex.step(seqs, toks, out.data());
          const size_t at = seqs.size() == 1 ? 0 : 1;
          expect_same_bits(out.data() + at * size_t(V), want.data() + i * size_t(V), size_t(V),
                           std::string(name) + (prec == Precision::BF16 ? " bf16 " : " fp32 ") +
                               std::string(executor_name(kind)) + " decode " + std::to_string(i));
        }
      }
    }
}

// An instruction whose wait can never be met: the step ends with an md::Error naming the stuck
// worker, instruction and counter within the watchdog timeout, and the executor recovers.
TEST_F(Executor, WatchdogReportsAnUnreachableWait) {
  Model m(model("tiny"), opts(Precision::BF16));
  ExecutorOptions o;
  o.workers = 2;
  o.watchdog_seconds = 0.3;
  CpuExecutor ex(m, 4, ExecutorKind::kMegakernel, o);
  uint32_t victim = plan::kNone;
  for (const plan::Instr& in : ex.plan(2).instrs)
    if (in.op == plan::Op::kKdaCore && in.layer == 2) {
      victim = in.id;
      break;
    }
  ASSERT_NE(victim, plan::kNone);
  ex.edit_instr_for_testing(2, victim, [](plan::Instr& in) { in.wait[0].target += 1000; });
  SequenceState s0 = ex.new_sequence(), s1 = ex.new_sequence();
  std::vector<SequenceState*> seqs = {&s0, &s1};
  std::vector<int32_t> toks = {5, 9};
  std::vector<float> logits(2 * size_t(m.config().vocab_size));
  const double t0 = now_seconds();
  try {
    ex.step(seqs, toks, logits.data());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_THAT(msg, HasSubstr("decode step stuck"));
    EXPECT_THAT(msg, HasSubstr("#" + std::to_string(victim) + " kda_core L2"));
    EXPECT_THAT(msg, HasSubstr("for counter c"));
    EXPECT_THAT(msg, HasSubstr("worker "));
  }
  EXPECT_LT(now_seconds() - t0, 5.0);
  // Recompiled plans and fresh sequences work again.
  ex.drop_plans();
  s0 = SequenceState();  // the failed step's states are undefined: back to the pool
  s1 = SequenceState();
  SequenceState r0 = ex.new_sequence(), r1 = ex.new_sequence(), q0 = m.new_sequence();
  seqs = {&r0, &r1};
  ex.step(seqs, toks, logits.data());
  std::vector<float> want(size_t(m.config().vocab_size));
  m.forward(q0, std::span(&toks[0], 1), want.data(), false);
  expect_same_bits(logits.data(), want.data(), want.size(), "after recovery");
}

TEST_F(Executor, WatchdogReportsAStalledTileInBothExecutors) {
  Model m(model("tiny"), opts(Precision::BF16));
  for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp})
    for (int workers : {1, 3}) {
      ExecutorOptions o;
      o.workers = workers;
      o.watchdog_seconds = 0.2;
      CpuExecutor ex(m, 2, kind, o);
      const uint32_t victim = uint32_t(ex.plan(1).instrs.size() / 2);
      ex.edit_instr_for_testing(1, victim,
                                [](plan::Instr& in) { in.flags |= plan::kFlagTestStall; });
      SequenceState s = ex.new_sequence();
      SequenceState* sp = &s;
      int32_t tok = 3;
      std::vector<float> logits(size_t(m.config().vocab_size));
      try {
        ex.step(std::span(&sp, 1), std::span(&tok, 1), logits.data());
        ADD_FAILURE() << "no error";
      } catch (const Error& e) {
        EXPECT_THAT(e.what(), HasSubstr("stalled in instruction #" + std::to_string(victim)))
            << executor_name(kind) << " W=" << workers;
      }
    }
}

TEST_F(Executor, BadInputIsAnErrorAndChangesNothing) {
  Model m(model("tiny"), opts(Precision::BF16));
  Model other(model("small"), opts(Precision::BF16));
  CpuExecutor ex(m, 2, 2, ExecutorKind::kMegakernel);
  SequenceState a = ex.new_sequence(), b = ex.new_sequence(), c = ex.new_sequence();
  SequenceState foreign = other.new_sequence();
  SequenceState reference = m.new_sequence();  // this model's, but not the executor's pool
  std::vector<float> logits(3 * size_t(m.config().vocab_size));
  auto run = [&](std::vector<SequenceState*> s, std::vector<int32_t> t) {
    ex.step(s, t, logits.data());
  };
  EXPECT_THROW(run({&a, &b, &c}, {1, 2, 3}), Error);   // over max_batch
  EXPECT_THROW(run({}, {}), Error);                    // empty
  EXPECT_THROW(run({&a, &a}, {1, 2}), Error);          // the same state twice
  EXPECT_THROW(run({&a, &b}, {1, 5000}), Error);       // token outside the vocabulary
  EXPECT_THROW(run({&a, &b}, {1}), Error);             // token count
  EXPECT_THROW(run({&a, &foreign}, {1, 2}), Error);    // another model's state
  EXPECT_THROW(run({&a, &reference}, {1, 2}), Error);  // another pool's state
  EXPECT_THROW(reference.copy_from(foreign), Error);   // another model's layout
  EXPECT_THROW(run({&a, nullptr}, {1, 2}), Error);
  EXPECT_EQ(a.pos, 0);
  EXPECT_EQ(b.pos, 0);
  EXPECT_THROW(parse_executor_kind("fast"), Error);
  EXPECT_THROW(CpuExecutor(m, 0, 1, ExecutorKind::kOpByOp), Error);
}

}  // namespace
}  // namespace md
