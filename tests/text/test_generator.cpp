#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "megadecode/base/error.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/model/presets.h"
#include "megadecode/text/generator.h"
#include "megadecode/tokenizer/bpe_train.h"
#include "test_util.h"

namespace md {
namespace {

using ::testing::HasSubstr;

class GeneratorTest : public ::testing::Test {
 protected:
  static std::string dir() { return test::shared_text_checkpoint("tiny", 21); }
  void SetUp() override {
    ModelOptions o;
    o.threads = 2;
    model_ = std::make_unique<Model>(dir(), o);
    tok_ = std::make_unique<Tokenizer>(Tokenizer::load(dir()));
  }
  // The same BPE ranks with Kimi K3's special tokens and no chat template, like a K3 checkpoint.
  static Tokenizer k3_tokenizer(int64_t vocab_size) {
    std::vector<std::string> ranks = train_bpe(builtin_training_corpus(), int(vocab_size - 256));
    std::vector<SpecialToken> specials;
    for (const NamedSpecialToken& t : kimi_k3_special_tokens())
      specials.push_back({int32_t(ranks.size()) + t.offset, std::string(t.content), true});
    return Tokenizer::from_parts(ranks, specials, vocab_size);
  }
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tok_;
};

SamplingParams greedy(int n) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = n;
  return p;
}

TEST_F(GeneratorTest, GreedyMatchesTheModelDirectly) {
  Generator g(*model_, *tok_);
  auto prompt = g.encode("The quick brown fox");
  GenerationResult r = g.generate(prompt, greedy(12));
  EXPECT_EQ(r.tokens.size(), 12u);
  EXPECT_EQ(r.finish_reason, "length");
  // The same ids by hand: prefill, argmax, decode.
  SequenceState s = model_->new_sequence();
  std::vector<float> logits(size_t(model_->config().vocab_size));
  model_->forward(s, prompt, logits.data(), false);
  for (int32_t want : r.tokens) {
    int32_t got = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    ASSERT_EQ(got, want);
    model_->forward(s, std::span(&got, 1), logits.data(), false);
  }
  // The streamed text is the decoded tokens (invalid UTF-8 from a random model replaced).
  EXPECT_EQ(r.text, sanitize_utf8(tok_->decode(r.tokens, true)));
}

// Running through the plan executors (the prompt in chunks of rows, sampling inside the plan's
// step) gives the same tokens as the reference path, greedy and sampled (same seed), across two
// turns that reuse the prefix. The plan's rows are bit-identical to the reference fed one token
// at a time; the reference's one-call prefill differs from that in rounding order only, which in
// bf16 can legitimately move a sampled token, so the comparison with it runs in fp32 (agreement
// ~1e-6, as ReusesThePrefixOfTheNextTurn). In bf16 the chunk size must not matter at all.
TEST_F(GeneratorTest, PlanExecutorsGiveTheSameTokens) {
  SamplingParams sampled;
  sampled.temperature = 0.8f;
  sampled.top_p = 0.9f;
  sampled.repetition_penalty = 1.2f;
  sampled.seed = 7;
  sampled.max_tokens = 16;
  for (Precision prec : {Precision::FP32, Precision::BF16}) {
    ModelOptions o;
    o.precision = prec;
    model_ = std::make_unique<Model>(dir(), o);
    // FP32: the reference path; BF16: the plan prefilling one row per step.
    ExecutorOptions eo;
    eo.workers = 2;
    CpuExecutor one(*model_, 1, ExecutorKind::kOpByOp, eo);
    Generator ref(*model_, *tok_);
    if (prec == Precision::BF16) ref.set_executor(&one, 1);
    auto p1 = ref.encode("The quick brown fox");
    const GenerationResult g1 = ref.generate(p1, greedy(10));
    const GenerationResult s1 = ref.generate(p1, sampled);
    auto p2 = s1.prompt_ids;
    p2.insert(p2.end(), s1.tokens.begin(), s1.tokens.end());
    const GenerationResult s2 = ref.generate(p2, sampled);
    for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp})
      for (int chunk : {3, 16}) {
        SCOPED_TRACE(std::string(executor_name(kind)) + " chunk " + std::to_string(chunk) +
                     (prec == Precision::BF16 ? " bf16" : " fp32"));
        CpuExecutor ex(*model_, 1, kind, eo);
        Generator g(*model_, *tok_);
        g.set_executor(&ex, chunk);
        EXPECT_EQ(g.generate(p1, greedy(10)).tokens, g1.tokens);
        EXPECT_EQ(g.generate(p1, sampled).tokens, s1.tokens);
        EXPECT_EQ(g.generate(p2, sampled).tokens, s2.tokens);
      }
    EXPECT_NE(s1.tokens, g1.tokens) << "sampling stayed greedy: the test cannot tell";
  }
}

