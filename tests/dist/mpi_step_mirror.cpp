// Rank 0's steps on every rank (exec/step_mirror.h) under mpirun (Mpi.Np2, Mpi.Np4): rank 0 drives
// a sharded `small` through a StepLeader as a server would (sequences started while others run,
// mixed decode and prompt rows, a slot released and reused, a verify step cut back by a commit, a
// sequence copied into a new one (the prefix cache's copy_sequence), a step the executor
// refuses), the other ranks run follow_steps. Every sequence's greedy tokens
// must be the golden greedy run's over its clean stretch (golden.json: the steps before the first
// router near-tie, where no summation order can flip a token), the refused step must be refused
// on every rank without ending the run, and the followers must run exactly rank 0's steps.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "../exec/exec_test_util.h"
#include "../test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/dist/shard.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/exec/step_mirror.h"
#include "mpi_test.h"

namespace md {
namespace {

using test::mpi;

TEST(MpiStepMirror, FollowersRunRankZerosStepsAndGreedyIsTheGoldens) {
  const std::string dir = test::data_dir() + "/data/golden/small";
  std::ifstream f(dir + "/golden.json");
  const nlohmann::json greedy = nlohmann::json::parse(f)["greedy"];
  std::vector<int32_t> prompt, want;
  for (auto& v : greedy["prompt_ids"]) prompt.push_back(v.get<int32_t>());
  for (auto& v : greedy["tokens"]) want.push_back(v.get<int32_t>());
  const size_t clean = greedy["clean_steps"].get<size_t>();
  ASSERT_GE(clean, 12u);
  want.resize(clean);

  dist::Shard shard;
  shard.layout = {mpi->size(), 1};
  shard.rank = mpi->rank();
  Model part(dir, test::opts(Precision::BF16), shard, mpi);
  ExecutorOptions eo;
  eo.workers = 1;
  eo.pin = false;
  CpuExecutor ex(part, 4, ExecutorKind::kMegakernel, eo);

  int64_t steps = 0;  // steps that ran (rank 0: counted here; the others: follow_steps)
  if (mpi->rank() != 0) {
    steps = follow_steps(ex, *mpi);
  } else {
    StepLeader lead(ex, *mpi);
    const int64_t V = part.config().vocab_size;
    std::vector<float> logits(size_t(V) * 8);
    struct Run {
      SequenceState seq;
      std::vector<int32_t> got;
    };
    // Greedy decode steps of the given runs together; each run's next token is its last got.
    auto decode = [&](std::vector<Run*> runs) {
      std::vector<SequenceState*> seqs;
      std::vector<int32_t> toks, next(runs.size());
      for (Run* r : runs) {
        seqs.push_back(&r->seq);
        toks.push_back(r->got.back());
      }
      lead.step(seqs, toks, nullptr, next.data());
      ++steps;
      for (size_t i = 0; i < runs.size(); ++i) runs[i]->got.push_back(next[i]);
    };
    auto start = [&](Run& r) {  // the prompt in one 8-row chunk and the rest, first token
      r.seq = lead.new_sequence();
      lead.prefill(r.seq, prompt, logits.data(), 8);
      steps += int64_t((prompt.size() + 7) / 8);
      r.got = {int32_t(std::max_element(logits.begin(), logits.begin() + V) - logits.begin())};
    };

    Run a, b, c;
    start(a);
    for (int i = 0; i < 3; ++i) decode({&a});
    // b's prompt rides beside a's decode row in one step (mixed row counts).
    b.seq = lead.new_sequence();
    {
      const int32_t a_tok = a.got.back();
      StepSeq s[2];
      s[0] = {&a.seq, std::span(&a_tok, 1), LogitRows::kLast};
      s[1] = {&b.seq, std::span(prompt), LogitRows::kLast};
      int32_t next[2];
      lead.step(s, nullptr, next);
      ++steps;
      a.got.push_back(next[0]);
      b.got = {next[1]};
    }
    for (int i = 0; i < 3; ++i) decode({&a, &b});
    // A step the executor refuses (a token outside the vocabulary): refused on every rank,
    // before anything changes, and the run goes on.
    {
      SequenceState* seqs[] = {&a.seq};
      const int32_t bad = int32_t(V);
      int32_t next = 0;
      EXPECT_THROW(lead.step(seqs, std::span(&bad, 1), nullptr, &next), Error);
    }
    // A verify step: b's next token and two wrong drafts, kept for a commit to the first row.
    {
      const int32_t rows[3] = {b.got.back(), 7, 9};
      StepSeq s{&b.seq, std::span(rows), LogitRows::kAll};
      StepOptions so;
      so.keep_for_commit = true;
      lead.step(std::span(&s, 1), logits.data(), nullptr, {}, so);
      ++steps;
      b.got.push_back(
          int32_t(std::max_element(logits.begin(), logits.begin() + V) - logits.begin()));
      lead.commit(b.seq, 1);
    }
    // d: a copy of b (every rank copies its slices), decoded beside it from here on.
    Run d;
    d.seq = lead.new_sequence();
    lead.copy_sequence(d.seq, b.seq);
    d.got = b.got;
    EXPECT_EQ(d.seq.pos, b.seq.pos);
    // a leaves; c takes its slot while b runs.
    while (a.got.size() < clean) decode({&a, &b, &d});
    const std::vector<int32_t> a_got = a.got;
    a.seq = SequenceState();
    start(c);
    while (c.got.size() < clean)
      decode(b.got.size() < clean ? std::vector<Run*>{&b, &c} : std::vector<Run*>{&c});
    while (b.got.size() < clean) decode({&b});
    while (d.got.size() < clean) decode({&d});
    EXPECT_EQ(std::vector<int32_t>(a_got.begin(), a_got.begin() + clean), want) << "a";
    EXPECT_EQ(std::vector<int32_t>(b.got.begin(), b.got.begin() + clean), want) << "b";
    EXPECT_EQ(std::vector<int32_t>(c.got.begin(), c.got.begin() + clean), want) << "c";
    EXPECT_EQ(std::vector<int32_t>(d.got.begin(), d.got.begin() + clean), want) << "d";
    lead.stop();
    EXPECT_THROW(lead.step(std::vector<SequenceState*>{&b.seq}, std::vector<int32_t>{1}, nullptr,
                           std::vector<int32_t>(1).data()),
                 Error)
        << "a step after stop";
  }
  // Every rank ran the same steps.
  float mine = float(steps), all[64] = {};
  ASSERT_LE(mpi->size(), 64);
  mpi->all_gather(&mine, all, 1, dist::Elem::kF32);
  for (int r = 1; r < mpi->size(); ++r) EXPECT_EQ(all[r], all[0]) << "rank " << r;
  EXPECT_GT(all[0], 20);
}

}  // namespace
}  // namespace md
