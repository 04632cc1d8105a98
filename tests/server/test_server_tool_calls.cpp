// The tool-call parsers (src/server/tool_calls.cpp) against the chat templates that render the
// markup: an assistant message with tool calls goes through the real renderer, the tokenizer and
// the server's text path (TokenTextStream) and comes back as the same calls; malformed and cut
// markup stays content; streamed pieces give what the whole text gives; a mutation loop finds no
// crash and no disagreement between the whole and the streamed parse.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "megadecode/server/responses.h"
#include "megadecode/server/tool_calls.h"
#include "megadecode/text/text_stream.h"
#include "megadecode/tokenizer/bpe_train.h"
#include "test_util.h"

namespace md {
namespace {

using nlohmann::json;
using server::ParsedToolCall;
using server::split_tool_calls;
using server::ToolCallSplit;
using server::ToolCallStream;
using test::byte_tokenizer;

std::vector<int32_t> chat_ids(const Tokenizer& tok, TemplateKind kind,
                              const std::vector<ChatMessage>& ms, bool generation_prompt) {
  std::vector<int32_t> ids;
  for (const ChatSegment& s : render_chat_segments(kind, ms, generation_prompt)) {
    const std::vector<int32_t> v = tok.encode(s.text, s.allow_special);
    ids.insert(ids.end(), v.begin(), v.end());
  }
  return ids;
}

struct Emitted {
  std::string text, reasoning;
};

// `assistant` as a model answering a user turn would emit it: the rendered conversation's ids
// past the generation prompt, up to the end-of-message id (a stop id, which the text never sees),
// through the text stream the engine gives every sequence.
Emitted emit(TemplateKind kind, const ChatMessage& assistant) {
  const Tokenizer tok = byte_tokenizer(kind);
  std::vector<ChatMessage> user(1);
  user[0].role = "user";
  user[0].content = "hi";
  std::vector<ChatMessage> all = user;
  all.push_back(assistant);
  const std::vector<int32_t> prompt = chat_ids(tok, kind, user, true),
                             full = chat_ids(tok, kind, all, false);
  EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), full.begin()));
  std::vector<int32_t> gen(full.begin() + std::ptrdiff_t(prompt.size()), full.end());
  const int32_t stop = *tok.special_id(kind == TemplateKind::kKimiK3 ? "<|end_of_msg|>" : "<|im_end|>");
  EXPECT_EQ(gen.back(), stop);
  gen.pop_back();
  TokenTextStream ts(tok, {}, prompt);
  Emitted out;
  for (int32_t id : gen) {
    const TextDelta d = ts.push(id);
    out.text += d.text;
    out.reasoning += d.reasoning;
  }
  const TextDelta d = ts.finish();
  out.text += d.text;
  out.reasoning += d.reasoning;
  return out;
}

ChatMessage assistant(std::string content, std::vector<ToolCall> calls, std::string reasoning = "") {
  ChatMessage m;
  m.role = "assistant";
  m.content = std::move(content);
  m.tool_calls = std::move(calls);
  m.reasoning = std::move(reasoning);
  return m;
}

// The stream fed in pieces at the given cut points, its deltas gathered.
ToolCallSplit streamed(TemplateKind kind, std::string_view text, std::vector<size_t> cuts) {
  std::sort(cuts.begin(), cuts.end());
  ToolCallStream s(kind, "call_");
  ToolCallSplit out;
  auto take = [&](server::ToolCallDelta d) {
    out.content += d.content;
    server::add_pieces(out.calls, d.pieces);
  };
  size_t at = 0;
  for (size_t c : cuts) {
    c = std::min(c, text.size());
    take(s.feed(text.substr(at, c - at)));
    at = c;
  }
  take(s.feed(text.substr(at)));
  take(s.finish());
  return out;
}

bool same(const ToolCallSplit& a, const ToolCallSplit& b) {
  if (a.content != b.content || a.calls.size() != b.calls.size()) return false;
  for (size_t i = 0; i < a.calls.size(); ++i)
    if (a.calls[i].id != b.calls[i].id || a.calls[i].name != b.calls[i].name ||
        a.calls[i].arguments != b.calls[i].arguments)
      return false;
  return true;
}

