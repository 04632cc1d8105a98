// `megadecode serve` as a process: it prints its address, answers, logs one line per request,
// and exits 0 soon after SIGTERM (and SIGINT) even with a stream running.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "megadecode/base/util.h"
#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct ServeProcess {
  pid_t pid = -1;
  int port = 0;
  test::TempDir dir{"serve"};
  explicit ServeProcess(const std::string& args) {
    const std::string log = dir / "err";
    pid = fork();
    if (pid == 0) {
      const std::string cmd =
          std::string("exec ") + MD_CLI_PATH + " serve " + args + " --port 0 > /dev/null 2> " + log;
      execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
      _exit(127);
    }
    // (No std::regex: GCC 12 warns inside it under the sanitizer builds' -O1.)
    const std::string addr = "http://127.0.0.1:";
    for (int i = 0; i < 3000 && port == 0; ++i) {
      const std::string s = slurp(log);
      const size_t at = s.find(addr);
      // The whole line is there once " serving" follows the port.
      if (at != std::string::npos && s.find(" serving", at) != std::string::npos)
        port = std::atoi(s.c_str() + at + addr.size());
      if (port == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  std::string log() { return slurp(dir / "err"); }
  // Sends `sig` and waits (up to 20 s) for the exit status.
  int stop(int sig, double* seconds) {
    const double t0 = now_seconds();
    kill(pid, sig);
    int status = 0;
    for (int i = 0; i < 2000; ++i) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        *seconds = now_seconds() - t0;
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  ~ServeProcess() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

TEST(ServerCli, ServesAndExitsCleanlyOnSignals) {
  const std::string model = test::shared_text_checkpoint("tiny", 5);
  for (int sig : {SIGTERM, SIGINT}) {
    // SIGINT runs on the reference executor, to cover --executor reference too.
    ServeProcess p("--model " + model + " --workers 1 --max-batch 2 --served-model-name tiny " +
                   "--shutdown-grace 0.5" + (sig == SIGINT ? " --executor reference" : ""));
    ASSERT_GT(p.port, 0) << p.log();
    EXPECT_THAT(p.log(), HasSubstr("serving 'tiny'"));
    httplib::Client c("127.0.0.1", p.port);
    auto r = c.Post("/v1/completions", R"({"prompt":"hi","max_tokens":3,"model":"tiny"})",
                    "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    // A long stream is running when the signal comes: it is cut at the grace period.
    std::thread streamer([&] {
      httplib::Client s("127.0.0.1", p.port);
      s.set_read_timeout(30);
      s.Post("/v1/completions",
             R"({"prompt":"hi","max_tokens":16000,"ignore_eos":true,"stream":true})",
             "application/json");
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    double seconds = 0;
    EXPECT_EQ(p.stop(sig, &seconds), 0) << p.log();
    EXPECT_LT(seconds, 10.0);
    streamer.join();
    const std::string log = p.log();
    EXPECT_THAT(log, HasSubstr("POST /v1/completions 200 prompt_tokens="));
    EXPECT_THAT(log, HasSubstr("completion_tokens=3"));
    EXPECT_THAT(log, HasSubstr("stopped"));
  }
}

// A Kimi K3 checkpoint: the chat's generation prompt opens the think channel, so the text goes
// to reasoning_content; with thinking off it opens the response, so it goes to content.
TEST(ServerCli, KimiK3ThinkChannelIsReasoningContent) {
  test::TempDir d("k3serve");
  auto made = test::run_cli("make-model --preset k3-tiny --seed 2 --out " + d.path() + " --force");
  ASSERT_EQ(made.status, 0) << made.err;
  ServeProcess p("--model " + d.path() + " --workers 1 --max-batch 1 --max-model-len 1024");
  ASSERT_GT(p.port, 0) << p.log();
  httplib::Client c("127.0.0.1", p.port);
  c.set_read_timeout(60);
  auto chat = [&](bool thinking) {
    nlohmann::json body = {{"messages", {{{"role", "user"}, {"content", "hello"}}}},
                           {"max_tokens", 12},
                           {"temperature", 0},
                           {"ignore_eos", true},
                           {"chat_template_kwargs", {{"thinking", thinking}}}};
    auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
    EXPECT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    return nlohmann::json::parse(r->body)["choices"][0]["message"];
  };
  const nlohmann::json think = chat(true), plain = chat(false);
  ASSERT_TRUE(think.contains("reasoning_content")) << think.dump();
  EXPECT_FALSE(think["reasoning_content"].get<std::string>().empty());
  EXPECT_FALSE(plain.contains("reasoning_content")) << plain.dump();
  EXPECT_FALSE(plain["content"].get<std::string>().empty()) << plain.dump();
  // Streamed, the think channel comes as reasoning_content deltas adding up to the same text.
  nlohmann::json sbody = {{"messages", {{{"role", "user"}, {"content", "hello"}}}},
                          {"max_tokens", 12},
                          {"temperature", 0},
                          {"ignore_eos", true},
                          {"stream", true}};
  auto sr = c.Post("/v1/chat/completions", sbody.dump(), "application/json");
  ASSERT_TRUE(sr);
  std::string reasoning, content;
  for (size_t pos = 0; (pos = sr->body.find("data: {", pos)) != std::string::npos; ++pos) {
    const nlohmann::json delta = nlohmann::json::parse(
        sr->body.substr(pos + 6, sr->body.find("\n\n", pos) - pos - 6))["choices"][0]["delta"];
    if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"].get<std::string>();
    if (delta.contains("content")) content += delta["content"].get<std::string>();
  }
  EXPECT_EQ(reasoning, think["reasoning_content"]);
  EXPECT_EQ(content, think["content"]);
  // The Responses API: the think channel is a reasoning item before the message; with
  // reasoning.effort "none" thinking is off.
  auto respond = [&](nlohmann::json extra) {
    nlohmann::json body = {{"input", "hello"},
                           {"max_output_tokens", 12},
                           {"temperature", 0},
                           {"ignore_eos", true}};
    body.update(extra);
    auto r = c.Post("/v1/responses", body.dump(), "application/json");
    EXPECT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    return nlohmann::json::parse(r->body);
  };
  const nlohmann::json rt = respond(nlohmann::json::object());
  ASSERT_EQ(rt["output"][0]["type"], "reasoning") << rt.dump();
  EXPECT_EQ(rt["output"][0]["content"][0]["text"], think["reasoning_content"]);
  EXPECT_GT(rt["usage"]["output_tokens_details"]["reasoning_tokens"].get<int>(), 0);
  if (!think["content"].get<std::string>().empty()) {
    ASSERT_EQ(rt["output"].size(), 2u) << rt.dump();
    EXPECT_EQ(rt["output"][1]["content"][0]["text"], think["content"]);
  }
  const nlohmann::json rp = respond({{"reasoning", {{"effort", "none"}}}});
  ASSERT_EQ(rp["output"].size(), 1u) << rp.dump();
  EXPECT_EQ(rp["output"][0]["type"], "message");
  EXPECT_EQ(rp["output"][0]["content"][0]["text"], plain["content"]);
  double seconds = 0;
  EXPECT_EQ(p.stop(SIGTERM, &seconds), 0) << p.log();
}

TEST(ServerCli, BadFlagsAreOneLineErrors) {
  const std::string model = test::shared_text_checkpoint("tiny", 5);
  auto r = test::run_cli("serve --model " + model + " --max-model-len 100000 --port 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("--max-model-len"));
  r = test::run_cli("serve --model /nonexistent --port 0");
  EXPECT_EQ(r.status, 1);
  r = test::run_cli("serve --model " + model + " --speculative ngram --num-draft-tokens 16");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("--num-draft-tokens 16 is not in 1..15"));
  r = test::run_cli("serve --model " + model + " --speculative ngram --executor reference");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("needs a plan executor"));
  r = test::run_cli("serve --model " + model + " --num-draft-tokens 3");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("--num-draft-tokens needs --speculative or --draft"));
}

// serve --speculative ngram: completions as without it (greedy), and /metrics reports the
// drafts verified and accepted.
TEST(ServerCli, SpeculativeNgramServesAndReportsAcceptance) {
  const std::string model = test::shared_text_checkpoint("tiny", 5);
  const std::string body =
      R"({"prompt":"the the the the","max_tokens":24,"temperature":0,"ignore_eos":true})";
  std::string plain;
  {
    ServeProcess p("--model " + model + " --workers 1 --max-batch 2");
    ASSERT_GT(p.port, 0) << p.log();
    httplib::Client c("127.0.0.1", p.port);
    auto r = c.Post("/v1/completions", body, "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    plain = nlohmann::json::parse(r->body)["choices"][0]["text"];
  }
  ServeProcess p("--model " + model + " --workers 1 --max-batch 2 --speculative ngram " +
                 "--num-draft-tokens 3");
  ASSERT_GT(p.port, 0) << p.log();
  EXPECT_THAT(p.log(), HasSubstr("speculative ngram with 3 drafts a step"));
  httplib::Client c("127.0.0.1", p.port);
  auto r = c.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(nlohmann::json::parse(r->body)["choices"][0]["text"], plain);
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_THAT(m->body, HasSubstr("megadecode_spec_decode_num_draft_tokens_total "));
  EXPECT_THAT(m->body, ::testing::Not(HasSubstr("megadecode_spec_decode_num_drafts_total 0\n")));
}

}  // namespace
}  // namespace md

namespace md {
namespace {

// serve-bench (the C++ load client) against a running server: one row per level with the tokens
// asked for, no errors; the prefill probe reports its gaps; bad flags and no server are errors.
TEST(ServerCli, ServeBenchDrivesTheServer) {
  const std::string model = test::shared_text_checkpoint("tiny", 5);
  ServeProcess s("--model " + model + " --max-batch 3");
  ASSERT_GT(s.port, 0) << s.log();
  const std::string port = " --port " + std::to_string(s.port);
  auto r = test::run_cli("serve-bench" + port +
                         " --input-len 4 --output-len 6 --concurrency 1,2 --num-requests 3");
  ASSERT_EQ(r.status, 0) << r.err;
  std::istringstream lines(r.out);
  std::string header, row;
  std::getline(lines, header);
  EXPECT_THAT(header, HasSubstr("out tok/s"));
  for (int level : {1, 2}) {
    ASSERT_TRUE(std::getline(lines, row)) << r.out;
    std::istringstream f(row);
    int conc = 0;
    double req_s = 0, tok_s = 0;
    f >> conc >> req_s >> tok_s;
    EXPECT_EQ(conc, level);
    EXPECT_GT(req_s, 0);
    // Every request generated exactly --output-len (the printed rates are rounded).
    EXPECT_NEAR(tok_s / req_s, 6.0, 0.01);
    EXPECT_THAT(row, ::testing::Not(HasSubstr("errors")));
  }
  r = test::run_cli("serve-bench" + port +
                    " --input-len 4 --output-len 3000 --concurrency 2 --prefill-probe 40 "
                    "--probe-after 0.05");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("2 streams; a 40-token prompt arrived"));
  EXPECT_THAT(r.out, HasSubstr("p99 rise"));
  // A token id outside the vocabulary: the server's 400 is reported, and the status is 1.
  r = test::run_cli("serve-bench" + port +
                    " --input-len 4 --output-len 2 --concurrency 1 --num-requests 1 --vocab "
                    "100000000");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.out, HasSubstr("errors: 1 (HTTP 400)"));
  double seconds = 0;
  EXPECT_EQ(s.stop(SIGTERM, &seconds), 0);
  r = test::run_cli("serve-bench" + port + " --concurrency 1 --num-requests 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot connect"));
  r = test::run_cli("serve-bench --port 1 --concurrency 1,x");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("--concurrency"));
}

}  // namespace
}  // namespace md
