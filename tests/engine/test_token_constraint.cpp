// Constrained decoding (engine/token_constraint.h) and the tool_choice programs built on it
// (server/chat_constraints.h): valid JSON objects and the templates' own tool-call markup pass token by
// token, malformed input is refused at the byte where it goes wrong, the fast mask paths agree
// with a token-by-token check, and random walks through the masks end in JSON that parses.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "constraint_walk.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/json_schema.h"
#include "megadecode/engine/token_constraint.h"
#include "megadecode/server/chat_constraints.h"
#include "megadecode/server/tool_calls.h"
#include "megadecode/tokenizer/tokenizer.h"
#include "test_util.h"

namespace md {
namespace {

using Kind = ConstraintElement::Kind;
using server::ToolChoice;

std::shared_ptr<const ConstraintProgram> json_then_stop(int32_t stop) {
  ConstraintElement j, s;
  j.kind = Kind::kJson;
  s.kind = Kind::kStop;
  s.stop_ids = {stop};
  return std::make_shared<const ConstraintProgram>(std::vector<ConstraintElement>{j, s});
}

// The BPE tokenizer of the tiny test checkpoint: multi-byte tokens, for the masks' fast paths.
const Tokenizer& bpe_tokenizer() {
  return test::bpe_test_tokenizer();
}

std::vector<uint8_t> mask_of(const TokenConstraint& c, int64_t v) {
  std::vector<uint8_t> m(static_cast<size_t>(v));
  c.allowed(m);
  return m;
}

// Feeds `ids`; returns the index of the first id refused (ids.size() when all pass), checking on
// the way that the mask and allows() agree on each fed id.
size_t feed(TokenConstraint& c, const std::vector<int32_t>& ids, int64_t v) {
  for (size_t i = 0; i < ids.size(); ++i) {
    const bool ok = c.allows(ids[i]);
    EXPECT_EQ(mask_of(c, v)[size_t(ids[i])], ok ? 1 : 0) << "id " << ids[i] << " at " << i;
    if (!ok) return i;
    c.accept(ids[i]);
    EXPECT_FALSE(c.broken());
  }
  return ids.size();
}

const std::vector<std::string> kValidObjects = {
    "{}",
    " {\n\t}",
    R"({"a":1})",
    R"({"location": "Paris, France", "unit": "celsius"})",
    R"({"n": -0.5e+10, "m": 0, "k": 12.25E-3, "z": -0, "big": 123456789012345678901234567890})",
    R"({"t": true, "f": false, "nil": null, "arr": [], "nested": {"x": [1, [2, [3, {}]]]}})",
    R"({"esc": "q\"b\\s\/\b\f\n\r\t\u00e9\uD83D\uDE00", "utf8": "héllo 日本"})",
    R"({"a": [ 1 , 2 ] , "b" : { } })",
    R"({"": ""})",
};

TEST(TokenConstraint, JsonObjectsOfEveryShapeAreAccepted) {
  for (const Tokenizer* tok : {&bpe_tokenizer()}) {
    const int64_t v = tok->vocab_size();
    auto vocab = std::make_shared<const ConstraintVocab>(*tok, v);
    const int32_t stop = *tok->special_id("<|im_end|>");
    for (const std::string& text : kValidObjects) {
      TokenConstraint c(json_then_stop(stop), vocab);
      const std::vector<int32_t> ids = tok->encode_ordinary(text);
      ASSERT_EQ(feed(c, ids, v), ids.size()) << text;
      // The object is done: only the stop id may follow, then nothing is constrained.
      const std::vector<uint8_t> m = mask_of(c, v);
      EXPECT_EQ(std::count(m.begin(), m.end(), 1), 1) << text;
      EXPECT_EQ(m[size_t(stop)], 1);
      c.accept(stop);
      EXPECT_TRUE(c.finished());
    }
  }
}

