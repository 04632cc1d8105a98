// Sharded models under mpirun (tests/CMakeLists.txt: Mpi.Np2, Mpi.Np4; docs/distributed.md):
// every layout of the world size (tp x ep = ranks) on the committed golden models (tiny, small,
// K3 tiny), both CPU plan executors, FP32 and BF16, against the whole model's reference path on
// the same rank; and the CUDA executors through the simulation (MpiShard.CudaSim*).
//
// Tolerance. A sharded step adds the same products as the whole model's, in another order: each
// rank sums its heads' / channels' share of o_proj and of the down projections, and the ranks'
// partial sums are added in rank order. In FP32 precision that is a reordering of dot products of
// length <= 512, below 1e-4 of the logits' scale over these few layers (Higham's n * 2^-24 bound,
// the bound the CUDA simulation tests use for the same reason). In BF16 a reordered sum can cross
// a bf16 rounding boundary (2^-8 relative) and the difference propagates, so there the greedy
// token is checked wherever the reference's top two logits are further apart than 2^-6 of their
// scale ("the clean stretch"). The experts' outputs are not reordered (each is computed whole by
// its owner, the others add zeros), and every rank must hold the same logits bits: the sampling
// decisions are then the same on every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../exec/exec_test_util.h"
#include "../test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/dist/communicator.h"
#include "megadecode/dist/shard.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cuda/sim.h"
#include "mpi_test.h"

