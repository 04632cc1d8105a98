// A rank's slice of a model without a launcher (dist/shard.h): the layout checks, the rank's
// config, its weights (row slices are views into the mapping, column slices copies of the right
// columns, other groups' experts absent), the rank's plan (partial sums, its collectives, its
// vocabulary block of lm_head) and the refusals of what cannot run a slice. The sharded models
// run under mpirun in mpi_sharded_model.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "../test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/dist/communicator.h"
#include "megadecode/dist/shard.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/reference_executor.h"
#include "megadecode/model/presets.h"
#include "megadecode/plan/plan.h"

namespace md::dist {
namespace {

Shard shard(int tp, int ep, int rank) {
  Shard s;
  s.layout = {tp, ep};
  s.rank = rank;
  return s;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Shard, LayoutsThatDoNotDivideAreErrorsNamingWhat) {
  const ModelConfig tiny = preset_config("tiny");  // 2 heads, 8 experts
  EXPECT_NO_THROW(check_layout(tiny, shard(2, 1, 1)));
  EXPECT_NO_THROW(check_layout(tiny, shard(1, 2, 0)));
  EXPECT_NE(error_of([&] { check_layout(tiny, shard(4, 1, 0)); }).find("KDA heads"),
            std::string::npos);
  ModelConfig odd = tiny;
  odd.num_experts = 7;
  EXPECT_NE(error_of([&] { check_layout(odd, shard(1, 2, 0)); }).find("routed experts"),
            std::string::npos);
  odd = tiny;
  odd.moe_intermediate_size = 33;
  odd.shared_intermediate_size = 64;  // (so that the shared expert divides)
  EXPECT_NE(error_of([&] { check_layout(odd, shard(2, 1, 0)); }).find("routed-expert channels"),
            std::string::npos);
  EXPECT_NE(error_of([&] { check_layout(tiny, shard(2, 1, 2)); }).find("rank 2"),
            std::string::npos);
  EXPECT_NE(error_of([&] { check_layout(tiny, shard(0, 1, 0)); }).find("not a layout"),
            std::string::npos);
}

TEST(Shard, ConfigDividesHeadsAndChannels) {
  const ModelConfig c = preset_config("small");
  const ModelConfig l = shard_config(c, shard(2, 2, 3));
  EXPECT_EQ(l.kda_num_heads, c.kda_num_heads / 4);
  EXPECT_EQ(l.mla_num_heads, c.mla_num_heads / 4);
  EXPECT_EQ(l.intermediate_size, c.intermediate_size / 4);
  EXPECT_EQ(l.shared_intermediate(), c.shared_intermediate() / 4);
  EXPECT_EQ(l.moe_intermediate_size, c.moe_intermediate_size / 2);  // tp ways inside an expert
  EXPECT_EQ(l.num_experts, c.num_experts);
  EXPECT_EQ(l.vocab_size, c.vocab_size);
  EXPECT_EQ(shard(2, 2, 3).experts(c), std::make_pair(c.num_experts / 2, c.num_experts));
  EXPECT_EQ(vocab_block(10, 4, 3), std::make_pair(int64_t(9), int64_t(10)));
  EXPECT_EQ(vocab_block(10, 4, 0), std::make_pair(int64_t(0), int64_t(3)));
}

// Row slices point into the mapping at the rank's rows; column slices hold the rank's columns.
TEST(Shard, WeightsAreViewsOfRowsAndCopiesOfColumns) {
  const std::string dir = test::data_dir() + "/data/golden/small";
  Model whole(dir, ModelOptions{});
  const ModelConfig& c = whole.config();
  const ModelWeights& F = whole.weights();
  for (const Shard s : {shard(2, 1, 1), shard(1, 2, 1)}) {
    ShardBytes b;
    const ModelWeights w = shard_weights(c, F, s, &b);
    const ModelConfig l = shard_config(c, s);
    EXPECT_GT(b.mapped, 0);
    EXPECT_GT(b.copied, 0);  // o_proj and the down projections' columns
    for (int li = 0; li < c.num_layers; ++li) {
      const LayerWeights& L = w.layers[size_t(li)];
      const LayerWeights& G = F.layers[size_t(li)];
      if (c.attn_kind[size_t(li)] == AttnKind::KDA) {
        const int64_t c0 = int64_t(s.rank) * l.kda_dim();
        EXPECT_EQ(L.kda.q.data, G.kda.q.row(c0)) << "layer " << li;
        EXPECT_EQ(L.kda.q.rows, l.kda_dim());
        ASSERT_EQ(L.kda.o.cols, l.kda_dim());
        for (int64_t r = 0; r < L.kda.o.rows; r += 7)
          EXPECT_EQ(std::memcmp(L.kda.o.row(r), static_cast<const bf16*>(G.kda.o.row(r)) + c0,
                                size_t(l.kda_dim()) * 2),
                    0)
              << "o_proj row " << r << " layer " << li;
        EXPECT_EQ(L.kda.A_log[0], G.kda.A_log[size_t(s.rank) * size_t(l.kda_num_heads)]);
      }
      if (c.ffn_kind[size_t(li)] != FfnKind::MoE) continue;
      const auto [e0, e1] = s.experts(c);
      for (int e = 0; e < c.num_experts; ++e) {
        const bool mine = e >= e0 && e < e1;
        EXPECT_EQ(L.moe.experts[size_t(e)].gate.data != nullptr, mine) << "expert " << e;
        if (mine && s.layout.tp == 1) {  // whole experts: views
          EXPECT_EQ(L.moe.experts[size_t(e)].down.data, G.moe.experts[size_t(e)].down.data);
        }
      }
    }
  }
}

// The rank's plan: partial o_proj and down projections, an all-reduce after each, lm_head over
// the rank's vocabulary block only, the logits gathered before sampling.
TEST(Shard, PlanHasTheCollectivesAndTheVocabularyBlock) {
  const ModelConfig full = preset_config("small");
  for (int world : {2, 4}) {
    const Shard s = shard(world, 1, world - 1);
    plan::PlanOptions po;
    po.batch = 2;
    po.workers = 3;
    po.world = world;
    po.rank = s.rank;
    for (plan::Scheduler sch : {plan::Scheduler::kPhases, plan::Scheduler::kList}) {
      po.scheduler = sch;
      const plan::Plan p = plan::compile_decode_plan(shard_config(full, s), nullptr, po);
      const auto errs = plan::validate_plan(p);
      ASSERT_TRUE(errs.empty()) << errs.front();
      const plan::PlanStats st = plan::plan_stats(p);
      EXPECT_EQ(st.instrs_per_op[size_t(plan::Op::kAllReduce)], 2 * full.num_layers);
      EXPECT_EQ(st.instrs_per_op[size_t(plan::Op::kLogitsGather)], 1);
      const auto [v0, v1] = s.vocab(full.vocab_size);
      for (const plan::Instr& in : p.instrs) {
        if (in.op == plan::Op::kLmHead) {
          EXPECT_GE(int64_t(in.r0), v0);
          EXPECT_LE(int64_t(in.r1), v1);
        }
        if (in.op == plan::Op::kAttnOut || in.op == plan::Op::kDenseDown ||
            in.op == plan::Op::kSharedDown || in.op == plan::Op::kExpertDown) {
          EXPECT_TRUE(in.flags & plan::kFlagPartial) << plan::describe_instr(p, in);
        }
      }
      EXPECT_NE(plan::describe_plan(p, true).find("all_reduce"), std::string::npos);
    }
  }
  plan::PlanOptions bad;
  bad.world = 2;
  bad.rank = 2;
  EXPECT_THROW(plan::compile_decode_plan(full, nullptr, bad), Error);
}

// K3's latent MoE on a rank: each rank computes its block of routed_expert_down_proj's and
// _up_proj's output rows (the blocks tile the rows over the ranks, each once) and an all-gather
// after each gives every rank the whole vector, so that a step adds two all-gathers a MoE layer.
TEST(Shard, K3RanksSplitTheLatentProjectionsAndGatherThem) {
  const ModelConfig full = preset_config("k3-tiny");
  ASSERT_GT(full.latent_size, 0);
  int moe = 0;
  for (FfnKind k : full.ffn_kind) moe += k == FfnKind::MoE;
  ASSERT_GT(moe, 0);
  // (k3-tiny's 2 KDA heads allow two ranks: split by channels, or by experts.)
  for (const auto& [tp, ep] : {std::pair{2, 1}, std::pair{1, 2}}) {
    const int world = tp * ep;
    std::vector<int> down_rows(size_t(full.latent_size), 0), up_rows(size_t(full.hidden_size), 0);
    for (int rank = 0; rank < world; ++rank) {
      const Shard s = shard(tp, ep, rank);
      plan::PlanOptions po;
      po.batch = 2;
      po.workers = 3;
      po.world = world;
      po.rank = rank;
      const plan::Plan p = plan::compile_decode_plan(shard_config(full, s), nullptr, po);
      const auto errs = plan::validate_plan(p);
      ASSERT_TRUE(errs.empty()) << errs.front();
      const plan::PlanStats st = plan::plan_stats(p);
      EXPECT_EQ(st.instrs_per_op[size_t(plan::Op::kAllGather)], 2 * moe);
      EXPECT_EQ(st.instrs_per_op[size_t(plan::Op::kAllReduce)], 2 * full.num_layers);
      const auto zb = vocab_block(full.latent_size, world, rank);
      const auto ub = vocab_block(full.hidden_size, world, rank);
      for (const plan::Instr& in : p.instrs) {
        const bool down = in.op == plan::Op::kLatentDown, up = in.op == plan::Op::kLatentUp;
        if (!down && !up) continue;
        const auto [b0, b1] = down ? zb : ub;
        EXPECT_GE(int64_t(in.r0), b0) << plan::describe_instr(p, in);
        EXPECT_LE(int64_t(in.r1), b1) << plan::describe_instr(p, in);
        EXPECT_FALSE(in.flags & plan::kFlagPartial) << plan::describe_instr(p, in);
        for (uint32_t r = in.r0; r < in.r1; ++r) ++(down ? down_rows : up_rows)[r];
      }
    }
    // Every output row computed once a MoE layer, by one rank.
    for (int v : down_rows) EXPECT_EQ(v, moe);
    for (int v : up_rows) EXPECT_EQ(v, moe);
  }
}

// Stands in for a second rank where only the refusals are tested: every collective is an error.
class TwoRanks final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string_view backend() const override { return "test"; }
  void all_gather(const void*, void*, size_t, Elem) override { fail("no second rank"); }
  void broadcast(void*, size_t, int) override { fail("no second rank"); }
  void barrier() override { fail("no second rank"); }