TEST(TokenConstraint, MalformedJsonIsRefusedWhereItGoesWrong) {
  const Tokenizer tok = test::byte_tokenizer(TemplateKind::kKimi);
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  const int32_t stop = *tok.special_id("<|im_end|>");
  // Each text goes wrong at the byte marked by '@' (removed before feeding).
  const std::vector<std::string> cases = {
      "@[1]",          "{@,}",          R"({"a" @1})",      R"({"a":0@1})",
      R"({"a":1,@})",  R"({"a":tr@e})", R"({"a":"\@x"})",   R"({"a":"\u12@g4"})",
      R"({"a":-@x})",  R"({"a":1.@})",  R"({"a":1e@})",     R"({"a":[1,@]})",
      R"({"a":[1@}})", R"({"a":1@]})",  "{\"a\":\"x@\n\"}", R"({}@ )",
      "{@'a':1}",      "                @ {}",
      // Strings: valid UTF-8 (no overlong forms or surrogates) and paired surrogate escapes.
      "{\"a\":\"@\xC0\x80\"}", "{\"a\":\"\xE0@\x80\x80\"}", "{\"a\":\"\xED@\xA0\x80\"}",
      "{\"a\":\"\xC3@\"}", "{\"a\":\"@\xF5\"}", R"({"a":"\ud800@x"})", R"({"a":"\ud800\@n"})",
      R"({"a":"\ud800\u@0041"})", R"({"a":"\ud@c00"})",
  };
  for (std::string text : cases) {
    const size_t bad = text.find('@');
    text.erase(bad, 1);
    // ("x@\n": the newline is the bad byte; "{}@ ": nothing may follow the object but the stop.)
    TokenConstraint c(json_then_stop(stop), vocab);
    // Byte ids as they are (the tokenizer's encode would replace invalid UTF-8).
    std::vector<int32_t> ids;
    for (char ch : text) ids.push_back(int32_t(static_cast<uint8_t>(ch)));
    EXPECT_EQ(feed(c, ids, v), bad) << text;
  }
  // Nesting deeper than kMaxJsonDepth: the 65th opening bracket is refused.
  std::string deep = "{\"a\":";
  for (int i = 1; i < kMaxJsonDepth; ++i) deep += "[";
  TokenConstraint c(json_then_stop(stop), vocab);
  EXPECT_EQ(feed(c, tok.encode_ordinary(deep + "["), v), deep.size());
  // A special token is never JSON text, not even inside a string.
  TokenConstraint s(json_then_stop(stop), vocab);
  ASSERT_EQ(feed(s, tok.encode_ordinary("{\"a\":\"x"), v), 7u);
  EXPECT_FALSE(s.allows(stop));
}

TEST(TokenConstraint, MasksAgreeWithOneByOneChecksAndRandomWalksEndInJson) {
  const Tokenizer& tok = bpe_tokenizer();
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  const int32_t stop = *tok.special_id("<|im_end|>");
  std::mt19937_64 rng(11);
  int completed = 0;
  for (int walk = 0; walk < 24; ++walk) {
    TokenConstraint c(json_then_stop(stop), vocab);
    std::vector<int32_t> ids;
    for (int step = 0; step < 300 && !c.finished(); ++step) {
      const std::vector<uint8_t> m = mask_of(c, v);
      std::vector<int32_t> allowed, closing;
      for (int32_t id = 0; id < v; ++id) {
        ASSERT_EQ(m[size_t(id)], c.allows(id) ? 1 : 0) << "id " << id << " step " << step;
        if (!m[size_t(id)]) continue;
        allowed.push_back(id);
        if (id == stop) closing.push_back(id);
        else if (!tok.is_special(id) &&
                 tok.token_bytes(id).find_first_of("}]\"") != std::string_view::npos)
          closing.push_back(id);
      }
      ASSERT_FALSE(allowed.empty());
      // Lean towards closing tokens so that walks end.
      const auto& pool = !closing.empty() && rng() % 3 != 0 ? closing : allowed;
      const int32_t id = pool[rng() % pool.size()];
      c.accept(id);
      ASSERT_FALSE(c.broken());
      ids.push_back(id);
    }
    if (!c.finished()) continue;
    ++completed;
    ASSERT_EQ(ids.back(), stop);
    ids.pop_back();
    const std::string text = tok.decode(ids);
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(text)) << text;
    EXPECT_TRUE(j.is_object()) << text;
  }
  EXPECT_GE(completed, 12);
}

