// The Kimi chat template renderer against goldens rendered with jinja2 the way transformers does
// (tests/tokenizer/make_chat_golden.py), plus template detection and input validation.
#include "megadecode/tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "megadecode/base/error.h"
#include "test_util.h"

namespace md {
namespace {

using nlohmann::json;

json load_golden() {
  std::ifstream f(test::data_dir() + "/data/chat/kimi_golden.json");
  EXPECT_TRUE(f.good()) << "missing tests/data/chat/kimi_golden.json";
  return json::parse(f);
}

ChatMessage to_message(const json& j) {
  ChatMessage m;
  m.role = j.at("role").get<std::string>();
  // None and "" render the same in every branch the goldens use.
  if (j.contains("content") && !j["content"].is_null()) m.content = j["content"].get<std::string>();
  if (j.contains("name")) m.name = j["name"].get<std::string>();
  if (j.contains("tool_call_id")) m.tool_call_id = j["tool_call_id"].get<std::string>();
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
  std::vector<ChatMessage> bad_role = {{"user", "hi", "", "", {}}, {"developer", "x", "", "", {}}};
  try {
    render_chat(TemplateKind::kKimi, bad_role, true);
    ADD_FAILURE() << "accepted an unknown role";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown role 'developer'"), std::string::npos)
        << e.what();
  }
  std::vector<ChatMessage> empty_role = {{"", "x", "", "", {}}};
  EXPECT_THROW(render_chat(TemplateKind::kKimi, empty_role, true), Error);
  std::vector<ChatMessage> user_calls = {{"user", "x", "", "", {{"id", "f", "{}"}}}};
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

}  // namespace
}  // namespace md