// Every single cut point and a few random multi-cuts give what the whole text gives.
void expect_stream_equals_whole(TemplateKind kind, const std::string& text) {
  const ToolCallSplit whole = split_tool_calls(kind, text);
  for (size_t c = 0; c <= text.size(); ++c)
    ASSERT_TRUE(same(streamed(kind, text, {c}), whole)) << "cut at " << c << " of " << text;
  std::mt19937 rng(7);
  for (int k = 0; k < 20; ++k) {
    std::vector<size_t> cuts;
    for (int j = 0; j < 8; ++j) cuts.push_back(rng() % (text.size() + 1));
    ASSERT_TRUE(same(streamed(kind, text, cuts), whole)) << text;
  }
}

// ---- Kimi K3 -----------------------------------------------------------------------------------

TEST(ServerToolCalls, KimiK3RoundTripThroughTheTemplate) {
  // Arguments as Python's json.dumps writes them come back byte for byte; the others as the same
  // JSON (key order kept).
  const std::vector<ToolCall> calls = {
      {"", "get_weather", R"({"city": "Paris", "days": 3, "metric": true, "extra": null, "tags": ["a", "b"], "opts": {"x": 1.5, "y": [1, {"z": "w"}]}})"},
      {"", R"(we"ird&name)", R"({"a\"b&c": "line\nbreak <|open|> \u00e9t\u00e9", "n": -0.25})"},
      {"", "no_args", ""},
      {"", "empty_object", "{}"},
      {"", "raw", "not json at all"},
      {"", "compact", R"({"k":1e20,"s":"v"})"},
  };
  const Emitted e = emit(TemplateKind::kKimiK3, assistant("Let me check.", calls, "I should call tools."));
  EXPECT_EQ(e.reasoning, "I should call tools.");
  EXPECT_THAT(e.text, ::testing::HasSubstr("<|open|>tools<|sep|>"));
  const ToolCallSplit s = split_tool_calls(TemplateKind::kKimiK3, e.text, "call_x_");
  EXPECT_EQ(s.content, "Let me check.");
  ASSERT_EQ(s.calls.size(), calls.size()) << e.text;
  for (size_t i = 0; i < calls.size(); ++i) {
    SCOPED_TRACE(calls[i].name);
    EXPECT_EQ(s.calls[i].id, "call_x_" + std::to_string(i));
    EXPECT_EQ(s.calls[i].name, calls[i].name);
  }
  EXPECT_EQ(s.calls[0].arguments, calls[0].arguments);
  EXPECT_EQ(s.calls[1].arguments, std::string(R"({"a\"b&c": "line\nbreak <|open|> )") + "\xc3\xa9t\xc3\xa9" + R"(", "n": -0.25})");
  EXPECT_EQ(json::parse(s.calls[1].arguments), json::parse(calls[1].arguments));
  EXPECT_EQ(s.calls[2].arguments, "{}");  // blank arguments render as none
  EXPECT_EQ(s.calls[3].arguments, "{}");
  EXPECT_EQ(s.calls[4].arguments, "not json at all");  // a raw json block, verbatim
  EXPECT_EQ(nlohmann::ordered_json::parse(s.calls[5].arguments),
            nlohmann::ordered_json::parse(calls[5].arguments));
  EXPECT_EQ(s.calls[5].arguments, R"({"k": 1e+20, "s": "v"})");
  expect_stream_equals_whole(TemplateKind::kKimiK3, e.text);

  // No content and one call; no tool calls at all (the text is the content).
  const Emitted only = emit(TemplateKind::kKimiK3, assistant("", {{"", "f", R"({"q": "x"})"}}));
  const ToolCallSplit o = split_tool_calls(TemplateKind::kKimiK3, only.text);
  EXPECT_EQ(o.content, "");
  ASSERT_EQ(o.calls.size(), 1u);
  EXPECT_EQ(o.calls[0].arguments, R"({"q": "x"})");
  const Emitted plain = emit(TemplateKind::kKimiK3, assistant("Just an answer.", {}));
  EXPECT_EQ(split_tool_calls(TemplateKind::kKimiK3, plain.text).content, "Just an answer.");
}