namespace md::dist {
namespace {

using test::mpi;
using test::opts;

std::vector<ShardLayout> layouts(int world) {
  std::vector<ShardLayout> v;
  for (int tp = 1; tp <= world; ++tp)
    if (world % tp == 0) v.push_back({tp, world / tp});
  return v;
}

struct Golden {
  std::string dir;
  std::vector<int32_t> prompt, decode;
};
Golden golden(const std::string& name) {
  Golden g;
  g.dir = test::data_dir() + "/data/golden/" + name;
  std::ifstream f(g.dir + "/golden.json");
  EXPECT_TRUE(f.good()) << g.dir;
  const nlohmann::json meta = nlohmann::json::parse(f);
  for (auto& v : meta["prompt_ids"]) g.prompt.push_back(v.get<int32_t>());
  for (auto& v : meta["decode_ids"]) g.decode.push_back(v.get<int32_t>());
  return g;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}
// The top logit's lead over the second, as a fraction of the row's scale.
double lead(const std::vector<float>& v) {
  std::vector<float> s(v);
  std::partial_sort(s.begin(), s.begin() + 2, s.end(), std::greater<float>());
  return double(s[0] - s[1]) / std::max(max_abs(v), 1e-30);
}
int32_t argmax(const std::vector<float>& v) {
  return int32_t(std::max_element(v.begin(), v.end()) - v.begin());
}

// Every rank holds the same bytes.
// One executor of batch 1 over a rank's slice: a CPU one with one unpinned worker (two ranks
// share this machine's cores), or a CUDA one on the simulation.
std::unique_ptr<Executor> rank_executor(Model& part, ExecutorKind kind, bool cuda_sim) {
  if (cuda_sim) return std::make_unique<CudaExecutor>(part, 1, kind, CudaTarget::kSim);
  ExecutorOptions eo;
  eo.workers = 1;
  eo.pin = false;
  return std::make_unique<CpuExecutor>(part, 1, kind, eo);
}

bool same_on_every_rank(const void* data, size_t bytes) {
  const size_t padded = (bytes + 3) / 4 * 4;
  std::vector<uint8_t> mine(padded, 0), all(padded * size_t(mpi->size()));
  std::memcpy(mine.data(), data, bytes);
  mpi->all_gather(mine.data(), all.data(), padded / 4, Elem::kF32);
  for (int r = 1; r < mpi->size(); ++r)
    if (std::memcmp(all.data(), all.data() + size_t(r) * padded, bytes) != 0) return false;
  return true;
}

// Prefill (chunks of 8 rows: multi-row steps) and teacher-forced decode of the golden ids on a
// rank of `layout`, against the whole model's reference path: on a CPU executor of one worker,
// or (cuda_sim) a CUDA executor on the simulation.
void check_golden(const std::string& name, ShardLayout layout, Precision prec, ExecutorKind kind,
                  bool cuda_sim = false) {
  const Golden g = golden(name);
  Shard shard;
  shard.layout = layout;
  shard.rank = mpi->rank();
  const std::string what = name + " " + describe_shard(shard) + " " +
                           (prec == Precision::FP32 ? "fp32 " : "bf16 ") +
                           std::string(executor_name(kind)) + (cuda_sim ? " on cuda-sim" : "");
  Model whole(g.dir, opts(prec));
  Model part(g.dir, opts(prec), shard, mpi);
  ASSERT_TRUE(part.shard().sharded());
  const int64_t V = whole.config().vocab_size;
  std::unique_ptr<Executor> exp = rank_executor(part, kind, cuda_sim);
  Executor& ex = *exp;
  SequenceState r = whole.new_sequence(), s = ex.new_sequence();
  std::vector<float> want(static_cast<size_t>(V)), got(static_cast<size_t>(V));
  whole.forward(r, g.prompt, want.data(), false);
  ex.prefill(s, g.prompt, got.data(), 8);
  int checked = 0;
  for (size_t i = 0; i <= g.decode.size(); ++i) {
    const std::string at = what + " position " + std::to_string(s.pos);
    const double scale = max_abs(want);
    if (prec == Precision::FP32) {
      double err = 0;
      for (size_t j = 0; j < want.size(); ++j)
        err = std::max(err, double(std::fabs(got[j] - want[j])));
      EXPECT_LE(err, 1e-4 * scale) << at;
    }
    if (lead(want) > 1.0 / 64) {
      EXPECT_EQ(argmax(got), argmax(want)) << at;
      ++checked;
    }
    EXPECT_TRUE(same_on_every_rank(got.data(), got.size() * 4))
        << "logits differ between ranks, " << at;
    if (i == g.decode.size()) break;
    whole.forward(r, std::span(&g.decode[i], 1), want.data(), false);
    SequenceState* seqs[] = {&s};
    int32_t next = -1;
    ex.step(seqs, std::span(&g.decode[i], 1), got.data(), &next);
    EXPECT_EQ(next, argmax(got)) << "the plan's greedy pick, " << at;
  }
  EXPECT_GT(checked, 0) << what << ": no position had a clear greedy token";
}

TEST(MpiShard, GoldenModelsMatchTheWholeModelInEveryLayout) {
  int ran = 0;
  for (const char* name : {"tiny", "small", "k3-tiny"}) {
    const ModelConfig cfg = load_config_file(golden(name).dir + "/config.json");
    for (ShardLayout l : layouts(mpi->size())) {
      Shard s;
      s.layout = l;
      s.rank = mpi->rank();
      try {
        check_layout(cfg, s);
      } catch (const Error& e) {
        // A layout the geometry does not divide (tiny's two heads over four ranks): rejected
        // at load, naming what does not divide.
        EXPECT_THROW(Model(golden(name).dir, opts(Precision::FP32), s, mpi), Error) << name;
        EXPECT_NE(std::string(e.what()).find("do not divide"), std::string::npos) << e.what();
        continue;
      }
      for (Precision p : {Precision::FP32, Precision::BF16})
        for (ExecutorKind k : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
          check_golden(name, l, p, k);
          ++ran;
        }
    }
  }
  EXPECT_GT(ran, 0);
}

// The CUDA executors on the simulation, whose device memory is host memory: each collective is
// exchanged by the host over this run's MPI communicator between launches (op by op before its
// phase; the megakernel in segments between them), the same checks as above. The tiny and K3
// tiny goldens, every layout, FP32 on both executors and BF16 on the megakernel. Four ranks
// divide neither tiny model (two heads), so there `small` runs instead (its geometry divides).
TEST(MpiShard, CudaSimRanksMatchTheWholeModel) {
  cuda::sim::Config saved = cuda::sim::config();
  cuda::sim::config().sm_count = 3;
  int ran = 0;
  for (const char* name : {"tiny", "k3-tiny", "small"}) {
    if (std::string(name) == "small" && ran > 0) break;
    const ModelConfig cfg = load_config_file(golden(name).dir + "/config.json");
    for (ShardLayout l : layouts(mpi->size())) {
      Shard s;
      s.layout = l;
      s.rank = mpi->rank();
      try {
        check_layout(cfg, s);
      } catch (const Error&) {
        continue;  // (the layouts the geometry does not divide: the test above)
      }
      check_golden(name, l, Precision::FP32, ExecutorKind::kMegakernel, true);
      check_golden(name, l, Precision::FP32, ExecutorKind::kOpByOp, true);
      check_golden(name, l, Precision::BF16, ExecutorKind::kMegakernel, true);
      ran += 3;
    }
  }
  EXPECT_GT(ran, 0);
  cuda::sim::config() = saved;
}

// Free-running generation on `small` (BF16), per layout and executor: greedy tokens are the
// official model's over the golden greedy run's clean stretch (golden.json "greedy": the steps
// before the first router decision closer than 2e-3, where no reordering can flip an expert),
// and sampled tokens (temperature, top-p, a repetition penalty, a seed) are the same on every rank.
TEST(MpiShard, GenerationIsTheSameOnEveryRankAndGreedyIsTheGoldensOverItsCleanStretch) {
  const std::string dir = test::data_dir() + "/data/golden/small";
  std::ifstream f(dir + "/golden.json");
  const nlohmann::json greedy = nlohmann::json::parse(f)["greedy"];
  std::vector<int32_t> prompt, want;
  for (auto& v : greedy["prompt_ids"]) prompt.push_back(v.get<int32_t>());
  for (auto& v : greedy["tokens"]) want.push_back(v.get<int32_t>());
  const size_t clean = greedy["clean_steps"].get<size_t>();
  ASSERT_GE(clean, 20u);
  want.resize(clean);
  for (ShardLayout l : layouts(mpi->size())) {
    Shard shard;
    shard.layout = l;
    shard.rank = mpi->rank();
    Model part(dir, opts(Precision::BF16), shard, mpi);
    const int64_t V = part.config().vocab_size;
    for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp})
      for (bool sampled : {false, true}) {
        const std::string what = describe_shard(shard) + " " + std::string(executor_name(kind)) +
                                 (sampled ? " sampled" : " greedy");
        std::unique_ptr<Executor> exp = rank_executor(part, kind, false);
        Executor& ex = *exp;
        SamplingParams sp;
        sp.temperature = sampled ? 0.8f : 0.0f;
        sp.top_p = sampled ? 0.9f : 1.0f;
        sp.repetition_penalty = sampled ? 1.1f : 1.0f;
        sp.seed = 1234;
        Sampler sampler(sp, V);
        SequenceState s = ex.new_sequence();
        std::vector<float> logits(static_cast<size_t>(V));
        ex.prefill(s, prompt, logits.data(), 8);
        std::vector<int32_t> hist(prompt), got;
        SampleScratch scratch;
        int32_t next = sample_row(sampler.prepare(hist), logits, scratch);
        for (size_t t = 0; t < clean; ++t) {
          got.push_back(next);
          hist.push_back(next);
          SampleRow row = sampler.prepare(hist);
          SequenceState* seqs[] = {&s};
          ex.step(seqs, std::span(&hist.back(), 1), logits.data(), &next, std::span(&row, 1));
        }
        EXPECT_TRUE(same_on_every_rank(got.data(), got.size() * 4)) << what;
        if (!sampled) {
          EXPECT_EQ(got, want) << what;
        }
      }
  }
}

