// The executors from the command line: `logits --executor` (one sequence and --batch-ids) prints
// exactly what the reference prints on the golden model, and `bench` writes its table, JSON and
// SVG for a preset.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

std::string join(const nlohmann::json& a) {
  std::string s;
  for (auto& v : a) {
    if (!s.empty()) s += ',';
    s += std::to_string(v.get<int>());
  }
  return s;
}

TEST(ExecutorCli, LogitsOfEveryExecutorEqualTheReferenceOnTheGolden) {
  const std::string dir = test::data_dir() + "/data/golden/tiny";
  std::ifstream f(dir + "/golden.json");
  const nlohmann::json meta = nlohmann::json::parse(f);
  const std::string ids = join(meta["prompt_ids"]) + "," + join(meta["decode_ids"]);
  const std::string prefill = std::to_string(meta["prompt_ids"].size());
  const std::string one =
      "logits --model " + dir + " --ids " + ids + " --prefill " + prefill + " --threads 1";
  const std::string many = "logits --model " + dir + " --batch-ids '" + ids +
                           ";1,2,3,4,5,6;7,8' --prefill " + prefill + " --threads 1";
  auto ref1 = test::run_cli(one + " --executor reference");
  auto refn = test::run_cli(many + " --executor reference");
  ASSERT_EQ(ref1.status, 0) << ref1.err;
  ASSERT_EQ(refn.status, 0) << refn.err;
  EXPECT_EQ(std::count(ref1.out.begin(), ref1.out.end(), '\n'),
            int(meta["prompt_ids"].size() + meta["decode_ids"].size()));
  EXPECT_THAT(refn.out, HasSubstr("{\"seq\": 2, \"pos\": 1, \"logits\": ["));
  for (const char* ex : {"megakernel", "opbyop"}) {
    auto r1 = test::run_cli(one + " --executor " + ex + " --workers 3");
    ASSERT_EQ(r1.status, 0) << r1.err;
    EXPECT_TRUE(r1.out == ref1.out) << ex << " differs from the reference (single sequence)";
    auto rn = test::run_cli(many + " --executor " + ex + " --workers 2");
    ASSERT_EQ(rn.status, 0) << rn.err;
    EXPECT_TRUE(rn.out == refn.out) << ex << " differs from the reference (batch)";
  }
  auto bad = test::run_cli(one + " --executor fastest");
  EXPECT_NE(bad.status, 0);
}

// `run --executor`: text generation decoded by the plan (sampling inside the step) gives the
// reference path's tokens, greedy and sampled.
// The sampled run's prompt is one token, so that its prompt step is a decode step on both paths
// and every logit row they sample from is the same bits (the logits test above). A longer prompt
// goes through the plan in chunks of chained rows but through the reference path's chunked
// delta rule: the same function in exact arithmetic, other roundings in bf16, so a sampled draw
// near a boundary may flip (seen on an AVX2-only host at the 6th token). Greedy decoding of the
// chat prompt is kept: its argmax margins are far above that rounding.
TEST(ExecutorCli, RunWithAPlanExecutorGivesTheReferenceTokens) {
  test::TempDir d("runexec");
  auto mk = test::run_cli("make-model --preset tiny --seed 3 --out " + (d / "m"));
  ASSERT_EQ(mk.status, 0) << mk.err;
  for (const char* sampling :
       {"--prompt 'Hello there' --temperature 0",
        "--raw --prompt H --temperature 0.8 --top-p 0.9 --seed 11"}) {
    const std::string cmd = "run --model " + (d / "m") +
                            " --max-tokens 16 --ignore-eos --json " + sampling;
    auto ref = test::run_cli(cmd + " --executor reference");
    ASSERT_EQ(ref.status, 0) << ref.err;
    const auto want = nlohmann::json::parse(ref.out)["tokens"];
    EXPECT_EQ(want.size(), 16u);
    for (const char* ex : {"megakernel", "opbyop"}) {
      auto r = test::run_cli(cmd + " --executor " + ex + " --workers 2");
      ASSERT_EQ(r.status, 0) << r.err;
      EXPECT_EQ(nlohmann::json::parse(r.out)["tokens"], want) << ex << " " << sampling;
    }
  }
  auto bad = test::run_cli("run --model " + (d / "m") + " --prompt x --executor fast");
  EXPECT_NE(bad.status, 0);
}