// any_value: any JSON value at the top (vLLM's `json` structured output): random walks end in
// text a JSON parser accepts, the stop token exactly at a whole value; a top-level number ends
// at the symbol after it.
TEST(TokenConstraint, AnyJsonValueAtTheTop) {
  const Tokenizer& tok = bpe_tokenizer();
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  const int32_t stop = *tok.special_id("<|im_end|>");
  std::vector<ConstraintElement> el(1);
  el[0].kind = Kind::kJson;
  el[0].any_value = true;
  const auto program = test::then_stop(el, stop);
  std::mt19937_64 rng(21);
  int finished = 0;
  std::set<char> firsts;
  for (int walk = 0; walk < 30; ++walk) {
    const test::Walk w =
        test::walk_masks(tok, program, vocab, stop, "\"]}0123456789el", rng, 80,
                         [](const std::string& t) { return nlohmann::json::accept(t); });
    if (!w.finished) continue;
    ++finished;
    EXPECT_TRUE(nlohmann::json::accept(w.text)) << w.text;
    const size_t first = w.text.find_first_not_of(" \t\n\r");
    if (first != std::string::npos) firsts.insert(w.text[first]);
  }
  EXPECT_GE(finished, 15);
  EXPECT_GE(firsts.size(), 3u);  // values of several kinds, not only objects
  // "12": the stop token, more digits, a fraction or an exponent may follow; a blank may not.
  TokenConstraint c(program, vocab);
  for (int32_t id : tok.encode_ordinary("12")) c.accept(id);
  ASSERT_FALSE(c.broken());
  EXPECT_TRUE(c.allows(stop));
  for (const char* more : {"3", ".", "e"})
    EXPECT_TRUE(c.allows(tok.encode_ordinary(more)[0])) << more;
  EXPECT_FALSE(c.allows(tok.encode_ordinary(" ")[0]));
  // With a schema: an array of integers at the top.
  el[0].schema = JsonSchema::compile(
      nlohmann::json::parse(R"({"type": "array", "items": {"type": "integer"}})"), true);
  TokenConstraint a(test::then_stop(el, stop), vocab);
  EXPECT_FALSE(a.allows(tok.encode_ordinary("{")[0]));
  EXPECT_TRUE(a.allows(tok.encode_ordinary("[")[0]));
}

TEST(TokenConstraint, BadProgramsAreErrors) {
  auto build = [](ConstraintElement e) {
    return ConstraintProgram(std::vector<ConstraintElement>{std::move(e)});
  };
  ConstraintElement names;
  names.kind = Kind::kName;
  names.names = {"b", "a"};
  EXPECT_THROW(build(names), Error);
  names.names = {"a", ""};
  EXPECT_THROW(build(names), Error);
  ConstraintElement free;
  free.kind = Kind::kFree;
  append_text_symbols(free.trigger, "x");
  EXPECT_THROW(build(free), Error);
  ConstraintElement branch;
  branch.kind = Kind::kBranch;
  branch.branches = {{1, 7}};
  EXPECT_THROW(build(branch), Error);
  ConstraintElement text;
  text.kind = Kind::kText;
  EXPECT_THROW(build(text), Error);
}

// ---- tool_choice programs --------------------------------------------------------------------

std::vector<int32_t> encode_markup(const Tokenizer& tok, const std::string& s) {
  return tok.encode(s, /*allow_special=*/true);
}