// A greedy step whose caller wants only the tokens exchanges each rank's (max, id) per row (8
// bytes) instead of its vocabulary block of logits: the same ids as the full gather, step after
// step (two sequences fed the same tokens in lockstep, one each way), fewer bytes, and the same
// ids on every rank. A sampled row or a wanted logits row takes the full gather (checked by the
// byte counts). The CPU executors, and the CUDA ones on the simulation (fewer steps: slower),
// whose sample tiles write the pairs and whose host trades them after the step.
TEST(MpiShard, GreedyStepsExchangeMaxIdPairsInsteadOfLogits) {
  const std::string dir = test::data_dir() + "/data/golden/small";
  const Golden g = golden("small");
  cuda::sim::Config saved = cuda::sim::config();
  cuda::sim::config().sm_count = 3;
  for (ShardLayout l : layouts(mpi->size())) {
    Shard shard;
    shard.layout = l;
    shard.rank = mpi->rank();
    Model part(dir, opts(Precision::BF16), shard, mpi);
    const int64_t V = part.config().vocab_size;
    const uint64_t block = uint64_t((V + mpi->size() - 1) / mpi->size()) * 4;
    for (bool on_cuda : {false, true})
      for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
        const std::string what = describe_shard(shard) + " " + std::string(executor_name(kind)) +
                                 (on_cuda ? " on cuda-sim" : "");
        std::unique_ptr<Executor> exp = rank_executor(part, kind, on_cuda);
        Executor& ex = *exp;
        SequenceState a = ex.new_sequence(), b = ex.new_sequence();
        std::vector<float> logits(static_cast<size_t>(V));
        ex.prefill(a, g.prompt, logits.data(), 8);
        ex.prefill(b, g.prompt, logits.data(), 8);
        int32_t tok = argmax(logits);
        std::vector<int32_t> ids;
        for (int t = 0; t < (on_cuda ? 4 : 12); ++t) {
          int32_t na = -1, nb = -1;
          SequenceState* sa[] = {&a};
          SequenceState* sb[] = {&b};
          const Communicator::Counters c0 = mpi->counters();
          ex.step(sa, std::span(&tok, 1), logits.data(), &na);  // logits wanted: the full gather
          const Communicator::Counters c1 = mpi->counters();
          ex.step(sb, std::span(&tok, 1), nullptr, &nb);  // ids only: the exchange
          const Communicator::Counters c2 = mpi->counters();
          ASSERT_EQ(nb, na) << what << " step " << t;
          ASSERT_EQ(na, argmax(logits)) << what << " step " << t;
          const uint64_t full = c1.bytes_sent - c0.bytes_sent,
                         pairs = c2.bytes_sent - c1.bytes_sent;
          ASSERT_GT(full, pairs) << what;
          EXPECT_EQ((full - pairs) % (block - 8), 0u) << what << ": " << full << " vs " << pairs;
          ids.push_back(nb);
          tok = nb;
        }
        EXPECT_TRUE(same_on_every_rank(ids.data(), ids.size() * 4)) << what;
        // A sampled row needs every logit: the full gather, with its bytes.
        SamplingParams sp;
        sp.temperature = 0.7f;
        sp.seed = 5;
        Sampler sampler(sp, V);
        std::vector<int32_t> hist = g.prompt;
        SampleRow row = sampler.prepare(hist);
        int32_t n1 = -1;
        SequenceState* sb[] = {&b};
        const Communicator::Counters c0 = mpi->counters();
        ex.step(sb, std::span(&tok, 1), nullptr, &n1, std::span(&row, 1));
        const Communicator::Counters c1 = mpi->counters();
        SequenceState* sa[] = {&a};
        ex.step(sa, std::span(&tok, 1), logits.data(), &n1, std::span(&row, 1));
        const Communicator::Counters c2 = mpi->counters();
        EXPECT_EQ(c1.bytes_sent - c0.bytes_sent, c2.bytes_sent - c1.bytes_sent) << what;
      }
  }
  cuda::sim::config() = saved;
}

