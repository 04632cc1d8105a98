// The CLI on bad input: one line on stderr naming the problem, a nonzero exit, never a crash.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>

#include "megadecode/base/bf16.h"
#include "megadecode/base/threads.h"
#include "megadecode/model/presets.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/tokenizer/bpe_train.h"
#include "megadecode/tokenizer/chat_template.h"
#include "megadecode/tokenizer/tokenizer.h"
#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

// One tiny checkpoint shared by the CLI tests.
class Cli : public ::testing::Test {
 protected:
  static std::string dir() { return test::shared_text_checkpoint("tiny", 5); }
  static std::string model() { return dir(); }
};

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

// --rows feeds every id through the plan R per sequence per step; with a batch the lines carry
// "seq". Every line equals the executor's one-row-per-step output (bit-identical rows), and the
// greedy ids of generate through the plan equal the reference's in fp32.
TEST_F(Cli, LogitsRowsThroughThePlan) {
  const std::string ids = " --ids 1,2,3,4,5,6,7,8,9,10,11";
  auto one = test::run_cli("logits --model " + model() + ids + " --executor megakernel --rows 1");
  ASSERT_EQ(one.status, 0) << one.err;
  EXPECT_EQ(std::count(one.out.begin(), one.out.end(), '\n'), 11);
  for (const char* r : {"3", "8", "16"}) {
    auto got = test::run_cli("logits --model " + model() + ids +
                             " --executor opbyop --workers 2 --rows " + r);
    ASSERT_EQ(got.status, 0) << got.err;
    EXPECT_EQ(got.out, one.out) << "--rows " << r;
  }
  auto batch = test::run_cli("logits --model " + model() +
                             " --batch-ids \"1,2,3,4,5;6,7\" --executor megakernel --rows 4");
  ASSERT_EQ(batch.status, 0) << batch.err;
  EXPECT_EQ(std::count(batch.out.begin(), batch.out.end(), '\n'), 7);
  EXPECT_THAT(batch.out, HasSubstr("{\"seq\": 1, \"pos\": 1, \"logits\": ["));
  expect_one_line_error(test::run_cli("logits --model " + model() + ids + " --rows 4"),
                        "--rows runs the plan");
  expect_one_line_error(
      test::run_cli("logits --model " + model() + ids + " --executor opbyop --rows 4 --prefill 2"),
      "--prefill does not apply");
  auto ref = test::run_cli("generate --model " + model() +
                           " --ids 1,2,3,4,5,6,7 --max-tokens 6 --ignore-eos --precision fp32");
  auto plan = test::run_cli("generate --model " + model() +
                            " --ids 1,2,3,4,5,6,7 --max-tokens 6 --ignore-eos --precision fp32 "
                            "--executor megakernel --prefill-chunk 3");
  ASSERT_EQ(ref.status, 0) << ref.err;
  ASSERT_EQ(plan.status, 0) << plan.err;
  EXPECT_EQ(plan.out, ref.out);
}