 protected:
  void all_to_all(const void*, void*, size_t, Elem) override { fail("no second rank"); }
};

TEST(Shard, WhatCannotRunASliceSaysSo) {
  const std::string dir = test::data_dir() + "/data/golden/tiny";
  auto one = local_communicator();
  EXPECT_NE(error_of([&] {
              Model m(dir, ModelOptions{}, shard(2, 1, 0), one.get());
            }).find("mpirun -np 2"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { Model m(dir, ModelOptions{}, shard(2, 1, 0), nullptr); }).find("mpirun -np 2"),
      std::string::npos);
  TwoRanks two;
  ModelOptions copy;
  copy.load.mode = WeightLoad::kCopy;  // --no-mmap: a private copy of every file per rank
  EXPECT_NE(error_of([&] { Model m(dir, copy, shard(2, 1, 0), &two); }).find("--no-mmap"),
            std::string::npos);
  Model m(dir, ModelOptions{}, shard(2, 1, 0), &two);
  EXPECT_TRUE(m.shard().sharded());
  EXPECT_EQ(m.full_config().kda_num_heads, 2 * m.config().kda_num_heads);
  SequenceState s = m.new_sequence();
  const int32_t tok = 5;
  EXPECT_NE(
      error_of([&] { m.forward(s, std::span(&tok, 1), nullptr, false); }).find("whole models only"),
      std::string::npos);
  EXPECT_NE(error_of([&] { ReferenceExecutor r(m, 1); }).find("whole models only"),
            std::string::npos);
  // The CUDA executors run slices (MpiShard.CudaSimRanksMatchTheWholeModel).
}

TEST(Shard, PlanCommandShowsARanksCollectives) {
  auto r = test::run_cli("plan --preset small --batch 1 --workers 2 --tp 2 --rank 1");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("tp 2 x ep 1, rank 1 of 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("all_reduce"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("logits_gather"), std::string::npos) << r.out;
  r = test::run_cli("plan --preset tiny --tp 4");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("do not divide"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace md::dist