TEST(ServerToolCalls, KimiK3MalformedMarkupStaysContent) {
  const std::string call =
      R"(<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="number"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>)";
  const std::string begin = "<|open|>tools<|sep|>", end = "<|close|>tools<|sep|>";
  auto split = [](const std::string& t) { return split_tool_calls(TemplateKind::kKimiK3, t); };
  // Well formed, for reference.
  ToolCallSplit ok = split("Hi" + begin + call + end);
  EXPECT_EQ(ok.content, "Hi");
  ASSERT_EQ(ok.calls.size(), 1u);
  EXPECT_EQ(ok.calls[0].arguments, R"({"a": 1})");
  const std::vector<std::string> broken = {
      // The model stopped mid-header (max_tokens), or right after the section's marker.
      "Hi" + begin + call.substr(0, 20),
      "Hi" + begin,
      // Unknown or missing attributes, unknown tags, a wrong or unknown type.
      "Hi" + begin + R"(<|open|>call tool="f" index="1" extra="x"<|sep|><|close|>call<|sep|>)" + end,
      "Hi" + begin + R"(<|open|>call tool="f"<|sep|><|close|>call<|sep|>)" + end,
      "Hi" + begin + R"(<|open|>call tool="f" index="one"<|sep|><|close|>call<|sep|>)" + end,
      "Hi" + begin + R"(<|open|>call tool="" index="1"<|sep|><|close|>call<|sep|>)" + end,
      "Hi" + begin + R"(<|open|>invoke tool="f" index="1"<|sep|><|close|>invoke<|sep|>)" + end,
      "Hi" + begin + R"(<|open|>call tool="f <|open|>" index="1"<|sep|><|close|>call<|sep|>)" + end,
      "Hi" + begin + "some text" + call + end,
  };
  for (const std::string& t : broken) {
    SCOPED_TRACE(t);
    const ToolCallSplit s = split(t);
    EXPECT_EQ(s.content, t);
    EXPECT_TRUE(s.calls.empty());
    expect_stream_equals_whole(TemplateKind::kKimiK3, t);
  }
  // A call whose header is complete is a call: what cannot continue it (marked '@' below), or the
  // output's end, ends it with the arguments it has (typed ones closed), and the rest is content.
  const std::string head = R"(<|open|>call tool="f" index="1"<|sep|>)";
  const std::vector<std::pair<std::string, std::string>> ended = {
      {head + R"(<|open|>argument key="a" type="number"<|sep|>1<|close|>argument<|sep|>@<|close|>call<|s)", R"({"a": 1})"},
      {head + R"(@<|open|>argument key="a" type="number"<|sep|>abc<|close|>argument<|sep|><|close|>call<|sep|>)" + end, "{}"},
      {head + R"(@<|open|>argument key="a" type="integer"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>)" + end, "{}"},
      {head + R"(@<|open|>argument key="a" type="string"<|sep|>x<|close|>call<|sep|>)" + end, "{}"},
      {head + R"(<|open|>argument key="a" type="string"<|sep|>x<|close|>argument<|sep|>@<|open|>argument key="a" type="string"<|sep|>y<|close|>argument<|sep|><|close|>call<|sep|>)" + end, R"({"a": "x"})"},
      {head + R"(<|open|>json type="object"<|sep|>x<|close|>json<|sep|>@<|open|>argument key="a" type="string"<|sep|>y<|close|>argument<|sep|><|close|>call<|sep|>)" + end, "x"},
      {head + R"(@<|open|>json type="array"<|sep|>[]<|close|>json<|sep|><|close|>call<|sep|>)" + end, "{}"},
      {head + R"(<|open|>json type="object"<|sep|>{"cut": )", R"({"cut": )"},
      {head + R"(@<|open|>argument key="a" type="object"<|sep|>)" + std::string(600, '[') + std::string(600, ']') + "<|close|>argument<|sep|><|close|>call<|sep|>" + end, "{}"},
  };
  for (auto [t, args] : ended) {
    const size_t at = t.find('@');
    if (at != std::string::npos) t.erase(at, 1);
    t = "Hi" + begin + t;
    SCOPED_TRACE(t);
    const ToolCallSplit s = split(t);
    ASSERT_EQ(s.calls.size(), 1u);
    EXPECT_EQ(s.calls[0].name, "f");
    EXPECT_EQ(s.calls[0].arguments, args);
    EXPECT_EQ(s.content, "Hi" + (at == std::string::npos ? "" : t.substr(at + 2 + begin.size())));
    expect_stream_equals_whole(TemplateKind::kKimiK3, t);
  }
  // Complete calls before a broken or cut header stay calls; the rest is content, verbatim.
  const std::string cut = "Hi" + begin + call + call.substr(0, 30);
  ToolCallSplit c = split(cut);
  EXPECT_EQ(c.calls.size(), 1u);
  EXPECT_EQ(c.content, "Hi" + call.substr(0, 30));
  // An unclosed section after complete calls loses nothing; text after the section is content;
  // whitespace between calls is markup.
  c = split("Hi" + begin + call + "\n" + call);
  EXPECT_EQ(c.calls.size(), 2u);
  EXPECT_EQ(c.content, "Hi");
  c = split("Hi" + begin + call + end + " bye");
  EXPECT_EQ(c.calls.size(), 1u);
  EXPECT_EQ(c.content, "Hi bye");
  // Markup outside a section is content.
  EXPECT_EQ(split(call).content, call);
  EXPECT_TRUE(split(call).calls.empty());
}

