// tool_choice enforced by the engine (server/chat_constraints.h through EngineLoop's constrained
// draws), on the tiny random checkpoint: whatever the random weights prefer, a named or required
// choice comes out as tool-call markup the program allows, and a finished output parses as calls
// of the declared functions with JSON-object arguments; a plain sequence decoding beside a
// constrained one is unchanged; the request fields are validated.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "megadecode/server/tool_calls.h"
#include "server_test_util.h"

namespace md {
namespace {

using nlohmann::json;

json tools_json() {
  json params = {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}};
  return json::array({{{"type", "function"},
                       {"function", {{"name", "get_weather"}, {"parameters", params}}}},
                      {{"type", "function"}, {"function", {{"name", "get_time"}}}}});
}

json chat_body(const std::string& user, const json& tool_choice, double temperature, int seed) {
  return {{"model", "tiny"},
          {"messages", json::array({{{"role", "user"}, {"content", user}}})},
          {"tools", tools_json()},
          {"tool_choice", tool_choice},
          {"max_tokens", 80},
          {"temperature", temperature},
          {"seed", seed}};
}

server::EngineRequest engine_request(const server::CompletionRequest& r) {
  server::EngineRequest er;
  er.choices.push_back({r.prompts[0], r.sampling, r.constraint, r.logit_bias});
  return er;
}

// A finished output: only calls (get_weather alone when named), each with an object.
void expect_calls(const std::string& text, bool named) {
  const server::ToolCallSplit split = server::split_tool_calls(TemplateKind::kKimi, text);
  EXPECT_EQ(split.content, "");
  ASSERT_GE(split.calls.size(), 1u) << text;
  if (named) {
    ASSERT_EQ(split.calls.size(), 1u);
  }
  for (const server::ParsedToolCall& c : split.calls) {
    EXPECT_TRUE(c.name == "get_weather" || (!named && c.name == "get_time")) << c.name;
    EXPECT_TRUE(json::parse(c.arguments).is_object()) << c.arguments;
  }
}

TEST(ServerToolChoice, NamedAndRequiredChoicesDecodeCallsOfTheDeclaredFunctions) {
  test::ServedModel m;
  server::EngineOptions o;
  o.max_model_len = 1024;
  server::EngineLoop loop(*m.ex, *m.tok, o);
  const server::ParseContext ctx = m.context();
  auto vocab = std::make_shared<const ConstraintVocab>(*m.tok, m.model->config().vocab_size);
  const json named = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  for (int k = 0; k < 8; ++k) {
    const json choice = k % 2 == 0 ? named : json("required");
    const server::CompletionRequest r = server::parse_chat_request(
        chat_body("weather in city " + std::to_string(k) + "?", choice, k < 4 ? 0.0 : 1.0, k)
            .dump(),
        ctx);
    ASSERT_TRUE(r.constraint);
    const test::Outcome out = test::collect(*loop.submit(engine_request(r)));
    ASSERT_FALSE(out.tokens.empty());
    // Every token is one the program allows, in order.
    TokenConstraint replay(r.constraint, vocab);
    for (size_t i = 0; i < out.tokens.size(); ++i) {
      ASSERT_TRUE(replay.allows(out.tokens[i])) << "token " << i << " of run " << k;
      replay.accept(out.tokens[i]);
    }
    std::vector<int32_t> gen = out.tokens;
    if (out.finish == "stop") gen.pop_back();  // the stop id
    const std::string text = m.tok->decode(gen, false);
    const std::string head = k % 2 == 0
                                 ? "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:"
                                 : "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_";
    EXPECT_EQ(text.substr(0, head.size()), head.substr(0, text.size())) << text;
    if (out.finish != "stop") {
      EXPECT_EQ(out.finish, "length");
      continue;
    }
    expect_calls(text, k % 2 == 0);
  }
}

// The same once the model is inside the arguments: the first ids are forced (a test hook) up to
// the end of a string value, and from there the constrained draws of the random weights must
// close the object, the call and the section, and stop.
TEST(ServerToolChoice, ConstrainedDrawsCloseTheCallAndStop) {
  test::ServedModel m;
  server::EngineOptions o;
  o.max_model_len = 1024;
  o.test_forced_tokens = m.tok->encode(
      "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
      "<|tool_call_argument_begin|>{\"city\": \"Paris\"",
      true);
  server::EngineLoop loop(*m.ex, *m.tok, o);
  const server::ParseContext ctx = m.context();
  const json named = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  int finished = 0;
  for (int k = 0; k < 6; ++k) {
    const server::CompletionRequest r = server::parse_chat_request(
        chat_body("weather " + std::to_string(k), named, k < 2 ? 0.0 : 1.0, k).dump(), ctx);
    const test::Outcome out = test::collect(*loop.submit(engine_request(r)));
    if (out.finish != "stop") continue;
    ++finished;
    std::vector<int32_t> gen = out.tokens;
    gen.pop_back();
    expect_calls(m.tok->decode(gen, false), true);
  }
  // Fixed seeds: the same runs finish every time.
  EXPECT_GE(finished, 3);
}

// response_format json_object: the random weights' answer is held to JSON; finished, it parses.
TEST(ServerToolChoice, ResponseFormatHoldsTheAnswerToAJsonObject) {
  test::ServedModel m;
  server::EngineOptions o;
  o.max_model_len = 1024;
  o.test_forced_tokens = m.tok->encode_ordinary("{\"answer\": \"yes\"");  // then the model
  server::EngineLoop loop(*m.ex, *m.tok, o);
  const server::ParseContext ctx = m.context();
  auto vocab = std::make_shared<const ConstraintVocab>(*m.tok, m.model->config().vocab_size);
  int finished = 0;
  for (int k = 0; k < 6; ++k) {
    json body = chat_body("json please " + std::to_string(k), "auto", k < 2 ? 0.0 : 1.0, k);
    body.erase("tools");
    body.erase("tool_choice");
    body["response_format"] = {{"type", "json_object"}};
    const server::CompletionRequest r = server::parse_chat_request(body.dump(), ctx);
    ASSERT_TRUE(r.constraint);
    const test::Outcome out = test::collect(*loop.submit(engine_request(r)));
    TokenConstraint replay(r.constraint, vocab);
    for (int32_t id : out.tokens) {
      ASSERT_TRUE(replay.allows(id));
      replay.accept(id);
    }
    if (out.finish != "stop") continue;
    ++finished;
    std::vector<int32_t> gen = out.tokens;
    gen.pop_back();
    EXPECT_TRUE(json::parse(m.tok->decode(gen, false)).is_object());
  }
  EXPECT_GE(finished, 3);  // fixed seeds: the same runs finish every time
}

// response_format json_schema: the answer follows the schema (sampled at temperature 1 from the
// random weights: whatever is finished parses, has the required members and their types, and
// nothing else); a named tool's arguments follow its `parameters`.
TEST(ServerToolChoice, JsonSchemaHoldsTheAnswerAndTheArgumentsToTheirSchemas) {
  test::ServedModel m;
  server::EngineOptions o;
  o.max_model_len = 1024;
  server::EngineLoop loop(*m.ex, *m.tok, o);
  const server::ParseContext ctx = m.context();
  const json schema = json::parse(R"({"type": "object", "additionalProperties": false,
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                     "unit": {"enum": ["c", "f"]}},
      "required": ["city", "days", "unit"]})");
  int finished = 0;
  for (int k = 0; k < 6; ++k) {
    json body = chat_body("json please " + std::to_string(k), "auto", 1.0, k);
    body.erase("tools");
    body.erase("tool_choice");
    body["response_format"] = {{"type", "json_schema"},
                               {"json_schema", {{"name", "w"}, {"schema", schema}}}};
    body["max_tokens"] = 600;  // (random weights end a string rarely)
    const server::CompletionRequest r = server::parse_chat_request(body.dump(), ctx);
    ASSERT_TRUE(r.constraint);
    const test::Outcome out = test::collect(*loop.submit(engine_request(r)));
    if (out.finish != "stop") continue;
    ++finished;
    std::vector<int32_t> gen = out.tokens;
    gen.pop_back();
    const json j = json::parse(m.tok->decode(gen, false));
    ASSERT_TRUE(j.is_object());
    EXPECT_EQ(j.size(), 3u) << j.dump();
    EXPECT_TRUE(j["city"].is_string()) << j.dump();
    EXPECT_TRUE(j["days"].is_number_integer()) << j.dump();
    EXPECT_TRUE(j["unit"] == "c" || j["unit"] == "f") << j.dump();
  }
  EXPECT_GE(finished, 3);  // fixed seeds: the same runs finish every time
  // A named function whose parameters allow only a string "city": its calls' arguments.
  json tools = tools_json();
  tools[0]["function"]["parameters"]["additionalProperties"] = false;
  tools[0]["function"]["parameters"]["required"] = {"city"};
  const json named = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  int calls = 0;
  for (int k = 0; k < 6; ++k) {
    json body = chat_body("weather " + std::to_string(k), named, 1.0, k);
    body["tools"] = tools;
    body["max_tokens"] = 600;
    const server::CompletionRequest r = server::parse_chat_request(body.dump(), ctx);
    const test::Outcome out = test::collect(*loop.submit(engine_request(r)));
    if (out.finish != "stop") continue;
    std::vector<int32_t> gen = out.tokens;
    gen.pop_back();
    const server::ToolCallSplit split =
        server::split_tool_calls(TemplateKind::kKimi, m.tok->decode(gen, false));
    for (const auto& c : split.calls) {
      const json a = json::parse(c.arguments);
      EXPECT_EQ(a.size(), 1u) << c.arguments;
      EXPECT_TRUE(a["city"].is_string()) << c.arguments;
      ++calls;
    }
  }
  EXPECT_GE(calls, 1);
}