// --device cuda-sim runs the plan's CUDA kernels on the host simulation: generate's greedy ids
// (fp32, where no bf16 rounding flips) and logits agree with the CPU executor's; run and bench
// work; --device cuda without a GPU, or an unknown device, is a one-line error.
TEST_F(Cli, DeviceCudaSim) {
  const std::string gen = "generate --model " + model() +
                          " --ids 1,2,3,4,5 --max-tokens 5 --ignore-eos --precision fp32 --executor ";
  auto cpu = test::run_cli(gen + "megakernel");
  ASSERT_EQ(cpu.status, 0) << cpu.err;
  for (const char* ex : {"megakernel", "opbyop"}) {
    auto sim = test::run_cli(gen + ex + " --device cuda-sim");
    ASSERT_EQ(sim.status, 0) << sim.err;
    EXPECT_EQ(sim.out, cpu.out) << ex;
  }
  auto lg = test::run_cli("logits --model " + model() +
                          " --ids 1,2,3 --executor opbyop --rows 2 --device cuda-sim");
  ASSERT_EQ(lg.status, 0) << lg.err;
  EXPECT_EQ(std::count(lg.out.begin(), lg.out.end(), '\n'), 3);
  auto run = test::run_cli("run --model " + model() +
                           " --prompt 'Hello' -n 4 --seed 2 --raw --json --executor megakernel "
                           "--device cuda-sim");
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(nlohmann::json::parse(run.out)["tokens"].size(), 4u);
  auto b = test::run_cli("bench --model " + model() +
                         " --device cuda-sim --executor megakernel,opbyop --batch 1 --steps 1 "
                         "--reps 1");
  ASSERT_EQ(b.status, 0) << b.err;
  // One block per simulated SM (4), not one per host CPU.
  EXPECT_THAT(b.out, HasSubstr("--device cuda-sim (cuda-sim (host simulation), 4 blocks)"));
  // A preset benched by CUDA executors only: its weights are generated on the device; with the
  // reference among the executors, make-model writes them for the host.
  test::TempDir tmp("cli_bench");
  auto pd = test::run_cli("bench --preset tiny --device cuda-sim --executor megakernel --batch 2 "
                          "--steps 1 --reps 1 --json " + tmp / "pd.json");
  ASSERT_EQ(pd.status, 0) << pd.err;
  EXPECT_THAT(pd.out, HasSubstr("generated on the device"));
  std::ifstream jf(tmp / "pd.json");
  const nlohmann::json pdj = nlohmann::json::parse(jf);
  EXPECT_TRUE(pdj["weights_generated_on_device"].get<bool>());
  // With --quantize the device's random matrices are drawn in the format: fewer bytes a step.
  auto pq = test::run_cli("bench --preset tiny --device cuda-sim --executor megakernel --batch 2 "
                          "--steps 1 --reps 1 --quantize int4 --quant-group 32 --json " + tmp / "pq.json");
  ASSERT_EQ(pq.status, 0) << pq.err;
  EXPECT_THAT(pq.err, HasSubstr("drawn at random in the format"));
  std::ifstream qf(tmp / "pq.json");
  const nlohmann::json pqj = nlohmann::json::parse(qf);
  EXPECT_LT(pqj["results"][0]["bytes_per_step"].get<double>(),
            0.6 * pdj["results"][0]["bytes_per_step"].get<double>());
  auto ph = test::run_cli("bench --preset tiny --device cuda-sim --executor opbyop,reference "
                          "--batch 1 --steps 1 --reps 1");
  ASSERT_EQ(ph.status, 0) << ph.err;
  EXPECT_THAT(ph.out, ::testing::Not(HasSubstr("generated on the device")));
  auto gpu = test::run_cli(gen + "opbyop --device cuda");
  if (gpu.status != 0) expect_one_line_error(gpu, "no CUDA device");
  auto bad = test::run_cli(gen + "opbyop --device tpu");  // (CLI11's own two-line message)
  EXPECT_NE(bad.status, 0);
  EXPECT_LT(bad.status, 128);
  EXPECT_THAT(bad.err, HasSubstr("--device: tpu not in"));
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
  { std::ofstream(d / "config.json") << "{ not json"; }
  expect_one_line_error(test::run_cli("inspect --model " + d.path()), "invalid JSON");
  { std::ofstream(d / "config.json") << "{\"model_type\": \"kimi_linear\"}"; }
  expect_one_line_error(test::run_cli("inspect --model " + d.path()), "missing field");
}

