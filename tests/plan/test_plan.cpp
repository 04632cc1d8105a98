// The decode plan's structure: validity for many geometries, batches and worker counts; the
// validator catches broken plans; no host pointer reaches the plan; random interleavings of the
// queues always complete (the deadlock argument, model-checked); the CLI summary.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <type_traits>

#include "megadecode/base/threads.h"
#include "megadecode/base/util.h"
#include "megadecode/engine/model.h"
#include "megadecode/model/presets.h"
#include "megadecode/plan/ops.h"
#include "megadecode/plan/plan.h"
#include "test_util.h"

namespace md {
namespace {

using namespace md::plan;
using ::testing::HasSubstr;

static_assert(sizeof(Instr) == 64);
static_assert(std::is_trivially_copyable_v<Instr>);
static_assert(std::is_trivially_copyable_v<BufferDesc>);
static_assert(std::is_trivially_copyable_v<WeightRef>);
static_assert(std::is_trivially_copyable_v<CounterDesc>);

Plan compile(const std::string& preset, int batch, int workers, int rows = 1) {
  PlanOptions o;
  o.batch = batch;
  o.workers = workers;
  o.rows = rows;
  return compile_decode_plan(preset_config(preset), nullptr, o);
}

TEST(Plan, ValidForPresetsBatchesAndWorkers) {
  for (const char* preset : {"tiny", "small", "kl48-e32"})
    for (int batch : {1, 2, 3, 8, 64})
      for (int workers : {1, 2, 3, 5, 16}) {
        if (std::string(preset) == "kl48-e32" && batch > 8 && workers > 3) continue;
        Plan p = compile(preset, batch, workers);
        auto errs = validate_plan(p);
        EXPECT_TRUE(errs.empty()) << preset << " B=" << batch << " W=" << workers << ": "
                                  << errs.front();
      }
}

TEST(Plan, CountsMatchTheModel) {
  const ModelConfig c = preset_config("small");
  Plan p = compile("small", 3, 2);
  PlanStats s = plan_stats(p);
  auto n = [&](Op op) { return s.instrs_per_op[size_t(op)]; };
  EXPECT_EQ(n(Op::kEmbed), 3);
  // KDA and MLA cores: for every layer and sequence, the head ranges cover each head once.
  std::map<std::tuple<int, int, int>, int> heads;  // (layer, seq, head) -> count
  for (const Instr& in : p.instrs)
    if (in.op == Op::kKdaCore || in.op == Op::kMlaCore)
      for (uint32_t h = in.r0; h < in.r1; ++h) ++heads[{in.layer, in.seq, int(h)}];
  EXPECT_EQ(heads.size(), size_t(3 * (c.num_kda_layers() * c.kda_num_heads +
                                      c.num_mla_layers() * c.mla_num_heads)));
  for (auto& [key, count] : heads) EXPECT_EQ(count, 1);
  EXPECT_EQ(n(Op::kMlaLatent), c.num_mla_layers() * 3);
  EXPECT_EQ(n(Op::kRouter), (c.num_layers - 1) * 3);
  EXPECT_EQ(n(Op::kCombine), c.num_layers * 3);
  EXPECT_EQ(n(Op::kFfnNorm), c.num_layers * 3);
  // Expert slots: min(B * k, E) per MoE layer, each with gate/up and down row blocks.
  std::set<std::pair<int, int>> slots;
  for (const Instr& in : p.instrs)
    if (in.op == Op::kExpertGateUp) slots.insert({in.layer, in.slot});
  EXPECT_EQ(int(slots.size()),
            (c.num_layers - 1) * std::min(3 * c.num_experts_per_token, c.num_experts));
  // Every GEMV row block covers its matrix exactly once: rows of lm_head.
  std::vector<int> covered(size_t(c.vocab_size), 0);
  for (const Instr& in : p.instrs)
    if (in.op == Op::kLmHead)
      for (uint32_t r = in.r0; r < in.r1; ++r) ++covered[r];
  EXPECT_EQ(std::count(covered.begin(), covered.end(), 1), c.vocab_size);
  // Byte balance of the megakernel queues.
  const double total = s.total_bytes;
  for (double b : s.bytes_per_worker) EXPECT_NEAR(b / total, 0.5, 0.15);
  EXPECT_GT(s.critical_path.size(), size_t(c.num_layers * 4));
  EXPECT_LE(s.critical_path_bytes, total);
}

TEST(Plan, K3ValidForPresetsBatchesAndWorkers) {
  for (const char* preset : {"k3-tiny", "k3-small", "k3-slice"})
    for (int batch : {1, 2, 3, 8, 64})
      for (int workers : {1, 2, 3, 5, 16}) {
        if (std::string(preset) == "k3-slice" && (batch > 8 || workers > 5)) continue;
        Plan p = compile(preset, batch, workers);
        auto errs = validate_plan(p);
        EXPECT_TRUE(errs.empty()) << preset << " B=" << batch << " W=" << workers << ": "
                                  << errs.front();
      }
}

// Kimi K3's ops in the plan: every op present with the expected tile counts, the block attention
// residual mixes with the reference's sources (engine/model.cpp: the block summaries, then the
// partial sum), new blocks without the residual add, MXFP4 experts at 4.25 bits.
TEST(Plan, K3CountsMatchTheModel) {
  const ModelConfig c = preset_config("k3-small");
  const int B = 3;
  Plan p = compile("k3-small", B, 2);
  ASSERT_TRUE(validate_plan(p).empty());
  PlanStats s = plan_stats(p);
  auto n = [&](Op op) { return s.instrs_per_op[size_t(op)]; };
  const int L = c.num_layers, moe = L - 1, mla = c.num_mla_layers(), bs = c.attn_res_block_size;
  ASSERT_EQ(bs, 3);
  EXPECT_EQ(n(Op::kEmbed), B);
  EXPECT_EQ(n(Op::kFfnNorm), L * B);
  EXPECT_EQ(n(Op::kCombine), L * B);
  EXPECT_EQ(n(Op::kRouter), moe * B);
  EXPECT_EQ(n(Op::kLatentNorm), moe * B);
  EXPECT_EQ(n(Op::kMlaLatent), mla * B);
  EXPECT_EQ(n(Op::kDenseGateUp) > 0 && n(Op::kDenseDown) > 0, true);
  // Row blocks cover their matrices once per layer: q_b (q LoRA), the latent projections, the
  // full-rank KDA gate and the MLA gate.
  std::map<std::tuple<int, int, uint32_t>, int> rows;  // (op or weight kind, layer, row)
  for (const Instr& in : p.instrs) {
    int key = -1;
    if (in.op == Op::kMlaQUp || in.op == Op::kLatentDown || in.op == Op::kLatentUp)
      key = int(in.op);
    if (in.op == Op::kKdaProj || in.op == Op::kMlaProj) {
      const WeightKind k = p.weights[p.buffers[in.args].offset].kind;
      if (k == WeightKind::kKdaG || k == WeightKind::kMlaG || k == WeightKind::kMlaQA)
        key = 100 + int(k);
    }
    if (key >= 0)
      for (uint32_t r = in.r0; r < in.r1; ++r) ++rows[{key, in.layer, r}];
  }
  for (auto& [k, count] : rows) EXPECT_EQ(count, 1);
  const int QW = c.mla_num_heads * c.qk_head_dim(), X = int(c.latent_size);
  auto count = [&](int key) {
    return int(std::count_if(rows.begin(), rows.end(),
                             [&](auto& kv) { return std::get<0>(kv.first) == key; }));
  };
  EXPECT_EQ(count(int(Op::kMlaQUp)), mla * QW);
  EXPECT_EQ(count(int(Op::kLatentDown)), moe * X);
  EXPECT_EQ(count(int(Op::kLatentUp)), moe * int(c.hidden_size));
  EXPECT_EQ(count(100 + int(WeightKind::kKdaG)), c.num_kda_layers() * int(c.kda_dim()));
  EXPECT_EQ(count(100 + int(WeightKind::kMlaG)), mla * c.mla_num_heads * c.v_head_dim);
  EXPECT_EQ(count(100 + int(WeightKind::kMlaQA)), mla * c.q_lora_rank);
  for (const Instr& in : p.instrs) {
    const int l = in.layer;
    switch (in.op) {
      case Op::kKdaCore:
        EXPECT_EQ(in.flags, kFlagFullRankGate | kFlagBoundedDecay);
        break;
      case Op::kMlaCore:
        EXPECT_EQ(in.flags, kFlagOutputGate);
        break;
      case Op::kAttnOut:  // a new residual block starts every bs layers: no residual add
        EXPECT_EQ(in.flags, l % bs == 0 ? 0 : kFlagResidual) << l;
        break;
      case Op::kFfnNorm:
        // [x_mid, norm, h2, res_w, blocks..., x_mid]: l / bs + 1 summaries (the embedding first)
        EXPECT_EQ(in.flags, kFlagAttnRes);
        EXPECT_EQ(int(in.nargs), 3 + 1 + (l / bs + 1) + 1) << l;
        EXPECT_EQ(p.buffers[in.args + in.nargs - 1].offset, p.buffers[in.args].offset);
        break;
      case Op::kCombine: {
        // The next layer's (or the final) mix over the same summaries and x_next.
        const bool moe_l = c.ffn_kind[size_t(l)] == FfnKind::MoE;
        const int base = arg::Combine::count;  // the same slots for dense and MoE layers
        EXPECT_TRUE(in.flags & kFlagAttnRes);
        EXPECT_EQ(bool(in.flags & kFlagLatentMoe), moe_l);
        EXPECT_EQ(int(in.nargs), base + 1 + (l / bs + 1) + 1) << l;
        EXPECT_EQ(p.buffers[in.args + in.nargs - 1].offset,
                  p.buffers[in.args + arg::Combine::x_next].offset);
        const WeightKind rk = p.weights[p.buffers[in.args + base].offset].kind;
        EXPECT_EQ(rk, l + 1 < L ? WeightKind::kAttnResW : WeightKind::kOutputResW);
        break;
      }
      case Op::kExpertGateUp:  // MXFP4: 2 x rows x X x 4.25 bits; waits for the router and z
        EXPECT_EQ(in.est_bytes, uint32_t(2.0 * (in.r1 - in.r0) * X * 17 / 32));
        EXPECT_NE(in.wait[0].counter, kNone);
        EXPECT_NE(in.wait[1].counter, kNone);
        break;
      case Op::kExpertDown:
        EXPECT_EQ(in.est_bytes,
                  uint32_t(double(in.r1 - in.r0) * c.moe_intermediate_size * 17 / 32));
        EXPECT_LE(in.r1, uint32_t(X));
        break;
      default:
        break;
    }
  }
  // The first block summary is the embedding's output x0 (operand 2 of the embed tile).
  for (const Instr& in : p.instrs)
    if (in.op == Op::kFfnNorm && in.layer == 0) {
      EXPECT_EQ(p.buffers[in.args + 4].offset, p.buffers[p.instrs[0].args + 2].offset);
      break;
    }
}

// Every op has a table entry with a name, a range meaning and named operand slots, and every
// plan of every preset keeps to it (validate_plan, and the builder's own check when compiling).
TEST(Plan, OpTableDescribesEveryOp) {
  for (int i = 0; i < kNumOps; ++i) {
    const OpDesc& d = op_desc(Op(i));
    EXPECT_NE(d.name, "?") << i;
    EXPECT_FALSE(d.ranges.empty()) << d.name;
    EXPECT_FALSE(d.operands.empty()) << d.name;
    EXPECT_GE(d.cost_factor, 1.0) << d.name;
    for (uint8_t so : d.stream_operands)
      if (so != 0xff) {
        EXPECT_LT(so, d.operands.size()) << d.name;
      }
  }
  EXPECT_EQ(op_desc(Op::kKdaCore).operands.size(), size_t(arg::KdaCore::count));
  EXPECT_EQ(operand_name(Op::kKdaCore, arg::KdaCore::f_b), "f_b");
  EXPECT_EQ(operand_name(Op::kCombine, arg::Combine::count), "res_w");
  for (const char* preset : {"tiny", "small", "k3-tiny", "k3-small"})
    for (int rows : {1, 4})
      EXPECT_TRUE(validate_plan(compile(preset, 3, 2, rows)).empty()) << preset;
}

TEST(Plan, ValidatorCatchesBrokenPlans) {
  const Plan good = compile("tiny", 2, 3);
  ASSERT_TRUE(validate_plan(good).empty());
  // Find an instruction with a wait.
  uint32_t w = kNone;
  for (const Instr& in : good.instrs)
    if (in.wait[0].counter != kNone && in.op == Op::kKdaCore) {
      w = in.id;
      break;
    }
  ASSERT_NE(w, kNone);
  {
    Plan p = good;  // unreachable target
    p.instrs[w].wait[0].target += 1;
    EXPECT_THAT(validate_plan(p).front(), HasSubstr("unreachable"));
  }
  {
    Plan p = good;  // waits on a counter signalled later
    p.instrs[w].wait[0].counter = p.instrs.back().signal;
    p.instrs[w].wait[0].target = 1;
    auto e = validate_plan(p);
    ASSERT_FALSE(e.empty());
    EXPECT_THAT(e.front(), HasSubstr("not earlier in the global order"));
  }
  {
    Plan p = good;  // an operand too few (the op table says how many)
    --p.instrs[w].nargs;
    EXPECT_THAT(validate_plan(p).front(), HasSubstr("operands, the op takes 17"));
  }
  {
    Plan p = good;  // a weight where the op table says activation
    p.buffers[p.instrs[w].args + arg::KdaCore::q] = p.buffers[p.instrs[w].args + arg::KdaCore::f_b];
    EXPECT_THAT(validate_plan(p).front(), HasSubstr("operand 0 (q) is of the wrong kind"));
  }
  {
    Plan p = good;  // a flag of another op
    p.instrs[w].flags |= kFlagMoeCombine;
    EXPECT_THAT(validate_plan(p).front(), HasSubstr("flags 0x1 the op does not take"));
  }
  {
    Plan p = good;  // per-step increment disagrees with the signallers
    ++p.counters[0].per_step;
    EXPECT_THAT(validate_plan(p).front(), HasSubstr("per_step"));
  }
  {
    Plan p = good;  // a queue out of topological order
    auto& q = p.queue_ids[0];
    ASSERT_GE(q.size(), 2u);
    std::swap(q[0], q[1]);
    std::swap(p.queues[0][0], p.queues[0][1]);
    EXPECT_FALSE(validate_plan(p).empty());
  }
  {
    Plan p = good;  // an instruction in two queues
    p.queue_ids[1].push_back(p.queue_ids[0].back());
    p.queues[1].push_back(p.queues[0].back());
    EXPECT_FALSE(validate_plan(p).empty());
  }
  {
    Plan p = good;  // op-by-op: two dependent stages in one phase
    ASSERT_GE(p.phase_instrs.size(), 2u);
    for (auto& s : p.phase_instrs[1])
      p.phase_instrs[0][0].insert(p.phase_instrs[0][0].end(), s.begin(), s.end());
    for (auto& s : p.phase_instrs[1]) s.clear();
    std::sort(p.phase_instrs[0][0].begin(), p.phase_instrs[0][0].end());
    EXPECT_FALSE(validate_plan(p).empty());
  }
}

// The plan is a function of the geometry and the stored dtypes only: compiling against loaded
// weights (with their mapped addresses) gives the same bytes as compiling from the config.
// A phase of equal tiles is shared as contiguous runs; one the runs cannot balance falls back to
// longest processing time first; every position is in exactly one share, each share increasing.
TEST(Plan, SplitPhaseRunsWhereTheyBalanceElseLpt) {
  auto check_partition = [](const std::vector<std::vector<uint32_t>>& s, size_t n) {
    std::vector<int> seen(n, 0);
    for (const auto& share : s) {
      EXPECT_TRUE(std::is_sorted(share.begin(), share.end()));
      for (uint32_t i : share) ++seen.at(i);
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), std::ptrdiff_t(n));
  };
  {
    const auto s = split_phase(std::vector<double>(10, 1.0), 2);
    check_partition(s, 10);
    EXPECT_EQ(s[0], (std::vector<uint32_t>{0, 1, 2, 3, 4}));
    EXPECT_EQ(s[1], (std::vector<uint32_t>{5, 6, 7, 8, 9}));
  }
  {
    // 3 workers, 7 equal tiles: runs of 2-3 (longest 3 = LPT's longest).
    const auto s = split_phase(std::vector<double>(7, 2.0), 3);
    check_partition(s, 7);
    for (const auto& share : s) {
      ASSERT_FALSE(share.empty());
      EXPECT_EQ(share.back() - share.front() + 1, share.size());  // contiguous
    }
  }
  {
    // Runs give 12 at best ({10} {10 1 1}), LPT 11 ({10 1} {10 1}).
    const auto s = split_phase({10, 10, 1, 1}, 2);
    check_partition(s, 4);
    EXPECT_EQ(s[0], (std::vector<uint32_t>{0, 2}));
    EXPECT_EQ(s[1], (std::vector<uint32_t>{1, 3}));
  }
  {
    // Fewer tiles than workers, and none.
    const auto s = split_phase({5, 5}, 4);
    check_partition(s, 2);
    EXPECT_EQ(split_phase({}, 2).size(), 2u);
  }
}

// The GEMV tiles of a kl48-geometry step reach each worker as runs of consecutive rows: within
// every op-by-op phase, a worker's instructions of one op and slot are consecutive instructions.
TEST(Plan, WorkersGetConsecutiveTilesOfAMatrix) {
  for (int workers : {2, 3}) {
    const Plan p = compile("kl48-e32", 1, workers);
    size_t breaks = 0, tiles = 0;
    for (const auto& shares : p.phase_instrs)
      for (const auto& share : shares)
        for (size_t j = 1; j < share.size(); ++j) {
          const Instr &a = p.instrs[share[j - 1]], &b = p.instrs[share[j]];
          if (a.op != b.op || a.layer != b.layer || a.slot != b.slot) continue;
          ++tiles;
          if (b.id != a.id + 1) ++breaks;
        }
    EXPECT_GT(tiles, 10000u) << workers;
    EXPECT_EQ(breaks, 0u) << workers;
  }
}

// A multi-row plan (a prefill chunk beside decode rows: one sequence may carry all the rows)
// gives every worker a head range of every sequence's MLA attention, op by op and in the
// megakernel's queues, so the one long sequence is shared; a decode plan keeps a sequence's
// ranges together (one per sequence at this batch).
TEST(Plan, MultiRowPlansShareEachSequencesMlaAttentionAmongTheWorkers) {
  for (int workers : {2, 3}) {
    const Plan p = compile("small", 9, workers, 32);
    const int H = p.cfg.mla_num_heads;
    for (const auto& q : p.queues) {
      std::map<std::pair<int, int>, int> heads;  // (layer, sequence) -> heads in this queue
      for (const Instr& in : q)
        if (in.op == Op::kMlaCore) heads[{int(in.layer), int(in.seq)}] += int(in.r1 - in.r0);
      ASSERT_FALSE(heads.empty());
      for (const auto& [key, n] : heads) {
        EXPECT_LT(n, H) << "W=" << workers << " layer " << key.first << " seq " << key.second;
        if (workers == 2) {  // two equal ranges: each worker has half of every sequence
          EXPECT_EQ(n, H / 2) << "layer " << key.first << " seq " << key.second;
        }
      }
      if (workers == 2) {
        EXPECT_EQ(heads.size() % 9, 0u) << "every sequence, in every layer";
      }
    }
  }
  const Plan d = compile("small", 9, 2, 1);
  for (const Instr& in : d.instrs) {
    if (in.op == Op::kMlaCore) {
      EXPECT_EQ(int(in.r1 - in.r0), d.cfg.mla_num_heads);
    }
  }
}

TEST(Plan, HoldsNoHostPointers) {
  for (const char* preset : {"tiny", "k3-tiny"}) {
    test::TempDir dir("plan_ptr");
    ThreadPool pool(2, false);
    make_random_checkpoint(preset_config(preset), dir.path(), 3, 1, pool);
    Model m(dir.path(), ModelOptions{Precision::BF16, 1, false, false, {}, {}, {}});
    PlanOptions o;
    o.batch = 3;
    o.workers = 2;
    Plan a = compile_decode_plan(m.config(), &m.weights(), o);
    Plan b = compile_decode_plan(m.config(), nullptr, o);
    ASSERT_EQ(a.instrs.size(), b.instrs.size());
    EXPECT_EQ(0, std::memcmp(a.instrs.data(), b.instrs.data(), a.instrs.size() * sizeof(Instr)));
    ASSERT_EQ(a.buffers.size(), b.buffers.size());
    EXPECT_EQ(
        0, std::memcmp(a.buffers.data(), b.buffers.data(), a.buffers.size() * sizeof(BufferDesc)));
    ASSERT_EQ(a.weights.size(), b.weights.size());
    EXPECT_EQ(
        0, std::memcmp(a.weights.data(), b.weights.data(), a.weights.size() * sizeof(WeightRef)));
    for (size_t w = 0; w < a.queues.size(); ++w)
      EXPECT_EQ(0, std::memcmp(a.queues[w].data(), b.queues[w].data(),
                               a.queues[w].size() * sizeof(Instr)));
  }
}

// Model check of the deadlock argument: run the queues under random interleavings (at every
// point any worker whose head instruction's waits are met may go) for several epochs; every
// run must finish every queue.
TEST(Plan, RandomInterleavingsAlwaysComplete) {
  for (const char* preset : {"tiny", "small", "k3-tiny", "k3-small"})
    for (int workers : {1, 2, 3, 5, 7})
      for (int batch : {1, 3, 8}) {
        const Plan p = compile(preset, batch, workers);
        Rng rng(uint64_t(workers * 131 + batch));
        std::vector<uint32_t> ctr(p.counters.size(), 0);
        for (uint32_t epoch = 0; epoch < 3; ++epoch) {
          std::vector<size_t> head(size_t(workers), 0);
          size_t left = p.instrs.size();
          while (left > 0) {
            std::vector<int> ready;
            for (int w = 0; w < workers; ++w) {
              const auto& q = p.queues[size_t(w)];
              if (head[size_t(w)] >= q.size()) continue;
              const Instr& in = q[head[size_t(w)]];
              bool ok = true;
              for (const Wait& wt : in.wait)
                if (wt.counter != kNone &&
                    int32_t(ctr[wt.counter] -
                            (wt.target + epoch * p.counters[wt.counter].per_step)) < 0)
                  ok = false;
              if (ok) ready.push_back(w);
            }
            ASSERT_FALSE(ready.empty())
                << "deadlock: " << preset << " W=" << workers << " B=" << batch;
            const int w = ready[rng.next() % ready.size()];
            const Instr& in = p.queues[size_t(w)][head[size_t(w)]++];
            if (in.signal != kNone) ++ctr[in.signal];
            --left;
          }
        }
      }
}

TEST(Plan, CliSummaryAndDump) {
  auto r = test::run_cli("plan --preset small --batch 2 --workers 3");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("decode plan: batch 2 x 1 token rows, 3 workers"));
  EXPECT_THAT(r.out, HasSubstr("kda_core"));
  EXPECT_THAT(r.out, HasSubstr("critical path:"));
  EXPECT_THAT(r.out, HasSubstr("worker"));
  r = test::run_cli("plan --preset tiny --batch 1 --workers 2 --dump");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("== queue 1"));
  EXPECT_THAT(r.out, HasSubstr("#0 embed"));
  r = test::run_cli("plan --preset k3-small --batch 3 --workers 2");
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* op : {"mla_q_up", "latent_down", "latent_norm", "latent_up", "expert_gate_up"})
    EXPECT_THAT(r.out, HasSubstr(op));
  r = test::run_cli("plan --preset tiny --batch 0");
  EXPECT_NE(r.status, 0);
  r = test::run_cli("plan --batch 2");
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.err, HasSubstr("--model"));
}

}  // namespace
}  // namespace md