TEST(ServerToolChoice, APlainSequenceBesideAConstrainedOneIsUnchanged) {
  test::ServedModel m;
  server::EngineOptions o;
  o.max_model_len = 1024;
  server::EngineLoop loop(*m.ex, *m.tok, o);
  const server::ParseContext ctx = m.context();
  const std::vector<int32_t> plain_prompt = m.tok->encode_ordinary("a plain stream of tokens");
  const test::Outcome solo = test::collect(*loop.submit(test::greedy_request(plain_prompt, 40)));
  const server::CompletionRequest r = server::parse_chat_request(
      chat_body("weather?", "required", 0.0, 1).dump(), ctx);
  auto constrained = loop.submit(engine_request(r));
  auto beside = loop.submit(test::greedy_request(plain_prompt, 40));
  test::collect(*constrained);
  EXPECT_EQ(test::collect(*beside).tokens, solo.tokens);
}

// parallel_tool_calls false: a required choice makes exactly one call (after the first call's
// end only the section's end may follow); true (the default) lets another call begin.
TEST(ServerToolChoice, ParallelToolCallsFalseMakesOneCall) {
  test::ServedModel m(1);
  const server::ParseContext ctx = m.context();
  for (const bool parallel : {true, false}) {
    json b = chat_body("x", "required", 0, 0);
    b["parallel_tool_calls"] = parallel;
    const server::CompletionRequest r = server::parse_chat_request(b.dump(), ctx);
    ASSERT_TRUE(r.constraint);
    EXPECT_EQ(test::allows_second_call(m, r.constraint), parallel);
  }
  json b = chat_body("x", "required", 0, 0);
  b["parallel_tool_calls"] = "no";
  EXPECT_THROW(server::parse_chat_request(b.dump(), ctx), server::ApiError);
}

