// The Kimi and Kimi K3 chat template renderers against goldens rendered with jinja2 the way
// transformers does (tests/tokenizer/make_chat_golden.py; the K3 goldens also agree with Kimi K3's
// Python encoder and carry its segmentation), plus template detection and input validation.
#include "megadecode/tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "megadecode/base/error.h"
#include "test_util.h"

namespace md {
namespace {

using nlohmann::json;

json load_golden(const std::string& name = "kimi_golden.json") {
  std::ifstream f(test::data_dir() + "/data/chat/" + name);
  EXPECT_TRUE(f.good()) << "missing tests/data/chat/" << name;
  return json::parse(f);
}

ChatMessage to_message(const json& j) {
  ChatMessage m;
  m.role = j.at("role").get<std::string>();
  // None and "" render the same in every branch the goldens use.
  if (j.contains("content") && !j["content"].is_null()) m.content = j["content"].get<std::string>();
  if (j.contains("name")) m.name = j["name"].get<std::string>();
  if (j.contains("tool_call_id")) m.tool_call_id = j["tool_call_id"].get<std::string>();
  if (j.contains("reasoning_content")) m.reasoning = j["reasoning_content"].get<std::string>();
  if (j.contains("tool_calls")) {
    for (const auto& c : j["tool_calls"]) {
      m.tool_calls.push_back({c.at("id").get<std::string>(),
                              c.at("function").at("name").get<std::string>(),
                              c.at("function").at("arguments").get<std::string>()});
    }
  }
  return m;
}

TEST(ChatTemplate, MatchesJinjaGoldens) {
  json golden = load_golden();
  ASSERT_EQ(golden["template"], "kimi");
  ASSERT_GE(golden["cases"].size(), 15u);
  for (const auto& c : golden["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    std::vector<ChatMessage> messages;
    for (const auto& m : c["messages"]) messages.push_back(to_message(m));
    std::vector<json> tools;
    if (c["tools"].is_array())
      for (const auto& t : c["tools"]) tools.push_back(t);
    std::string got =
        render_chat(TemplateKind::kKimi, messages, c["add_generation_prompt"].get<bool>(), tools);
    EXPECT_EQ(got, c["expected"].get<std::string>());
  }
}

TEST(ChatTemplate, BadMessagesAreRejected) {
  std::vector<ChatMessage> bad_role = {{"user", "hi", "", "", {}, ""}, {"developer", "x", "", "", {}, ""}};
  try {
    render_chat(TemplateKind::kKimi, bad_role, true);
    ADD_FAILURE() << "accepted an unknown role";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown role 'developer'"), std::string::npos)
        << e.what();
  }
  std::vector<ChatMessage> empty_role = {{"", "x", "", "", {}, ""}};
  EXPECT_THROW(render_chat(TemplateKind::kKimi, empty_role, true), Error);
  std::vector<ChatMessage> user_calls = {{"user", "x", "", "", {{"id", "f", "{}"}}, ""}};
  EXPECT_THROW(render_chat(TemplateKind::kKimi, user_calls, true), Error);
}

TEST(ChatTemplate, DetectsTheKimiTemplate) {
  const std::string& src = kimi_linear_chat_template();
  EXPECT_NE(src.find("<|im_middle|>"), std::string::npos);
  EXPECT_EQ(detect_template(src), TemplateKind::kKimi);
  EXPECT_TRUE(template_is_exact(TemplateKind::kKimi, src));

  // Whitespace differences (e.g. CRLF, re-indentation in a JSON round trip) still match exactly.
  std::string reflowed;
  for (char c : src) reflowed += c == '\n' ? std::string("\r\n") : std::string(1, c);
  EXPECT_EQ(detect_template(reflowed), TemplateKind::kKimi);
  EXPECT_TRUE(template_is_exact(TemplateKind::kKimi, reflowed));

  // A variant of the family (different tool declaration) is recognised but not exact.
  std::string variant = src;
  variant.replace(variant.find("{{ tools | tojson }}"), 20,
                  "{{ tools | tojson(separators=(',', ':')) }}");
  EXPECT_EQ(detect_template(variant), TemplateKind::kKimi);
  EXPECT_FALSE(template_is_exact(TemplateKind::kKimi, variant));
}

TEST(ChatTemplate, RejectsOtherTemplates) {
  const std::string chatml =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
      "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|im_start|>assistant\\n' }}{% endif %}";
  try {
    detect_template(chatml);
    ADD_FAILURE() << "accepted a ChatML template";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("unknown chat template"), std::string::npos) << what;
    EXPECT_NE(what.find("--chat-template"), std::string::npos) << what;
  }
  EXPECT_THROW(detect_template(""), Error);
  // Thinking variants share the markers but render <think> blocks.
  std::string thinking = kimi_linear_chat_template();
  thinking.replace(thinking.find("<|im_assistant|>assistant<|im_middle|>\n{%- endif -%}"), 38,
                   "<|im_assistant|>assistant<|im_middle|><think>");
  EXPECT_THROW(detect_template(thinking), Error);
}

TEST(ChatTemplate, Names) {
  EXPECT_EQ(template_from_name("kimi"), TemplateKind::kKimi);
  EXPECT_EQ(template_from_name("kimi-k2"), TemplateKind::kKimi);
  EXPECT_EQ(template_from_name("kimi-linear"), TemplateKind::kKimi);
  EXPECT_EQ(template_name(TemplateKind::kKimi), "kimi");
  EXPECT_THROW(template_from_name("chatml"), Error);
  EXPECT_THROW(template_from_name(""), Error);
}

TEST(ChatTemplate, PythonJsonDumps) {
  // Expected strings are Python's json.dumps(..., ensure_ascii=False) output.
  const std::vector<std::pair<double, std::string>> floats = {
      {1e-05, "1e-05"},
      {0.0001, "0.0001"},
      {1e16, "1e+16"},
      {1e15, "1000000000000000.0"},
      {0.1, "0.1"},
      {-2.5, "-2.5"},
      {1.5e300, "1.5e+300"},
      {5e-324, "5e-324"},
      {123456789.125, "123456789.125"},
      {1.0 / 3, "0.3333333333333333"},
      {-0.0, "-0.0"},
      {100.0, "100.0"},
      {9007199254740992.0, "9007199254740992.0"},
  };
  for (const auto& [v, s] : floats) EXPECT_EQ(python_json_dumps(json(v)), s) << s;
  EXPECT_EQ(python_json_dumps(json::parse(R"({"b": [1, {}], "a": "x\u0001\u007f\u00e9\u2028\""})")),
            "{\"a\": \"x\\u0001\x7f\u00e9\u2028\\\"\", \"b\": [1, {}]}");
  EXPECT_EQ(python_json_dumps(json::parse("[[], {}, null, true, -5, 18446744073709551615]")),
            "[[], {}, null, true, -5, 18446744073709551615]");
  EXPECT_EQ(python_json_dumps(json("tab\tnl\ncr\rbs\\bell\x07")),
            "\"tab\\tnl\\ncr\\rbs\\\\bell\\u0007\"");
}

// ------------------------------------------------------------------------------------ Kimi K3

ChatOptions k3_options(const json& o) {
  ChatOptions opt;
  if (o.contains("thinking")) opt.thinking = o["thinking"].get<bool>();
  if (o.contains("thinking_effort")) {
    if (o["thinking_effort"].is_null())
      opt.thinking_effort.reset();
    else
      opt.thinking_effort = o["thinking_effort"].get<std::string>();
  }
  if (o.contains("tool_choice")) opt.tool_choice = o["tool_choice"].get<std::string>();
  if (o.contains("response_format")) opt.response_format = o["response_format"];
  return opt;
}

std::string segment_lengths(const std::vector<ChatSegment>& segs) {
  std::string out;
  for (const ChatSegment& s : segs) {
    if (!out.empty()) out += ' ';
    out += std::to_string(s.text.size());
    if (s.allow_special) out += 's';
  }
  return out;
}

TEST(ChatTemplateK3, MatchesJinjaAndEncoderGoldens) {
  json golden = load_golden("kimi_k3_golden.json");
  ASSERT_EQ(golden["template"], "kimi-k3");
  ASSERT_GE(golden["cases"].size(), 30u);
  size_t with_segments = 0;
  for (const auto& c : golden["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    std::vector<ChatMessage> messages;
    for (const auto& m : c["messages"]) messages.push_back(to_message(m));
    std::vector<json> tools;
    if (c["tools"].is_array())
      for (const auto& t : c["tools"]) tools.push_back(t);
    const bool gen = c["add_generation_prompt"].get<bool>();
    const ChatOptions opt = k3_options(c["options"]);
    const std::string expected = c["expected"].get<std::string>();
    EXPECT_EQ(render_chat(TemplateKind::kKimiK3, messages, gen, tools, opt), expected);
    std::vector<ChatSegment> segs =
        render_chat_segments(TemplateKind::kKimiK3, messages, gen, tools, opt);
    std::string joined;
    for (const ChatSegment& s : segs) {
      EXPECT_FALSE(s.text.empty());
      joined += s.text;
    }
    EXPECT_EQ(joined, expected);
    if (c.contains("segments")) {
      ++with_segments;
      EXPECT_EQ(segment_lengths(segs), c["segments"].get<std::string>());
    }
  }
  // The committed goldens were made with the reference encoder at hand.
  EXPECT_EQ(with_segments, golden["cases"].size());
}

TEST(ChatTemplateK3, ShapeOfAPrompt) {
  // The format at a glance (the goldens hold the details).
  std::vector<ChatMessage> msgs = {{"system", "Be brief.", "", "", {}, ""},
                                   {"user", "Hi", "", "", {}, ""}};
  ChatOptions opt;
  opt.thinking_effort.reset();
  EXPECT_EQ(render_chat(TemplateKind::kKimiK3, msgs, true, {}, opt),
            "<|open|>message role=\"system\"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>");
  opt.thinking = false;
  EXPECT_EQ(render_chat(TemplateKind::kKimiK3, {{"user", "Hi", "", "", {}, ""}}, true, {}, opt),
            "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
  // Message text is never special: a user typing markup gets a text segment.
  auto segs = render_chat_segments(TemplateKind::kKimiK3, {{"user", "<|open|>x", "", "", {}, ""}},
                                   false, {}, opt);
  ASSERT_EQ(segs.size(), 9u);
  EXPECT_EQ(segs[4].text, "<|open|>x");
  EXPECT_FALSE(segs[4].allow_special);
  EXPECT_TRUE(segs[3].allow_special);  // <|sep|>
  // The Kimi Linear format is one special segment (its tokenizer encodes the whole string).
  auto kimi = render_chat_segments(TemplateKind::kKimi, {{"user", "hi", "", "", {}, ""}}, true);
  ASSERT_EQ(kimi.size(), 1u);
  EXPECT_TRUE(kimi[0].allow_special);
  EXPECT_EQ(kimi[0].text, render_chat(TemplateKind::kKimi, {{"user", "hi", "", "", {}, ""}}, true));
}

TEST(ChatTemplateK3, BadInputsAreRejected) {
  std::vector<ChatMessage> hi = {{"user", "hi", "", "", {}, ""}};
  for (const char* effort : {"medium", "", "MAX"}) {
    ChatOptions opt;
    opt.thinking_effort = effort;
    EXPECT_THROW(render_chat(TemplateKind::kKimiK3, hi, true, {}, opt), Error) << effort;
    opt.thinking = false;  // the effort only matters when thinking
    EXPECT_NO_THROW(render_chat(TemplateKind::kKimiK3, hi, true, {}, opt)) << effort;
  }
  std::vector<ChatMessage> array_args = {{"assistant", "", "", "", {{"c1", "f", "[1, 2]"}}, ""}};
  EXPECT_THROW(render_chat(TemplateKind::kKimiK3, array_args, false), Error);
  // A tool result that matches no call, has no name and no call at its position.
  std::vector<ChatMessage> orphan = {{"user", "x", "", "", {}, ""}, {"tool", "r", "", "", {}, ""}};
  try {
    render_chat(TemplateKind::kKimiK3, orphan, true);
    ADD_FAILURE() << "accepted a tool result without a tool name";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no resolvable tool name"), std::string::npos) << e.what();
  }
  EXPECT_THROW(render_chat(TemplateKind::kKimiK3, {{"developer", "x", "", "", {}, ""}}, true),
               Error);
  EXPECT_THROW(
      render_chat(TemplateKind::kKimiK3, {{"user", "x", "", "", {{"id", "f", "{}"}}, ""}}, true),
      Error);
}

// Found by the chat fuzzer's review (tests/fuzz/corpus/chat/regress-args-*): arguments the JSON
// parser accepts but cannot hold, or nested deep enough to exhaust the stack when rendered, are
// md::Error naming the problem instead of a stray nlohmann exception or a crash.
TEST(ChatTemplateK3, UnrepresentableArgumentsAreNamed) {
  const std::string deep = "{\"a\": " + std::string(600, '[') + std::string(600, ']') + "}";
  for (const auto& [args, want] : {std::pair<std::string, std::string>{"{\"x\": 1e400}",
                                                                       "outside the double range"},
                                   {deep, "nest deeper than 512 levels"}}) {
    std::vector<ChatMessage> m = {{"assistant", "", "", "", {{"c1", "f", args}}, ""}};
    try {
      render_chat(TemplateKind::kKimiK3, m, false);
      ADD_FAILURE() << "accepted " << args.substr(0, 40);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
}

TEST(ChatTemplateK3, Detection) {
  const std::string& src = kimi_k3_chat_template();
  EXPECT_EQ(detect_template(src), TemplateKind::kKimiK3);
  EXPECT_TRUE(template_is_exact(TemplateKind::kKimiK3, src));
  EXPECT_FALSE(template_is_exact(TemplateKind::kKimi, src));
  EXPECT_FALSE(template_is_exact(TemplateKind::kKimiK3, kimi_linear_chat_template()));
  EXPECT_EQ(detect_template(kimi_linear_chat_template()), TemplateKind::kKimi);
  // A different template of the family (recognised by its structure tokens and channels).
  std::string variant = src;
  variant.replace(variant.find("{#-"), 3, "{#- variant");
  EXPECT_EQ(detect_template(variant), TemplateKind::kKimiK3);
  EXPECT_FALSE(template_is_exact(TemplateKind::kKimiK3, variant));

  // Real K3 checkpoints ship no template: the tokenizer's structure tokens decide.
  auto has = [](std::vector<std::string> present) {
    return [present](std::string_view t) {
      return std::find(present.begin(), present.end(), t) != present.end();
    };
  };
  const std::vector<std::string> k3 = {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"};
  EXPECT_EQ(detect_template("", has(k3)), TemplateKind::kKimiK3);
  EXPECT_THROW(detect_template("", has({"<|open|>", "<|close|>", "<|sep|>"})), Error);
  EXPECT_THROW(detect_template("", has({"<|im_end|>"})), Error);
  EXPECT_EQ(detect_template(kimi_linear_chat_template(), has(k3)), TemplateKind::kKimi);
  EXPECT_THROW(detect_template(""), Error);
}

TEST(ChatTemplateK3, NamesAndSpecialTokens) {
  EXPECT_EQ(template_from_name("kimi-k3"), TemplateKind::kKimiK3);
  EXPECT_EQ(template_from_name("k3"), TemplateKind::kKimiK3);
  EXPECT_EQ(template_name(TemplateKind::kKimiK3), "kimi-k3");

  auto specials = kimi_k3_special_tokens();
  auto offset_of = [&](std::string_view content) {
    for (const NamedSpecialToken& t : specials)
      if (t.content == content) return t.offset;
    return -1;
  };
  EXPECT_EQ(offset_of("[BOS]"), 0);
  EXPECT_EQ(offset_of("[EOS]"), 1);
  EXPECT_EQ(offset_of("<|end_of_msg|>"), 2);  // 163586, the checkpoint's eos_token_id
  EXPECT_EQ(offset_of("<|open|>"), 3);
  EXPECT_EQ(offset_of("<|close|>"), 4);
  EXPECT_EQ(offset_of("<|sep|>"), 5);
  EXPECT_EQ(offset_of("[UNK]"), 254);
  EXPECT_EQ(offset_of("[PAD]"), 255);
  for (std::string_view t : kimi_k3_structural_tokens()) EXPECT_GE(offset_of(t), 0) << t;
  EXPECT_EQ(kKimiK3EndOfMessage, "<|end_of_msg|>");
  for (size_t i = 0; i < specials.size(); ++i)
    for (size_t j = i + 1; j < specials.size(); ++j) {
      EXPECT_NE(specials[i].offset, specials[j].offset);
      EXPECT_NE(specials[i].content, specials[j].content);
    }
}

TEST(ChatTemplateK3, PythonJsonDumpsCompactAndOrdered) {
  EXPECT_EQ(python_json_dumps(json::parse(R"({"b": [1, {"y": 2.5}], "a": null})"), true),
            R"({"a":null,"b":[1,{"y":2.5}]})");
  EXPECT_EQ(python_json_dumps(nlohmann::ordered_json::parse(R"({"b": [1, {"y": 1e20}], "a": "é"})")),
            "{\"b\": [1, {\"y\": 1e+20}], \"a\": \"\u00e9\"}");
}

}  // namespace
}  // namespace md