TEST_F(GeneratorTest, ReusesThePrefixOfTheNextTurn) {
  // fp32 activations: a reused state (decode steps) and a fresh prefill (chunked form) then agree
  // to ~1e-6, so greedy picks the same tokens; in bf16 their roundings differ legitimately.
  ModelOptions o;
  o.precision = Precision::FP32;
  model_ = std::make_unique<Model>(dir(), o);
  Generator g(*model_, *tok_);
  auto first = g.encode(g.render({{"user", "hello there", "", "", {}, ""}}, true));
  GenerationResult a = g.generate(first, greedy(6));
  EXPECT_EQ(a.prefilled, int(first.size()));
  // A prompt extending what was fed (prompt + generated ids but the last) only runs the suffix.
  std::vector<int32_t> next = first;
  next.insert(next.end(), a.tokens.begin(), a.tokens.end() - 1);
  auto more = g.encode("more text");
  next.insert(next.end(), more.begin(), more.end());
  GenerationResult b = g.generate(next, greedy(6));
  EXPECT_EQ(b.prefilled, int(next.size() - first.size() - a.tokens.size() + 1));
  // And gives what a fresh sequence gives.
  Generator fresh(*model_, *tok_);
  GenerationResult c = fresh.generate(next, greedy(6));
  EXPECT_EQ(c.prefilled, int(next.size()));
  EXPECT_EQ(b.tokens, c.tokens);
  // A prompt that does not extend it starts over.
  GenerationResult d = g.generate(first, greedy(6));
  EXPECT_EQ(d.prefilled, int(first.size()));
  EXPECT_EQ(d.tokens, a.tokens);
}

TEST_F(GeneratorTest, StopTokenAndStopString) {
  Generator g(*model_, *tok_);
  auto prompt = g.encode("abc");
  GenerationResult r = g.generate(prompt, greedy(10));
  ASSERT_GE(r.tokens.size(), 4u);
  // Stop at the 3rd generated token: it is included in tokens, not in the text.
  SamplingParams p = greedy(10);
  p.stop_token_ids = {r.tokens[2]};
  GenerationResult s = g.generate(prompt, p);
  EXPECT_EQ(s.finish_reason, "stop");
  auto first_hit = std::find(r.tokens.begin(), r.tokens.end(), r.tokens[2]) - r.tokens.begin();
  EXPECT_EQ(s.tokens.size(), size_t(first_hit + 1));
  // A stop string taken from the middle of the greedy text ends the text just before it.
  if (r.text.size() >= 6) {
    SamplingParams q = greedy(10);
    std::string stop = r.text.substr(3, 2);
    q.stop_strings = {stop};
    std::string streamed;
    GenerationResult t = g.generate(prompt, q, [&](std::string_view piece) {
      streamed += piece;
      return true;
    });
    EXPECT_EQ(t.finish_reason, "stop");
    EXPECT_EQ(t.text, r.text.substr(0, r.text.find(stop)));
    EXPECT_EQ(streamed, t.text);
  }
}

TEST_F(GeneratorTest, CancelAndBadInput) {
  Generator g(*model_, *tok_);
  auto prompt = g.encode("xyz");
  int calls = 0;
  GenerationResult r =
      g.generate(prompt, greedy(50), [&](std::string_view) { return ++calls < 2; });
  EXPECT_EQ(r.finish_reason, "cancelled");
  EXPECT_THROW(g.generate({}, greedy(5)), Error);
  EXPECT_THROW(g.generate({1, 99999}, greedy(5)), Error);
  SamplingParams bad = greedy(5);
  bad.top_p = 2;
  EXPECT_THROW(g.generate(prompt, bad), Error);
  Generator unknown(*model_, *tok_, "chatml");  // raw prompts still work without a template
  EXPECT_THROW(unknown.render({{"user", "hi", "", "", {}, ""}}, true), Error);
  EXPECT_EQ(unknown.generate(prompt, greedy(3)).tokens.size(), 3u);
}

TEST_F(GeneratorTest, KimiK3TemplateStopAndPromptIds) {
  Tokenizer k3 = k3_tokenizer(model_->config().vocab_size);
  Generator g(*model_, k3);
  EXPECT_EQ(g.template_kind(), TemplateKind::kKimiK3);  // detected from the special tokens
  const int32_t eom = *k3.special_id("<|end_of_msg|>");
  auto stops = g.default_stop_ids();
  EXPECT_NE(std::find(stops.begin(), stops.end(), eom), stops.end());
  // The Kimi tokenizer's own end-of-message token is not there to add.
  EXPECT_EQ(k3.special_id("<|im_end|>"), std::nullopt);

  // Prompt ids: markup segments as special ids, message text as plain text even when it looks
  // like markup.
  std::vector<ChatMessage> msgs = {{"user", "hi <|open|>", "", "", {}, ""}};
  std::vector<int32_t> ids = g.encode_chat(msgs, true);
  // Effort message, user message, generation prompt, think: the user's "<|open|>" is text.
  EXPECT_EQ(std::count(ids.begin(), ids.end(), *k3.special_id("<|open|>")), 4);
  std::string text = k3.decode(ids);
  EXPECT_EQ(text, render_chat(TemplateKind::kKimiK3, msgs, true));
  EXPECT_NE(g.encode(text),
            ids);  // tokenizing the flat string would make the user's <|open|> special
  // Ends with the generation prompt that opens the think channel.
  auto tail = k3.encode("<|open|>think<|sep|>");
  ASSERT_GE(ids.size(), tail.size());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), ids.end() - std::ptrdiff_t(tail.size())));
  ChatOptions no_think;
  no_think.thinking = false;
  EXPECT_EQ(k3.decode(g.encode_chat(msgs, true, no_think)),
            render_chat(TemplateKind::kKimiK3, msgs, true, {}, no_think));
}