// A damaged checkpoint: each defect is reported in one line by every command that opens it.
TEST_F(Cli, DamagedCheckpoint) {
  namespace fs = std::filesystem;
  auto damaged = [&](const std::string& tag, auto&& damage) {
    auto d = std::make_unique<test::TempDir>(tag);
    fs::copy(model(), d->path(), fs::copy_options::recursive);
    damage(d->path() + "/model.safetensors");
    return d;
  };
  auto truncate_to = [](size_t n) { return [n](const std::string& f) { fs::resize_file(f, n); }; };
  auto d1 = damaged("trunc", truncate_to(100000));
  expect_one_line_error(test::run_cli("inspect --model " + d1->path()), "model.safetensors");
  auto d2 = damaged("short", truncate_to(5));
  expect_one_line_error(test::run_cli("logits --model " + d2->path() + " --ids 1"),
                        "model.safetensors");
  auto d3 = damaged("hdr", [](const std::string& f) {
    std::fstream s(f, std::ios::in | std::ios::out | std::ios::binary);
    uint64_t huge = uint64_t(1) << 40;
    s.write(reinterpret_cast<const char*>(&huge), 8);
  });
  expect_one_line_error(test::run_cli("generate --model " + d3->path() + " --ids 1"),
                        "model.safetensors");
  auto d4 = damaged("gone", [](const std::string& f) { fs::remove(f); });
  expect_one_line_error(test::run_cli("inspect --model " + d4->path()), "safetensors");
}

TEST_F(Cli, RunStreamsTextAndJson) {
  auto r = test::run_cli("run --model " + model() + " --prompt 'Hello there' -n 8 --seed 1");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(r.out.empty());
  EXPECT_THAT(r.err, HasSubstr("tokens at"));
  r = test::run_cli("run --model " + model() + " --prompt 'Hello' -n 5 -t 0 --raw --json");
  ASSERT_EQ(r.status, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["tokens"].size(), 5u);
  EXPECT_EQ(j["finish_reason"], "length");
  // Greedy is deterministic; a different seed does not matter at temperature 0.
  auto r2 =
      test::run_cli("run --model " + model() + " --prompt 'Hello' -n 5 -t 0 --raw --json --seed 9");
  EXPECT_EQ(nlohmann::json::parse(r2.out)["tokens"], j["tokens"]);
}

// The answer's shape from the command line (structured outputs): llama.cpp's --grammar and
// --json-schema, a regex, a choice; sampled at temperature 1, every answer follows it.
TEST_F(Cli, RunHoldsTheAnswerToAGrammarSchemaRegexOrChoice) {
  test::TempDir d("grammar");
  {
    std::ofstream(d / "g.gbnf")
        << "root ::= item (\", \" item)?\nitem ::= (\"yes\" | \"no\") [0-9]\n";
  }
  struct Case {
    std::string flags;
    std::string language;  // an ECMAScript regex of the answers (empty: JSON, checked below)
  };
  const Case cases[] = {
      {"--grammar-file " + (d / "g.gbnf"), "(yes|no)[0-9](, (yes|no)[0-9])?"},
      {"--grammar 'root ::= \"(\" root \")\" | \"x\"'", "\\(*x\\)*"},
      {"--regex '[A-Z]{2}-[0-9]{3}'", "[A-Z]{2}-[0-9]{3}"},
      {"--choice red --choice green", "red|green"},
      {"--json-schema '{\"type\": \"array\", \"items\": {\"enum\": [1, 2]}, \"maxItems\": 2}'", ""},
  };
  for (const Case& c : cases) {
    int finished = 0;
    for (const char* mode : {"--raw", "--chat", "--raw --executor megakernel"}) {
      for (int seed : {1, 2}) {
        auto r = test::run_cli("run --model " + model() + " --prompt 'answer' -t 1 -n 60 --json " +
                               mode + " --seed " + std::to_string(seed) + " " + c.flags);
        ASSERT_EQ(r.status, 0) << c.flags << ": " << r.err;
        const auto j = nlohmann::json::parse(r.out);
        if (j["finish_reason"] != "stop") continue;  // (60 tokens of a long answer)
        ++finished;
        const std::string text = j["text"];
        if (!c.language.empty()) {
          EXPECT_TRUE(std::regex_match(text, std::regex(c.language))) << c.flags << ": " << text;
          continue;
        }
        const auto a = nlohmann::json::parse(text);
        EXPECT_TRUE(a.is_array() && a.size() <= 2) << text;
        for (const auto& x : a) EXPECT_TRUE(x == 1 || x == 2) << text;
      }
    }
    EXPECT_GE(finished, 2) << c.flags;  // fixed seeds: the same runs finish every time
  }
  expect_one_line_error(
      test::run_cli("run --model " + model() + " --prompt x --regex a --choice b"),
      "give one of --grammar");
  expect_one_line_error(test::run_cli("run --model " + model() + " --prompt x --regex '(a'"),
                        "--regex: pattern '(a': an unterminated group");
  expect_one_line_error(test::run_cli("run --model " + model() +
                                      " --prompt x --grammar 'root ::= root \"a\" | \"b\"'"),
                        "--grammar: grammar, line 1 column 1: the rule 'root' is left-recursive");
  expect_one_line_error(test::run_cli("run --model " + model() + " --prompt x --json-schema '{'"),
                        "--json-schema: not valid JSON");
  expect_one_line_error(
      test::run_cli("run --model " + model() + " --prompt x --grammar-file /nonexistent.gbnf"),
      "cannot open /nonexistent.gbnf");
}