TEST(ToolChoiceProgram, KimiRequiredAcceptsTheTemplatesCallsAndNothingElse) {
  const Tokenizer tok = test::byte_tokenizer(TemplateKind::kKimi);
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  const int32_t stop = *tok.special_id("<|im_end|>");
  const std::vector<std::string> names = {"get_time", "get_weather"};
  ToolChoice required{ToolChoice::Mode::kRequired, ""};
  auto program = server::tool_choice_program(TemplateKind::kKimi, required, names, tok, {stop});
  // Two calls as the Kimi template renders an assistant turn's calls.
  const std::string calls =
      "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
      "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_call_begin|>"
      "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
      "<|tool_calls_section_end|>";
  std::vector<int32_t> ids = encode_markup(tok, calls);
  ids.push_back(stop);
  TokenConstraint c(program, vocab);
  // First thing: the section; nothing else is allowed.
  const std::vector<uint8_t> m = mask_of(c, v);
  EXPECT_EQ(std::count(m.begin(), m.end(), 1), 1);
  EXPECT_EQ(feed(c, ids, v), ids.size());
  EXPECT_TRUE(c.finished());
  const server::ToolCallSplit split = server::split_tool_calls(TemplateKind::kKimi, calls);
  ASSERT_EQ(split.calls.size(), 2u);
  EXPECT_EQ(split.calls[0].name, "get_weather");
  EXPECT_EQ(split.calls[1].arguments, "{}");
  // Wrong turns: an undeclared name, a missing index, arguments that are not an object.
  const std::string head = "<|tool_calls_section_begin|><|tool_call_begin|>functions.";
  for (const auto& [text, bad_suffix] : std::vector<std::pair<std::string, std::string>>{
           {head + "get_", "x"},
           {head + "get_time:", "<|tool_call_argument_begin|>"},
           {head + "get_time:0<|tool_call_argument_begin|>", "[]"},
           {head + "get_time:0<|tool_call_argument_begin|>{}", "<|tool_calls_section_end|>"}}) {
    TokenConstraint w(program, vocab);
    const std::vector<int32_t> good = encode_markup(tok, text);
    ASSERT_EQ(feed(w, good, v), good.size()) << text;
    EXPECT_FALSE(w.allows(encode_markup(tok, bad_suffix).front())) << text << bad_suffix;
  }
  // Named: that function, once.
  ToolChoice named{ToolChoice::Mode::kNamed, "get_time"};
  auto one = server::tool_choice_program(TemplateKind::kKimi, named, names, tok, {stop});
  TokenConstraint n(one, vocab);
  const std::vector<int32_t> w = encode_markup(tok, head + "get_w");
  EXPECT_EQ(feed(n, w, v), w.size() - 1);
  const std::vector<int32_t> once = encode_markup(
      tok, head + "get_time:0<|tool_call_argument_begin|>{}<|tool_call_end|>");
  TokenConstraint n2(one, vocab);
  ASSERT_EQ(feed(n2, once, v), once.size());
  EXPECT_FALSE(n2.allows(*tok.special_id("<|tool_call_begin|>")));
  EXPECT_TRUE(n2.allows(*tok.special_id("<|tool_calls_section_end|>")));
  // A Kimi name with ':' cannot be told from its index.
  EXPECT_THROW(server::tool_choice_program(TemplateKind::kKimi, required, {"a:b"}, tok, {stop}),
               Error);
}

TEST(ToolChoiceProgram, NoneNeverOpensASection) {
  {
    const Tokenizer tok = test::byte_tokenizer(TemplateKind::kKimi);
    auto vocab = std::make_shared<const ConstraintVocab>(tok, tok.vocab_size());
    ToolChoice none{ToolChoice::Mode::kNone, ""};
    TokenConstraint c(server::tool_choice_program(TemplateKind::kKimi, none, {"f"}, tok, {}),
                      vocab);
    const std::vector<int32_t> text = encode_markup(tok, "Sure, no tools.");
    ASSERT_EQ(feed(c, text, tok.vocab_size()), text.size());
    EXPECT_FALSE(c.allows(*tok.special_id("<|tool_calls_section_begin|>")));
    EXPECT_FALSE(c.allows(*tok.special_id("<|tool_call_begin|>")));
    EXPECT_TRUE(c.allows(*tok.special_id("<|im_end|>")));
  }
  {
    const Tokenizer tok = test::byte_tokenizer(TemplateKind::kKimiK3);
    auto vocab = std::make_shared<const ConstraintVocab>(tok, tok.vocab_size());
    ToolChoice none{ToolChoice::Mode::kNone, ""};
    TokenConstraint c(server::tool_choice_program(TemplateKind::kKimiK3, none, {"f"}, tok, {}),
                      vocab);
    const std::string ok = "hm<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response"
                           "<|sep|><|open|>tool";
    const std::vector<int32_t> ids = encode_markup(tok, ok);
    ASSERT_EQ(feed(c, ids, tok.vocab_size()), ids.size());
    EXPECT_FALSE(c.allows(encode_markup(tok, "s").front()));  // <|open|>tools
    EXPECT_TRUE(c.allows(encode_markup(tok, "x").front()));
  }
}