TEST_F(GeneratorTest, XtmlChannelsFollowTheOutput) {
  Tokenizer k3 = k3_tokenizer(model_->config().vocab_size);
  XtmlChannels x(k3);
  ASSERT_TRUE(x.enabled());
  EXPECT_FALSE(XtmlChannels(*tok_).enabled());  // the Kimi Linear tokenizer has no XTML tokens
  using C = XtmlChannels::Channel;
  // Feeds `s` token by token and returns (what was content, what was shown as markup).
  std::string shown;
  auto feed = [&](std::string_view s) {
    std::string content;
    for (int32_t id : k3.encode(s)) {
      if (!x.feed(id, shown)) content += k3.token_bytes(id);
    }
    return content;
  };
  EXPECT_EQ(feed("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"), "");
  EXPECT_EQ(x.channel(), C::kThink);
  EXPECT_EQ(feed("Let me think."), "Let me think.");
  EXPECT_EQ(x.channel(), C::kThink);
  EXPECT_EQ(feed("<|close|>think<|sep|><|open|>response<|sep|>"), "");
  EXPECT_EQ(x.channel(), C::kResponse);
  EXPECT_EQ(feed("Answer."), "Answer.");
  EXPECT_EQ(feed("<|close|>response<|sep|>"), "");
  EXPECT_EQ(x.channel(), C::kNone);
  EXPECT_TRUE(shown.empty());
  // Tool calls are kept as their markup.
  EXPECT_EQ(feed("<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>"), "");
  EXPECT_EQ(shown, "<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>");
  EXPECT_EQ(feed("<|close|>message<|sep|><|end_of_msg|>"), "");
  EXPECT_EQ(x.channel(), C::kNone);
}

TEST_F(GeneratorTest, KimiK3ThinkChannelIsReasoning) {
  Tokenizer k3 = k3_tokenizer(model_->config().vocab_size);
  Generator g(*model_, k3);
  std::vector<ChatMessage> msgs = {{"user", "Why is the sky blue?", "", "", {}, ""}};
  auto structural = [&](const GenerationResult& r) {
    for (std::string_view t : kimi_k3_structural_tokens())
      if (std::count(r.tokens.begin(), r.tokens.end(), *k3.special_id(t))) return true;
    return false;
  };
  // The prompt opens the think channel, so (unless the random model closes it) everything
  // generated is reasoning: streamed to on_reasoning, not to on_text.
  std::string streamed_text, streamed_reasoning;
  GenerationResult r = g.generate(
      g.encode_chat(msgs, true), greedy(12),
      [&](std::string_view s) {
        streamed_text += s;
        return true;
      },
      [&](std::string_view s) {
        streamed_reasoning += s;
        return true;
      });
  ASSERT_EQ(r.tokens.size(), 12u);
  if (!structural(r)) {
    EXPECT_EQ(r.text, "");
    EXPECT_EQ(r.reasoning, sanitize_utf8(k3.decode(r.tokens, true)));
    EXPECT_EQ(streamed_reasoning, r.reasoning);
    EXPECT_EQ(streamed_text, "");
  }
  // Without thinking the prompt opens the response channel.
  ChatOptions no_think;
  no_think.thinking = false;
  GenerationResult q = g.generate(g.encode_chat(msgs, true, no_think), greedy(12));
  if (!structural(q)) {
    EXPECT_EQ(q.reasoning, "");
    EXPECT_EQ(q.text, sanitize_utf8(k3.decode(q.tokens, true)));
  }
}

TEST_F(GeneratorTest, SameSeedSameText) {
  Generator g(*model_, *tok_);
  auto prompt = g.encode("Once upon a time");
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.9f;
  p.seed = 1234;
  p.max_tokens = 20;
  GenerationResult a = g.generate(prompt, p), b = g.generate(prompt, p);
  EXPECT_EQ(a.tokens, b.tokens);
  p.seed = 99;
  GenerationResult c = g.generate(prompt, p);
  EXPECT_NE(a.tokens, c.tokens);
}

}  // namespace
}  // namespace md
