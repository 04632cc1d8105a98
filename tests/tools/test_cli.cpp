// The CLI on bad input: one line on stderr naming the problem, a nonzero exit, never a crash.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "megadecode/base/threads.h"
#include "megadecode/model/presets.h"
#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

// One tiny checkpoint shared by the CLI tests.
class Cli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir("cli_model");
    ThreadPool pool(2, false);
    make_random_checkpoint(preset_config("tiny"), dir_->path(), 5, 1, pool);
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string model() { return dir_->path(); }
  static test::TempDir* dir_;
};
test::TempDir* Cli::dir_ = nullptr;

void expect_one_line_error(const test::CommandResult& r, const std::string& what) {
  EXPECT_NE(r.status, 0);
  EXPECT_LT(r.status, 128) << "killed by a signal: " << r.err;
  EXPECT_THAT(r.err, HasSubstr(what));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST_F(Cli, LogitsPrintsOneJsonLinePerPosition) {
  auto r = test::run_cli("logits --model " + model() + " --ids 1,2,3,4 --prefill 2");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 4);
  EXPECT_THAT(r.out, HasSubstr("{\"pos\": 3, \"logits\": ["));
}

TEST_F(Cli, GenerateAndInspect) {
  auto r = test::run_cli("generate --model " + model() + " --ids 1,2 --max-tokens 5 --ignore-eos");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), ' '), 4) << r.out;
  r = test::run_cli("inspect --model " + model());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("4: 2 KDA + 2 MLA  [KMKM]"));
}

TEST_F(Cli, BadIds) {
  expect_one_line_error(test::run_cli("logits --model " + model() + " --ids 1,x,3"),
                        "'x' is not a non-negative integer token id");
  expect_one_line_error(test::run_cli("logits --model " + model() + " --ids 1,,3"),
                        "'' is not a non-negative integer");
  expect_one_line_error(test::run_cli("logits --model " + model() + " --ids 1,99999"),
                        "token id 99999 is outside the vocabulary [0, 1024)");
  expect_one_line_error(test::run_cli("logits --model " + model() + " --ids -1"),
                        "'-1' is not a non-negative integer");
  expect_one_line_error(test::run_cli("logits --model " + model() + " --ids 1,2 --prefill 3"),
                        "--prefill 3 must be in 0..2");
}

TEST_F(Cli, BadModelDirectory) {
  expect_one_line_error(test::run_cli("logits --model /nonexistent/dir --ids 1"),
                        "/nonexistent/dir does not exist");
  test::TempDir d("cli_bad");
  {
    std::ofstream(d / "config.json") << "{ not json";
  }
  expect_one_line_error(test::run_cli("inspect --model " + d.path()), "invalid JSON");
  {
    std::ofstream(d / "config.json") << "{\"model_type\": \"kimi_linear\"}";
  }
  expect_one_line_error(test::run_cli("inspect --model " + d.path()), "missing field");
}

TEST_F(Cli, BadFlags) {
  auto r = test::run_cli("make-model --preset nope --out /tmp/md_never");
  expect_one_line_error(r, "unknown preset 'nope'");
  r = test::run_cli("logits --model " + model() + " --ids 1 --precision fp8");
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.err, HasSubstr("--precision"));
  r = test::run_cli("frobnicate");
  EXPECT_NE(r.status, 0);
}

}  // namespace
}  // namespace md