// Layouts that cannot run are errors at start, on every rank, naming the problem.
TEST(MpiShard, BadLayoutsAreRejected) {
  const Golden g = golden("small");
  Shard s;
  s.rank = mpi->rank();
  s.layout = {mpi->size() * 2, 1};  // more ranks than the run has
  try {
    Model m(g.dir, opts(Precision::FP32), s, mpi);
    ADD_FAILURE() << "a layout of twice the ranks loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mpirun -np"), std::string::npos) << e.what();
  }
  s.layout = {3, 1};  // 3 does not divide small's 4 heads (and is not the world)
  EXPECT_THROW(Model(g.dir, opts(Precision::FP32), s, mpi), Error);
  s.layout = {1, mpi->size()};
  s.rank = mpi->size();  // no such rank
  EXPECT_THROW(check_layout(load_config_file(g.dir + "/config.json"), s), Error);
}

// Each rank holds its share: less than the whole model, and together the ranks hold at least
// the whole model (replicated parts counted on each).
TEST(MpiShard, RanksHoldTheirShare) {
  const Golden g = golden("small");
  Shard s;
  s.layout = {mpi->size(), 1};
  s.rank = mpi->rank();
  Model whole(g.dir, opts(Precision::BF16));
  Model part(g.dir, opts(Precision::BF16), s, mpi);
  double total = 0;
  for (const auto& [name, t] : whole.checkpoint().tensors()) total += double(t.nbytes);
  // The embedding is a whole mapping (one row read per token): not counted.
  total -= double(whole.weights().embed.bytes());
  const double held = part.shard_bytes().held();
  EXPECT_LT(held, 0.75 * total) << "rank " << s.rank << " holds " << held << " of " << total;
  float sum = float(held);
  mpi->all_reduce_sum(&sum, 1, Elem::kF32);
  EXPECT_GE(sum, 0.99 * total);
}

}  // namespace
}  // namespace md::dist