// ---- Kimi Linear / K2 --------------------------------------------------------------------------

TEST(ServerToolCalls, KimiRoundTripThroughTheTemplate) {
  const std::vector<ToolCall> calls = {
      {"functions.get_weather:0", "get_weather", R"({"city": "Paris"})"},
      {"functions.time:1", "time", "{}"},
      {"functions.raw:2", "raw", "anything, verbatim"},
  };
  const Emitted e = emit(TemplateKind::kKimi, assistant("Let me check.", calls));
  const ToolCallSplit s = split_tool_calls(TemplateKind::kKimi, e.text);
  EXPECT_EQ(s.content, "Let me check.");
  ASSERT_EQ(s.calls.size(), calls.size()) << e.text;
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(s.calls[i].id, calls[i].id);
    EXPECT_EQ(s.calls[i].name, calls[i].name);
    EXPECT_EQ(s.calls[i].arguments, calls[i].arguments);
  }
  expect_stream_equals_whole(TemplateKind::kKimi, e.text);
  const json j = server::tool_call_json(s.calls[0], 0);
  EXPECT_EQ(j, json::parse(R"({"index":0,"id":"functions.get_weather:0","type":"function",
                               "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}})"));
}

TEST(ServerToolCalls, KimiMalformedMarkupStaysContent) {
  auto split = [](const std::string& t) { return split_tool_calls(TemplateKind::kKimi, t); };
  const std::string begin = "<|tool_calls_section_begin|>", end = "<|tool_calls_section_end|>";
  const std::string f = "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>";
  const std::vector<std::string> broken = {
      "just text <|tool_call_begin|>",
      "x" + begin + "<|tool_call_begin|>functions.g:1",
      "x" + begin + "<|tool_call_begin|>functions.:0<|tool_call_argument_begin|>{}<|tool_call_end|>" + end,
      "x" + begin + "<|tool_call_begin|>functions.f:0<|tool_call_begin|>{}<|tool_call_end|>" + end,
      "x" + begin + "junk" + f + end,
      "x" + begin,
  };
  for (const std::string& t : broken) {
    SCOPED_TRACE(t);
    const ToolCallSplit s = split(t);
    EXPECT_EQ(s.content, t);
    EXPECT_TRUE(s.calls.empty());
    expect_stream_equals_whole(TemplateKind::kKimi, t);
  }
  // A call whose header is complete is a call: cut short, or ended by another marker (the rest
  // is content).
  ToolCallSplit s = split("x" + begin + "<|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{\"a\"");
  ASSERT_EQ(s.calls.size(), 1u);
  EXPECT_EQ(s.calls[0].name, "g");
  EXPECT_EQ(s.calls[0].arguments, "{\"a\"");
  EXPECT_EQ(s.content, "x");
  s = split("x" + begin + "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}" + end + "y");
  ASSERT_EQ(s.calls.size(), 1u);
  EXPECT_EQ(s.calls[0].arguments, "{}");
  EXPECT_EQ(s.content, "x" + end + "y");
  // A section cut short in a header keeps the complete calls; the partial one is content.
  const ToolCallSplit cut = split(begin + f + "<|tool_call_begin|>functions.g:1");
  ASSERT_EQ(cut.calls.size(), 1u);
  EXPECT_EQ(cut.calls[0].name, "f");
  EXPECT_EQ(cut.content, "<|tool_call_begin|>functions.g:1");
}