TEST(ToolChoiceProgram, K3CallsComeAfterTheResponseAsJsonBlocks) {
  const Tokenizer tok = test::byte_tokenizer(TemplateKind::kKimiK3);
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  ToolChoice required{ToolChoice::Mode::kRequired, ""};
  auto program =
      server::tool_choice_program(TemplateKind::kKimiK3, required, {"lookup", "say\"hi"}, tok, {});
  const std::string before =
      "Let me look.<|close|>think<|sep|><|open|>response<|sep|>One moment.<|close|>response<|sep|>";
  const std::string calls =
      "<|open|>tools<|sep|><|open|>call tool=\"lookup\" index=\"1\"<|sep|><|open|>json "
      "type=\"object\"<|sep|>{\"q\": [1, 2]}<|close|>json<|sep|><|close|>call<|sep|>"
      "<|open|>call tool=\"say&quot;hi\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>"
      "{}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>";
  TokenConstraint c(program, vocab);
  const std::vector<int32_t> free_part = encode_markup(tok, before);
  ASSERT_EQ(feed(c, free_part, v), free_part.size());
  // Once the response closed, only the tools channel may open.
  const std::vector<uint8_t> m = mask_of(c, v);
  EXPECT_EQ(std::count(m.begin(), m.end(), 1), 1);
  EXPECT_EQ(m[size_t(*tok.special_id("<|open|>"))], 1);
  const std::vector<int32_t> call_part = encode_markup(tok, calls);
  ASSERT_EQ(feed(c, call_part, v), call_part.size());
  EXPECT_TRUE(c.finished());  // the message's end is the model's
  const server::ToolCallSplit split = server::split_tool_calls(TemplateKind::kKimiK3, calls);
  ASSERT_EQ(split.calls.size(), 2u);
  EXPECT_EQ(split.calls[0].name, "lookup");
  EXPECT_EQ(split.calls[0].arguments, "{\"q\": [1, 2]}");
  EXPECT_EQ(split.calls[1].name, "say\"hi");
}