TEST_F(Cli, ChatReplTakesTurnsAndResets) {
  auto r = test::run_cli("chat --model " + model() + " -n 4 -t 0",
                         "hello\n/reset\nhi again\n/exit\nnever\n");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 2) << r.out;
  EXPECT_THAT(r.err, HasSubstr("(history cleared)"));
  // Ctrl-D (end of input) ends the session cleanly.
  r = test::run_cli("chat --model " + model() + " -n 3 -t 0", "one turn\n");
  EXPECT_EQ(r.status, 0) << r.err;
}

TEST_F(Cli, TokenizeAndDetokenize) {
  auto r = test::run_cli("tokenize --model " + model() + " --text 'Hello <|im_end|> world' --json");
  ASSERT_EQ(r.status, 0) << r.err;
  auto ids = nlohmann::json::parse(r.out).get<std::vector<int>>();
  EXPECT_NE(std::find(ids.begin(), ids.end(), 1024 - 254), ids.end()) << "special token id";
  std::string list;
  for (int id : ids) {
    if (!list.empty()) list += ',';
    list += std::to_string(id);
  }
  r = test::run_cli("detokenize --model " + model() + " --ids " + list);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "Hello <|im_end|> world\n");
}

TEST_F(Cli, TextBadInput) {
  expect_one_line_error(test::run_cli("run --model " + model() + " --prompt '' --raw"),
                        "prompt is empty");
  expect_one_line_error(test::run_cli("run --model " + model() + " --prompt x --raw --chat"),
                        "--raw and --chat exclude each other");
  expect_one_line_error(test::run_cli("run --model " + model() + " --prompt x --top-p 0"), "top_p");
  expect_one_line_error(test::run_cli("detokenize --model " + model() + " --ids 5000"), "5000");
  expect_one_line_error(test::run_cli("tokenize --model " + model()),
                        "give exactly one of --text and --file");
  // Invalid UTF-8 in a prompt is replaced with U+FFFD (documented), not rejected.
  auto r = test::run_cli("tokenize --model " + model() + " --text \"$(printf 'a\\377b')\" --json");
  ASSERT_EQ(r.status, 0) << r.err;
  auto r2 = test::run_cli("tokenize --model " + model() +
                          " --text \"$(printf 'a\\357\\277\\275b')\" --json");
  EXPECT_EQ(r.out, r2.out);
  // A checkpoint without tokenizer files: the error names the missing file.
  namespace fs = std::filesystem;
  test::TempDir d("notok");
  fs::copy(model(), d.path(), fs::copy_options::recursive);
  fs::remove(d / "tiktoken.model");
  expect_one_line_error(test::run_cli("run --model " + d.path() + " --prompt hi"),
                        "tiktoken.model");
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

// make-model's Kimi K3 presets write K3's tokenizer: K3's special tokens at R + offset, no chat
// template (so `run --chat` detects the K3 format from the structure tokens) and config eos =
// <|end_of_msg|>, where generation stops.
TEST(CliK3, MakeModelWritesAK3TokenizerAndChatStopsAtEndOfMessage) {
  namespace fs = std::filesystem;
  test::TempDir d("cli_k3");
  auto r = test::run_cli("make-model --preset k3-tiny --seed 3 --out " + d.path());
  ASSERT_EQ(r.status, 0) << r.err;
  const int64_t V = 1024, R = V - 256;
  nlohmann::json tc = nlohmann::json::parse(std::ifstream(d / "tokenizer_config.json"));
  EXPECT_FALSE(tc.contains("chat_template"));
  const auto& dec = tc["added_tokens_decoder"];
  EXPECT_EQ(dec.size(), kimi_k3_special_tokens().size());
  for (const NamedSpecialToken& t : kimi_k3_special_tokens()) {
    const std::string id = std::to_string(R + t.offset);
    ASSERT_TRUE(dec.contains(id)) << t.content;
    EXPECT_EQ(dec[id]["content"], std::string(t.content));
    EXPECT_TRUE(dec[id]["special"].get<bool>()) << t.content;
  }
  EXPECT_FALSE(tc.dump().find("<|im_end|>") != std::string::npos);
  Tokenizer tok = Tokenizer::load(d.path(), V);
  const int32_t eom = tok.special_id(kKimiK3EndOfMessage).value();
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(d / "config.json"));
  EXPECT_EQ(cfg["model_type"], "kimi_k3");
  EXPECT_EQ(cfg["eos_token_id"].get<int64_t>(), eom);

  // `run --chat` renders the K3 format: the prompt ids are the K3 chat segments tokenized.
  const std::string run = "run --model " + d.path() + " --chat --prompt 'Hello there' -t 0 --json";
  r = test::run_cli(run + " -n 4 --ignore-eos");
  ASSERT_EQ(r.status, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  std::vector<int32_t> want;
  for (const ChatSegment& s : render_chat_segments(
           TemplateKind::kKimiK3, {{"user", "Hello there", "", "", {}, ""}}, true)) {
    auto part = tok.encode(s.text, s.allow_special);
    want.insert(want.end(), part.begin(), part.end());
  }
  EXPECT_EQ(j["prompt_ids"].get<std::vector<int32_t>>(), want);
  for (std::string_view t : kimi_k3_structural_tokens())
    EXPECT_NE(std::find(want.begin(), want.end(), tok.special_id(t).value()), want.end()) << t;
  ASSERT_EQ(j["tokens"].size(), 4u);
  const int32_t first = j["tokens"][0].get<int32_t>();
  ASSERT_NE(first, eom);

  // Make <|end_of_msg|> the greedy choice at the first step: its lm_head row becomes twice the
  // row of the token chosen there (exact in bf16; that logit is the maximum, hence positive, and
  // doubles). Generation must then stop on it, without --stop-id.
  {
    const std::string path = d / "model.safetensors";
    std::ifstream in(path, std::ios::binary);
    std::vector<uint8_t> buf((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
    in.close();
    SafetensorsContents st = parse_safetensors_buffer(buf.data(), buf.size(), path);
    const TensorInfo& lm = st.tensors.at("language_model.lm_head.weight");
    const int64_t D = lm.shape[1];
    auto* w = static_cast<uint16_t*>(const_cast<void*>(lm.data));
    for (int64_t k = 0; k < D; ++k)
      w[eom * D + k] = f32_to_bf16(2.0f * bf16_to_f32(w[first * D + k]));
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(buf.data()), std::streamsize(buf.size()));
  }
  r = test::run_cli(run + " -n 4");
  ASSERT_EQ(r.status, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["finish_reason"], "stop");
  EXPECT_EQ(j["tokens"], nlohmann::json::array({eom}));
  EXPECT_EQ(j["text"], "");
  // With --ignore-eos it is just a token (markup: not shown) and generation runs on.
  r = test::run_cli(run + " -n 4 --ignore-eos");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["finish_reason"], "length");
}

}  // namespace
}  // namespace md