// Content is released as it comes; only what may begin the section's marker waits.
TEST(ServerToolCalls, StreamReleasesContentUnlessItMayStartASection) {
  ToolCallStream s(TemplateKind::kKimi, "call_");
  EXPECT_EQ(s.feed("Hello ").content, "Hello ");
  EXPECT_EQ(s.feed("wor<|tool").content, "wor");
  EXPECT_EQ(s.feed("s are <").content, "<|tools are ");
  server::ToolCallDelta d = s.feed("|tool_calls_section_begin|><|tool_call_begin|>functions.f:0");
  EXPECT_EQ(d.content, "");
  EXPECT_TRUE(d.pieces.empty());
  // The header goes out once complete, then the arguments in pieces; a tail that may begin a
  // marker waits.
  d = s.feed("<|tool_call_argument_begin|>");
  ASSERT_EQ(d.pieces.size(), 1u);
  EXPECT_TRUE(d.pieces[0].first);
  EXPECT_EQ(d.pieces[0].id, "functions.f:0");
  EXPECT_EQ(d.pieces[0].name, "f");
  EXPECT_EQ(d.pieces[0].arguments, "");
  EXPECT_EQ(server::tool_call_piece_json(d.pieces[0]),
            json::parse(R"({"index":0,"id":"functions.f:0","type":"function",
                            "function":{"name":"f","arguments":""}})"));
  d = s.feed("{\"a\"");
  ASSERT_EQ(d.pieces.size(), 1u);
  EXPECT_FALSE(d.pieces[0].first);
  EXPECT_EQ(d.pieces[0].arguments, "{\"a\"");
  EXPECT_EQ(server::tool_call_piece_json(d.pieces[0]),
            json::parse(R"({"index":0,"function":{"arguments":"{\"a\""}})"));
  d = s.feed(": 1}<|tool_c");
  ASSERT_EQ(d.pieces.size(), 1u);
  EXPECT_EQ(d.pieces[0].arguments, ": 1}");
  d = s.feed("all_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>[");
  ASSERT_EQ(d.pieces.size(), 1u);  // the next call starts, its first piece with "["
  EXPECT_EQ(d.pieces[0].index, 1u);
  EXPECT_EQ(d.pieces[0].arguments, "[");
  d = s.finish();
  EXPECT_EQ(d.content, "");
  EXPECT_TRUE(d.pieces.empty());
  EXPECT_EQ(s.calls(), 2u);

  ToolCallStream k3(TemplateKind::kKimiK3, "c");
  EXPECT_EQ(k3.feed("Sure<|open|>").content, "Sure");
  EXPECT_EQ(k3.feed("response<|sep|>").content, "<|open|>response<|sep|>");
  d = k3.feed("<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|close|>call<|sep|>");
  ASSERT_EQ(d.pieces.size(), 1u);
  EXPECT_EQ(d.pieces[0].id, "c0");
  EXPECT_EQ(d.pieces[0].arguments, "{}");
  // Typed arguments go out a member at a time.
  d = k3.feed("<|open|>call tool=\"g\" index=\"2\"<|sep|><|open|>argument key=\"k\" "
              "type=\"number\"<|sep|>2<|close|>argument<|sep|>");
  ASSERT_EQ(d.pieces.size(), 1u);
  EXPECT_EQ(d.pieces[0].arguments, "{\"k\": 2");
  d = k3.feed("<|open|>argument key=\"s\" type=\"string\"<|sep|>x<|close|>argument<|sep|><|close|>"
              "call<|sep|>");
  ASSERT_EQ(d.pieces.size(), 1u);
  EXPECT_FALSE(d.pieces[0].first);
  EXPECT_EQ(d.pieces[0].arguments, ", \"s\": \"x\"}");
}