// With each function's `parameters`, a call's arguments follow the schema of the name it wrote
// (the names given unsorted, one of them escaped in K3's markup; a function without parameters
// takes any object).
TEST(ToolChoiceProgram, EachCallsArgumentsFollowItsFunctionsSchema) {
  const nlohmann::json weather = nlohmann::json::parse(
      R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"],
          "additionalProperties":false})");
  const nlohmann::json time = nlohmann::json::parse(
      R"({"type":"object","properties":{"tz":{"enum":["utc","cet"]}},"required":["tz"],
          "additionalProperties":false})");
  const std::vector<std::string> names = {"say\"hi", "get_weather", "get_time"};
  const std::vector<std::shared_ptr<const JsonSchema>> args = {
      nullptr, JsonSchema::compile(weather), JsonSchema::compile(time)};
  ToolChoice required{ToolChoice::Mode::kRequired, ""};
  {
    const Tokenizer tok = test::byte_tokenizer(TemplateKind::kKimi);
    const int64_t v = tok.vocab_size();
    auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
    const int32_t stop = *tok.special_id("<|im_end|>");
    auto program =
        server::tool_choice_program(TemplateKind::kKimi, required, names, tok, {stop}, args);
    const std::string head = "<|tool_calls_section_begin|><|tool_call_begin|>functions.";
    const std::string calls = head +
                              "get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}"
                              "<|tool_call_end|><|tool_call_begin|>functions.get_time:1"
                              "<|tool_call_argument_begin|>{\"tz\":\"cet\"}<|tool_call_end|>"
                              "<|tool_calls_section_end|>";
    std::vector<int32_t> ids = encode_markup(tok, calls);
    ids.push_back(stop);
    TokenConstraint c(program, vocab);
    EXPECT_EQ(feed(c, ids, v), ids.size());
    for (const auto& [text, bad] : std::vector<std::pair<std::string, std::string>>{
             {head + "get_weather:0<|tool_call_argument_begin|>{\"", "t"},       // time's member
             {head + "get_time:0<|tool_call_argument_begin|>{\"tz\": \"", "p"},  // not in enum
             {head + "get_time:0<|tool_call_argument_begin|>{", "}"},            // tz required
         }) {
      TokenConstraint w(program, vocab);
      const std::vector<int32_t> good = encode_markup(tok, text);
      ASSERT_EQ(feed(w, good, v), good.size()) << text;
      EXPECT_FALSE(w.allows(encode_markup(tok, bad).front())) << text << bad;
    }
  }
  {
    const Tokenizer tok = test::byte_tokenizer(TemplateKind::kKimiK3);
    const int64_t v = tok.vocab_size();
    auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
    auto program =
        server::tool_choice_program(TemplateKind::kKimiK3, required, names, tok, {}, args);
    const std::string before = "ok<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"";
    const std::string json_open = "\" index=\"0\"<|sep|><|open|>json type=\"object\"<|sep|>";
    for (const auto& [text, ok] : std::vector<std::pair<std::string, bool>>{
             {before + "get_time" + json_open + "{\"tz\":\"utc\"}", true},
             {before + "say&quot;hi" + json_open + "{\"anything\": [1]}", true},
             {before + "get_time" + json_open + "{\"city\"", false},
             {before + "get_weather" + json_open + "{\"city\": 5", false},
         }) {
      TokenConstraint c(program, vocab);
      const std::vector<int32_t> ids = encode_markup(tok, text);
      EXPECT_EQ(feed(c, ids, v) == ids.size(), ok) << text;
    }
  }
}

TEST(ResponseFormatProgram, JsonObjectIsTheAnswer) {
  {  // Kimi: the whole output, then a stop id.
    const Tokenizer tok = test::byte_tokenizer(TemplateKind::kKimi);
    const int64_t v = tok.vocab_size();
    auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
    const int32_t stop = *tok.special_id("<|im_end|>");
    auto program = server::json_object_program(TemplateKind::kKimi, true, tok, {stop});
    TokenConstraint c(program, vocab);
    EXPECT_FALSE(c.allows(encode_markup(tok, "S").front()));  // no prose before the object
    std::vector<int32_t> ids = encode_markup(tok, "{\"answer\": [1, \"two\"]}");
    ids.push_back(stop);
    EXPECT_EQ(feed(c, ids, v), ids.size());
    EXPECT_TRUE(c.finished());
  }
  const Tokenizer tok = test::byte_tokenizer(TemplateKind::kKimiK3);
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  for (bool thinking : {true, false}) {
    SCOPED_TRACE(thinking);
    // K3: the response channel holds the object; thinking before it is free.
    TokenConstraint c(server::json_object_program(TemplateKind::kKimiK3, thinking, tok, {}), vocab);
    const std::string text =
        std::string(thinking ? "Let me think.<|close|>think<|sep|><|open|>response<|sep|>" : "") +
        "{\"a\": 1}";
    const std::vector<int32_t> ids = encode_markup(tok, text);
    ASSERT_EQ(feed(c, ids, v), ids.size());
    EXPECT_FALSE(c.allows(encode_markup(tok, " ").front()));  // only the channel's close
    const std::vector<int32_t> close = encode_markup(tok, "<|close|>response<|sep|>");
    ASSERT_EQ(feed(c, close, v), close.size());
    EXPECT_TRUE(c.finished());
  }
}

}  // namespace
}  // namespace md
