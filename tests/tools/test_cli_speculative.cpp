// The speculative flags of run, generate and bench: greedy output equal to plain decoding (n-gram
// and a DSpark draft from make-model --draft-for), statistics printed, bad values as one-line
// errors, the bench's speculative table.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

class CliSpeculative : public ::testing::Test {
 protected:
  static std::string model() { return test::shared_text_checkpoint("tiny", 5); }
};

void expect_one_line_error(const test::CommandResult& r, const std::string& what) {
  EXPECT_NE(r.status, 0);
  EXPECT_LT(r.status, 128) << "killed by a signal: " << r.err;
  EXPECT_THAT(r.err, HasSubstr(what));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST_F(CliSpeculative, GenerateEqualsPlainGreedy) {
  const std::string base =
      "generate --model " + model() + " --ids 5,6,7,5,6,7,5 --max-tokens 23 --ignore-eos";
  auto plain = test::run_cli(base + " --executor megakernel");
  ASSERT_EQ(plain.status, 0) << plain.err;
  for (const std::string& flags :
       {std::string(" --speculative ngram"),
        std::string(" --speculative ngram --num-draft-tokens 1"),
        std::string(
            " --speculative ngram --num-draft-tokens 15 --executor opbyop --ngram-max 2")}) {
    auto r = test::run_cli(base + flags);
    ASSERT_EQ(r.status, 0) << flags << ": " << r.err;
    EXPECT_EQ(r.out, plain.out) << flags;
    EXPECT_THAT(r.err, HasSubstr("drafts accepted"));
  }
  // A DSpark draft made for the checkpoint.
  test::TempDir d("cli_draft");
  auto mk = test::run_cli("make-model --draft-for " + model() + " --out " + d.path());
  ASSERT_EQ(mk.status, 0) << mk.err;
  auto r = test::run_cli(base + " --draft " + d.path());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, plain.out);
  EXPECT_THAT(r.err, HasSubstr("speculative (dspark, K=7)"));
  r = test::run_cli(base + " --speculative " + d.path() + " --num-draft-tokens 3");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, plain.out);
  // The draft's host forward drafts the same tokens (the same statistics line too).
  auto on_ex = test::run_cli(base + " --draft " + d.path() + " --draft-on executor");
  auto host = test::run_cli(base + " --draft " + d.path() + " --draft-on host");
  ASSERT_EQ(host.status, 0) << host.err;
  ASSERT_EQ(on_ex.status, 0) << on_ex.err;
  EXPECT_EQ(host.out, plain.out);
  EXPECT_EQ(on_ex.out, plain.out);
  // "speculative (dspark, K=7): S steps, A of D drafts accepted" (the timings before it vary).
  auto accepted = [](const std::string& err) {
    const size_t from = err.find("speculative ("), to = err.find("drafts accepted");
    return from == std::string::npos || to == std::string::npos ? std::string()
                                                                : err.substr(from, to - from);
  };
  EXPECT_EQ(accepted(host.err), accepted(on_ex.err));
  EXPECT_NE(accepted(host.err), "");
  expect_one_line_error(test::run_cli(base + " --draft " + d.path() + " --draft-on gpu"),
                        "--draft-on");
}

TEST_F(CliSpeculative, RunGreedyEqualsPlainAndReportsStatistics) {
  const std::string base = "run --model " + model() +
                           " --prompt 'one two one two one' -n 20 -t 0 "
                           "--raw --json --ignore-eos";
  // Plain decoding through the same plan (the reference path's one-call prefill differs from the
  // plan's chunks in fp32 order, which can flip a near tie).
  auto plain = test::run_cli(base + " --executor megakernel");
  ASSERT_EQ(plain.status, 0) << plain.err;
  auto spec = test::run_cli(base + " --speculative ngram --num-draft-tokens 3");
  ASSERT_EQ(spec.status, 0) << spec.err;
  const auto a = nlohmann::json::parse(plain.out), b = nlohmann::json::parse(spec.out);
  EXPECT_EQ(a["tokens"], b["tokens"]);
  EXPECT_TRUE(a["speculative"].is_null());
  EXPECT_EQ(b["speculative"]["drafted"].get<int>(), 3 * b["speculative"]["steps"].get<int>());
  // Streaming: the statistics line.
  auto s = test::run_cli("run --model " + model() +
                         " --prompt 'hello' -n 10 --seed 3 --ignore-eos "
                         "--speculative ngram --fixed-acceptance-length 2 --num-draft-tokens 2");
  ASSERT_EQ(s.status, 0) << s.err;
  EXPECT_THAT(s.err, HasSubstr("[speculative: "));
  EXPECT_THAT(s.err, HasSubstr("3.00 tokens a step"));
}