TEST(ServerToolChoice, TheFieldsAreValidated) {
  test::ServedModel m(1);
  const server::ParseContext ctx = m.context();
  auto error_param = [&](const json& body) -> std::string {
    try {
      server::parse_chat_request(body.dump(), ctx);
    } catch (const server::ApiError& e) {
      EXPECT_EQ(e.status, 400);
      return e.param;
    }
    return "(accepted)";
  };
  json b = chat_body("x", {{"type", "function"}, {"function", {{"name", "nope"}}}}, 0, 0);
  EXPECT_EQ(error_param(b), "tool_choice.function.name");
  b["tool_choice"] = {{"type", "function"}};
  EXPECT_EQ(error_param(b), "tool_choice.function.name");
  b["tool_choice"] = {{"type", "other"}, {"function", {{"name", "get_time"}}}};
  EXPECT_EQ(error_param(b), "tool_choice.type");
  b["tool_choice"] = "always";
  EXPECT_EQ(error_param(b), "tool_choice");
  b["tool_choice"] = "required";
  b.erase("tools");
  EXPECT_EQ(error_param(b), "tool_choice");
  b["tool_choice"] = "none";  // without tools: nothing to enforce
  EXPECT_FALSE(server::parse_chat_request(b.dump(), ctx).constraint);
  b = chat_body("x", "auto", 0, 0);
  EXPECT_FALSE(server::parse_chat_request(b.dump(), ctx).constraint);
  b["tool_choice"] = "none";
  EXPECT_TRUE(server::parse_chat_request(b.dump(), ctx).constraint);
  b["tool_choice"] = "auto";  // response_format holds the answer to one JSON object
  b["response_format"] = {{"type", "json_object"}};
  EXPECT_TRUE(server::parse_chat_request(b.dump(), ctx).constraint);
  b.erase("response_format");
  // Schemas the output cannot be held to: 400 naming where they are.
  b["response_format"] = {{"type", "json_schema"},
                          {"json_schema", {{"name", "x"}, {"schema", {{"enum", json::array()}}}}}};
  EXPECT_EQ(error_param(b), "response_format.json_schema.schema");
  b["response_format"] = {{"type", "json_schema"}, {"json_schema", 5}};
  EXPECT_EQ(error_param(b), "response_format.json_schema");
  b.erase("response_format");
  b["tool_choice"] = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  b["tools"][0]["function"]["parameters"] = {{"type", "array"}};
  EXPECT_EQ(error_param(b), "tools.0.function.parameters");
  b["tools"] = tools_json();
  b["tools"][0]["function"]["name"] = "a:b";  // cannot be written in a Kimi call id
  b["tool_choice"] = "required";
  EXPECT_EQ(error_param(b), "tool_choice");
}

}  // namespace
}  // namespace md