// Mutations of rendered markup (byte edits, deletions, fragments spliced in, cuts, repeated
// spans; fixed seed): no exception, no crash, the streamed parse (random cuts) equals the whole
// one, text without a section marker is content unchanged, and K3's parsed arguments are JSON
// objects unless they came from a raw block.
TEST(ServerToolCalls, MutationsNeverCrashAndStreamEqualsWhole) {
  struct Seed {
    TemplateKind kind;
    std::string text;
  };
  std::vector<Seed> seeds;
  for (TemplateKind kind : {TemplateKind::kKimi, TemplateKind::kKimiK3}) {
    const bool k3 = kind == TemplateKind::kKimiK3;
    const std::vector<ToolCall> calls = {
        {"functions.a:0", "a", R"({"x": "y", "n": [1, 2.5, null], "o": {"t": true}})"},
        {"functions.b:1", "b&\"c", "raw text"},
        {"functions.c:2", "c", ""}};
    seeds.push_back({kind, emit(kind, assistant("Text before.", calls, k3 ? "think" : "")).text});
    seeds.push_back({kind, emit(kind, assistant("", {calls[0]})).text});
  }
  const std::vector<std::string> fragments = {
      "<|open|>", "<|close|>", "<|sep|>", "tools", "call", "argument", "json", " tool=\"", "\"",
      " index=\"1\"", " key=\"k\"", " type=\"string\"", " type=\"number\"", " type=\"object\"",
      "&amp;", "&quot;", "&", "{", "}", "[", "]", "1e999", "\n", " ", "<|", "|>",
      "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
      "<|tool_call_argument_begin|>", "<|tool_call_end|>", "functions.", ":0", "\xff", "\xc3"};
  std::mt19937_64 rng(20261201);
  auto pick = [&](size_t n) { return n ? size_t(rng() % n) : 0; };
  int cases = 0, with_calls = 0;
  for (; cases < 12000; ++cases) {
    const Seed& seed = seeds[pick(seeds.size())];
    std::string t = seed.text;
    const int edits = 1 + int(pick(4));
    for (int k = 0; k < edits; ++k) {
      const size_t at = pick(t.size() + 1);
      switch (pick(6)) {
        case 0:
          if (!t.empty()) t[std::min(at, t.size() - 1)] = char(rng());
          break;
        case 1:
          t.erase(std::min(at, t.size()), pick(12));
          break;
        case 2:
          t.insert(at, fragments[pick(fragments.size())]);
          break;
        case 3:
          t.resize(at);
          break;
        case 4: {
          const size_t from = pick(t.size() + 1);
          t.insert(at, t.substr(from, pick(40)));
          break;
        }
        default:
          break;  // unchanged: the valid markup itself
      }
    }
    SCOPED_TRACE(t);
    ToolCallSplit whole;
    try {
      whole = split_tool_calls(seed.kind, t);
    } catch (const std::exception& e) {
      FAIL() << "threw " << e.what();
    }
    std::vector<size_t> cuts;
    for (int j = 0, n = int(pick(6)); j < n; ++j) cuts.push_back(pick(t.size() + 1));
    ASSERT_TRUE(same(streamed(seed.kind, t, cuts), whole));
    const std::string begin = seed.kind == TemplateKind::kKimiK3 ? "<|open|>tools<|sep|>"
                                                                 : "<|tool_calls_section_begin|>";
    if (t.find(begin) == std::string::npos) {
      ASSERT_EQ(whole.content, t);
      ASSERT_TRUE(whole.calls.empty());
    }
    ASSERT_LE(whole.content.size(), t.size());
    with_calls += whole.calls.empty() ? 0 : 1;
  }
  EXPECT_GE(cases, 10000);
  EXPECT_GT(with_calls, 1000);  // the loop also exercises successful parses
}

}  // namespace
}  // namespace md
