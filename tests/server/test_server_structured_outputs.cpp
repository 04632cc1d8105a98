// vLLM's structured outputs (server/structured_outputs.h) through the engine, on the tiny random
// checkpoint: sampled at temperature 1 from random weights, every finished answer is one of the
// choices, matches the whole regex, is the grammar's, or parses and follows the schema, on
// completions and chat, through `structured_outputs`, the older `guided_*` fields and llama.cpp's
// `grammar`; the request errors name the field.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <regex>

#include "server_test_util.h"

namespace md {
namespace {

using nlohmann::json;

server::EngineRequest engine_request(const server::CompletionRequest& r) {
  server::EngineRequest er;
  er.choices.push_back({r.prompts[0], r.sampling, r.constraint, r.logit_bias});
  return er;
}

json completion_body(const std::string& prompt, int seed) {
  return {{"model", "tiny"},
          {"prompt", prompt},
          {"max_tokens", 60},
          {"temperature", 1.0},
          {"seed", seed}};
}
json chat_body(const std::string& user, int seed) {
  return {{"model", "tiny"},
          {"messages", json::array({{{"role", "user"}, {"content", user}}})},
          {"max_tokens", 60},
          {"temperature", 1.0},
          {"seed", seed}};
}

// The answers of 6 seeds of `body` (chat or completion) that finished with a stop token, as text.
std::vector<std::string> finished_answers(test::ServedModel& m, server::EngineLoop& loop, json body,
                                          bool chat) {
  const server::ParseContext ctx = m.context();
  std::vector<std::string> out;
  for (int seed = 0; seed < 6; ++seed) {
    body["seed"] = seed;
    const server::CompletionRequest r = chat ? server::parse_chat_request(body.dump(), ctx)
                                             : server::parse_completion_request(body.dump(), ctx);
    EXPECT_TRUE(r.constraint);
    const test::Outcome o = test::collect(*loop.submit(engine_request(r)));
    if (o.finish != "stop") continue;
    std::vector<int32_t> gen = o.tokens;
    gen.pop_back();  // the stop token
    out.push_back(m.tok->decode(gen, false));
  }
  return out;
}

TEST(ServerStructuredOutputs, ChoicesRegexesAndSchemasHoldTheAnswer) {
  test::ServedModel m;
  server::EngineOptions o;
  o.max_model_len = 1024;
  server::EngineLoop loop(*m.ex, *m.tok, o);
  const std::vector<std::string> choices = {"positive", "negative", "neutral", "n/a"};
  for (bool chat : {false, true}) {
    SCOPED_TRACE(chat ? "chat" : "completion");
    json b = chat ? chat_body("classify", 0) : completion_body("classify:", 0);
    b["structured_outputs"] = {{"choice", choices}};
    std::vector<std::string> got = finished_answers(m, loop, b, chat);
    EXPECT_EQ(got.size(), 6u);  // a choice leaves the model nothing to wander off into
    for (const std::string& s : got)
      EXPECT_NE(std::find(choices.begin(), choices.end(), s), choices.end()) << s;
    b.erase("structured_outputs");
    b["guided_choice"] = choices;  // vLLM before 0.12
    EXPECT_EQ(finished_answers(m, loop, b, chat).size(), 6u);
    b.erase("guided_choice");

    const std::string pattern = "[A-Z]{2}-\\d{3}( (ok|no))?";
    b["structured_outputs"] = {{"regex", pattern}};
    got = finished_answers(m, loop, b, chat);
    EXPECT_GE(got.size(), 3u);
    for (const std::string& s : got) EXPECT_TRUE(std::regex_match(s, std::regex(pattern))) << s;
    b.erase("structured_outputs");
    b["guided_regex"] = "(yes|no)!?";
    got = finished_answers(m, loop, b, chat);
    EXPECT_GE(got.size(), 3u);
    for (const std::string& s : got)
      EXPECT_TRUE(s == "yes" || s == "no" || s == "yes!" || s == "no!") << s;
    b.erase("guided_regex");

    // A GBNF grammar: structured_outputs.grammar, vLLM's guided_grammar, llama.cpp's grammar.
    const std::string grammar =
        "root ::= answer (\", \" answer){0,2}\nanswer ::= (\"yes\" | \"no\") [0-9]?";
    const std::regex language("(yes|no)[0-9]?(, (yes|no)[0-9]?){0,2}");
    for (const char* field : {"structured_outputs", "guided_grammar", "grammar"}) {
      if (std::string(field) == "structured_outputs")
        b[field] = {{"grammar", grammar}};
      else
        b[field] = grammar;
      got = finished_answers(m, loop, b, chat);
      EXPECT_GE(got.size(), 3u) << field;
      for (const std::string& s : got) EXPECT_TRUE(std::regex_match(s, language)) << s;
      b.erase(field);
    }

    // A recursive grammar: balanced brackets around digits, through the pushdown automaton.
    b["structured_outputs"] = {
        {"grammar", "root ::= item (\",\" item){0,2}\nitem ::= [0-9] | \"[\" root \"]\""}};
    got = finished_answers(m, loop, b, chat);
    EXPECT_GE(got.size(), 3u);
    for (const std::string& s : got) {
      int depth = 0;
      bool ok = !s.empty();
      for (char ch : s) {
        depth += ch == '[' ? 1 : ch == ']' ? -1 : 0;
        ok = ok && depth >= 0 && (std::isdigit(uint8_t(ch)) || ch == '[' || ch == ']' || ch == ',');
      }
      EXPECT_TRUE(ok && depth == 0) << s;
    }
    b.erase("structured_outputs");

    const json schema = json::parse(R"({"type": "object", "additionalProperties": false,
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"]})");
    b["structured_outputs"] = {{"json", schema}};
    b["max_tokens"] = 200;
    got = finished_answers(m, loop, b, chat);
    b["structured_outputs"] = {{"json", schema.dump()}};  // the schema as JSON text, as vLLM takes
    for (const std::string& s : finished_answers(m, loop, b, chat)) got.push_back(s);
    EXPECT_GE(got.size(), 6u);
    for (const std::string& s : got) {
      const json j = json::parse(s);
      EXPECT_EQ(j.size(), 2u) << s;
      EXPECT_TRUE(j["n"].is_number_integer() && j["n"] >= 0 && j["n"] <= 9) << s;
      EXPECT_TRUE(j["ok"].is_boolean()) << s;
    }
    // Any root type: an array of small integers, a string of one of two values.
    b["structured_outputs"] = {{"json",
                                {{"type", "array"},
                                 {"items", {{"type", "integer"}, {"minimum", 0}, {"maximum", 99}}},
                                 {"maxItems", 4}}}};
    got = finished_answers(m, loop, b, chat);
    EXPECT_GE(got.size(), 3u);
    for (const std::string& s : got) {
      const json j = json::parse(s);
      EXPECT_TRUE(j.is_array() && j.size() <= 4) << s;
      for (const json& x : j) EXPECT_TRUE(x.is_number_integer() && x >= 0 && x <= 99) << s;
    }
    b["structured_outputs"] = {{"json", {{"enum", {"red", "green", 7}}}}};
    got = finished_answers(m, loop, b, chat);
    EXPECT_EQ(got.size(), 6u);
    for (const std::string& s : got) {
      const json j = json::parse(s);
      EXPECT_TRUE(j == "red" || j == "green" || j == 7) << s;
    }
    b["structured_outputs"] = {{"json_object", true}};
    for (const std::string& s : finished_answers(m, loop, b, chat))
      EXPECT_TRUE(json::parse(s).is_object()) << s;
  }
}

TEST(ServerStructuredOutputs, RequestErrorsNameTheField) {
  test::ServedModel m;
  const server::ParseContext ctx = m.context();
  auto error_param = [&](const json& b, bool chat = true) -> std::string {
    try {
      if (chat)
        server::parse_chat_request(b.dump(), ctx);
      else
        server::parse_completion_request(b.dump(), ctx);
    } catch (const server::ApiError& e) {
      EXPECT_EQ(e.status, 400);
      return e.param;
    }
    return "(accepted)";
  };
  json b = chat_body("x", 0);
  const std::pair<json, std::string> cases[] = {
      {json{{"structured_outputs", 5}}, "structured_outputs"},
      {json{{"structured_outputs", {{"regex", 5}}}}, "structured_outputs.regex"},
      {json{{"structured_outputs", {{"regex", "(a"}}}}, "structured_outputs.regex"},
      {json{{"structured_outputs", {{"regex", "(a)\\1"}}}}, "structured_outputs.regex"},
      {json{{"structured_outputs", {{"regex", "[ab]*a[ab]{14}"}}}}, "structured_outputs.regex"},
      {json{{"structured_outputs", {{"regex", "[^\\s\\S]"}}}}, "structured_outputs.regex"},
      {json{{"structured_outputs", {{"choice", json::array()}}}}, "structured_outputs.choice"},
      {json{{"structured_outputs", {{"choice", {"a", ""}}}}}, "structured_outputs.choice"},
      {json{{"structured_outputs", {{"choice", {"a", 1}}}}}, "structured_outputs.choice.1"},
      {json{{"structured_outputs", {{"json", "{not json"}}}}, "structured_outputs.json"},
      {json{{"structured_outputs", {{"json", 3}}}}, "structured_outputs.json"},
      {json{{"structured_outputs", {{"grammar", "root ::= root \"x\" | \"x\""}}}},
       "structured_outputs.grammar"},
      {json{{"structured_outputs", {{"grammar", 5}}}}, "structured_outputs.grammar"},
      {json{{"structured_outputs", {{"structural_tag", "{}"}}}},
       "structured_outputs.structural_tag"},
      {json{{"structured_outputs", {{"disable_any_whitespace", true}}}},
       "structured_outputs.disable_any_whitespace"},
      {json{{"structured_outputs", {{"regexp", "a"}}}}, "structured_outputs.regexp"},
      {json{{"structured_outputs", {{"regex", "a"}, {"choice", {"b"}}}}},
       "structured_outputs.regex"},
      {json{{"structured_outputs", {{"regex", "a"}}}, {"guided_choice", {"b"}}}, "guided_choice"},
      {json{{"guided_grammar", "root ::= item\nitem ::= <x>"}}, "guided_grammar"},
      {json{{"grammar", "item ::= \"a\""}}, "grammar"},
      {json{{"grammar", "root ::= \"a\""}, {"guided_regex", "b"}}, "grammar"},
      {json{{"guided_regex", "a"}, {"response_format", {{"type", "json_object"}}}}, "guided_regex"},
  };
  for (const auto& [fields, param] : cases) {
    json c = b;
    for (const auto& [k, v] : fields.items()) c[k] = v;
    EXPECT_EQ(error_param(c), param) << fields.dump();
  }
  // Beside a tool_choice that calls.
  json t = b;
  t["tools"] = json::array({{{"type", "function"},
                             {"function", {{"name", "f"}, {"parameters", {{"type", "object"}}}}}}});
  t["tool_choice"] = "required";
  t["guided_choice"] = {"a"};
  EXPECT_EQ(error_param(t), "guided_choice");
  t["tool_choice"] = "auto";
  EXPECT_EQ(error_param(t), "(accepted)");
  // response_format's schema must allow an object at the root too.
  json rf = b;
  rf["response_format"] = {{"type", "json_schema"},
                           {"json_schema", {{"name", "x"}, {"schema", {{"type", "string"}}}}}};
  EXPECT_EQ(error_param(rf), "response_format.json_schema.schema");
  // The completions endpoint takes them too; null fields and the backend name are ignored.
  json c = completion_body("x", 0);
  c["structured_outputs"] = {{"regex", "(a"}};
  EXPECT_EQ(error_param(c, false), "structured_outputs.regex");
  c["structured_outputs"] = {{"regex", "a+"}, {"choice", nullptr}, {"disable_fallback", true}};
  c["guided_decoding_backend"] = "xgrammar";
  EXPECT_EQ(error_param(c, false), "(accepted)");
}

}  // namespace
}  // namespace md