TEST(ExecutorCli, BenchWritesTableJsonAndPlot) {
  test::TempDir d("bench");
  auto r = test::run_cli(
      "bench --preset tiny --batch 1,2 --steps 2 --reps 1 --workers 2 "
      "--executor megakernel,opbyop,reference --json " +
      (d / "b.json") + " --plot " + (d / "b.svg"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("megakernel / opbyop speed"));
  EXPECT_THAT(r.out, HasSubstr("% bw"));
  std::ifstream jf(d / "b.json");
  const nlohmann::json j = nlohmann::json::parse(jf);
  EXPECT_TRUE(j["machine"].contains("cpu_model"));
  EXPECT_GT(j["read_bandwidth_gbps"].get<double>(), 0);
  ASSERT_EQ(j["results"].size(), 6u);
  for (const auto& row : j["results"])
    for (const char* k : {"batch", "executor", "ms_per_step", "tokens_per_s", "bytes_per_step",
                          "gbps", "pct_of_bandwidth"})
      EXPECT_TRUE(row.contains(k)) << k;
  EXPECT_TRUE(j["ratio_megakernel_over_opbyop"].contains("1"));
  EXPECT_TRUE(j["ratio_megakernel_over_opbyop"].contains("2"));
  std::ifstream sf(d / "b.svg");
  std::string svg((std::istreambuf_iterator<char>(sf)), std::istreambuf_iterator<char>());
  EXPECT_THAT(svg, HasSubstr("<svg"));
  EXPECT_THAT(svg, HasSubstr("tokens / s"));
  EXPECT_THAT(svg, HasSubstr("megakernel"));
  // Kimi K3 through both executors (MXFP4 experts counted at 4.25 bits in bytes_per_step).
  r = test::run_cli(
      "bench --preset k3-tiny --batch 2 --steps 1 --reps 1 --workers 2 "
      "--executor megakernel,opbyop");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("megakernel / opbyop speed"));
  // Prefill, verify and mixed steps through the plan, in the JSON.
  r = test::run_cli(
      "bench --preset tiny --what prefill,verify,mixed --batch 2 --steps 1 --reps 1 --workers 2 "
      "--prompt 20 --chunks 8 --mixed-chunk 5 --context 7 --executor megakernel,opbyop --json " +
      (d / "m.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("== mixed: 2 decode rows + a 5-row prefill chunk at position 7"));
  std::ifstream mf(d / "m.json");
  const nlohmann::json mj = nlohmann::json::parse(mf);
  ASSERT_EQ(mj["mixed"]["results"].size(), 2u);
  for (const auto& row : mj["mixed"]["results"]) {
    EXPECT_EQ(row["batch"].get<int>(), 2);
    EXPECT_GT(row["mixed_ms"].get<double>(), 0);
    EXPECT_GT(row["separate_ms"].get<double>(), 0);
  }
  EXPECT_TRUE(mj.contains("verify"));
  EXPECT_NE(test::run_cli("bench --preset tiny --what mixed --executor reference").status, 0);
  // The preset's temporary checkpoint is gone.
  auto bad = test::run_cli("bench --preset tiny --batch 0");
  EXPECT_NE(bad.status, 0);
  bad = test::run_cli("bench --preset tiny --model x");
  EXPECT_NE(bad.status, 0);
}


// --no-mmap (the checkpoint copied into huge-page memory) decodes the same tokens as the mapped
// checkpoint, and bench --profile reports each op's run and wait time per step.
TEST(ExecutorCli, NoMmapAndBenchProfile) {
  test::TempDir d("nommap");
  auto mk = test::run_cli("make-model --preset tiny --seed 4 --out " + (d / "m") + " --shards 2");
  ASSERT_EQ(mk.status, 0) << mk.err;
  const std::string cmd = "run --model " + (d / "m") +
                          " --prompt 'Hello there' --max-tokens 8 --ignore-eos --json "
                          "--executor megakernel --workers 2";
  auto mapped = test::run_cli(cmd);
  auto copied = test::run_cli(cmd + " --no-mmap");
  ASSERT_EQ(mapped.status, 0) << mapped.err;
  ASSERT_EQ(copied.status, 0) << copied.err;
  EXPECT_EQ(nlohmann::json::parse(copied.out)["tokens"],
            nlohmann::json::parse(mapped.out)["tokens"]);

  auto r = test::run_cli("bench --model " + (d / "m") +
                         " --batch 1 --steps 2 --reps 1 --workers 2 --executor megakernel,opbyop "
                         "--no-mmap --profile --json " + (d / "b.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("copied into memory (--no-mmap)"));
  EXPECT_THAT(r.out, HasSubstr("profile, batch 1, megakernel"));
  EXPECT_THAT(r.out, HasSubstr("profile, batch 1, opbyop"));
  std::ifstream jf(d / "b.json");
  const nlohmann::json j = nlohmann::json::parse(jf);
  EXPECT_EQ(j["weights_load"], "copy");
  EXPECT_GE(j["weights_huge_page_fraction"].get<double>(), 0.0);
  EXPECT_LE(j["weights_huge_page_fraction"].get<double>(), 1.0);
  ASSERT_EQ(j["results"].size(), 2u);
  for (const auto& row : j["results"]) {
    const auto& p = row["profile_ms_per_step"];
    // Every decode step runs the projections and the LM head; opbyop also waits at barriers.
    ASSERT_TRUE(p.contains("kda_proj")) << row;
    EXPECT_GT(p["kda_proj"]["run_ms"].get<double>(), 0);
    EXPECT_GT(p["lm_head"]["run_ms"].get<double>(), 0);
  }
}

}  // namespace
}  // namespace md