TEST_F(CliSpeculative, BadValuesAreOneLineErrors) {
  const std::string run = "run --model " + model() + " --prompt hi -n 4";
  expect_one_line_error(test::run_cli(run + " --speculative ngram --num-draft-tokens 16"),
                        "--num-draft-tokens 16 is not in 1..15");
  expect_one_line_error(test::run_cli(run + " --speculative ngram --num-draft-tokens 0"),
                        "--num-draft-tokens 0 is not in 1..15");
  expect_one_line_error(test::run_cli(run + " --num-draft-tokens 3"),
                        "--num-draft-tokens needs --speculative or --draft");
  expect_one_line_error(test::run_cli(run + " --fixed-acceptance-length 1"),
                        "--fixed-acceptance-length needs --speculative or --draft");
  expect_one_line_error(
      test::run_cli(run + " --speculative ngram --num-draft-tokens 3 --fixed-acceptance-length 4"),
      "--fixed-acceptance-length 4 is not in 0..3");
  expect_one_line_error(test::run_cli(run + " --speculative bigram"),
                        "--speculative 'bigram': expected ngram or a draft checkpoint directory");
  expect_one_line_error(test::run_cli(run + " --draft /nonexistent/draft"),
                        "--draft /nonexistent/draft: no config.json there");
  expect_one_line_error(test::run_cli(run + " --speculative ngram --draft /tmp"),
                        "--speculative and --draft exclude each other");
  expect_one_line_error(test::run_cli(run + " --speculative ngram --executor reference"),
                        "needs a plan executor");
  expect_one_line_error(test::run_cli("generate --model " + model() +
                                      " --ids 1,2 --speculative ngram "
                                      "--executor reference"),
                        "needs a plan executor");
  // A draft made for another target.
  test::TempDir other("cli_other"), d("cli_draft_other");
  ASSERT_EQ(test::run_cli("make-model --preset small --out " + other.path()).status, 0);
  ASSERT_EQ(test::run_cli("make-model --draft-for " + other.path() + " --out " + d.path()).status,
            0);
  expect_one_line_error(test::run_cli(run + " --draft " + d.path()), "does not match the target");
}

TEST_F(CliSpeculative, BenchReportsStepsAgainstPlainDecode) {
  auto r = test::run_cli("bench --model " + model() +
                         " --speculative ngram --num-draft-tokens 3 "
                         "--fixed-acceptance-length 0,3 --steps 4 --reps 1 --executor megakernel");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("== speculative: ngram drafter, K = 3"));
  EXPECT_THAT(r.out, HasSubstr("plain tok/s"));
  EXPECT_EQ(r.out.find("== decode"), std::string::npos) << "only the speculative bench";
  // Two rows (fixed 0 and 3), each with 1 and 4 tokens a step.
  EXPECT_THAT(r.out, HasSubstr("1.00"));
  EXPECT_THAT(r.out, HasSubstr("4.00"));
  expect_one_line_error(test::run_cli("bench --model " + model() + " --num-draft-tokens 3"),
                        "need --speculative");
  // The agreeing draft: every draft accepted by the model's own rule (K = 5: 6 tokens a step),
  // the emitted tokens checked against plain greedy decoding inside the bench.
  test::TempDir out("cli_oracle");
  const std::string json = out.path() + "/oracle.json";
  r = test::run_cli("bench --model " + model() +
                    " --speculative oracle --num-draft-tokens 5 --steps 3 --reps 1 --executor "
                    "opbyop --json " + json);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("== speculative: oracle drafter, K = 5"));
  std::ifstream f(json);
  const nlohmann::json j = nlohmann::json::parse(f);
  const nlohmann::json& cell = j.at("speculative").at("results").at(0);
  EXPECT_EQ(cell.at("accepted_per_step").get<double>(), 5.0);
  EXPECT_EQ(cell.at("tokens_per_step").get<double>(), 6.0);
}

}  // namespace
}  // namespace md
