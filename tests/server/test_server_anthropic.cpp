// The Anthropic Messages API without and with HTTP: requests become the chat request of the same
// conversation, bad ones a 4xx naming the Messages field (in Anthropic's error shape through
// HTTP); the builder's blocks and streamed events agree; tool calls become tool_use blocks with
// their input as an object; a mutation run over the parser finds no crash.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "megadecode/server/anthropic_api.h"
#include "server/http_test_server.h"

namespace md {
namespace {

using test::error_of;

using nlohmann::json;
using server::ApiError;
using server::ChoiceEvent;
using server::MessagesRequest;
using test::post_json;
using test::TestServer;
using ::testing::HasSubstr;

class ServerAnthropic : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { served_ = new test::ServedModel(1); }
  static void TearDownTestSuite() {
    delete served_;
    served_ = nullptr;
  }
  static server::ParseContext ctx() { return served_->context(1024); }
  static MessagesRequest messages(const json& body) {
    return server::parse_messages_request(body.dump(), ctx());
  }
  static server::CompletionRequest chat(const json& body) {
    return server::parse_chat_request(body.dump(), ctx());
  }
  static test::ServedModel* served_;
};
test::ServedModel* ServerAnthropic::served_ = nullptr;

TEST_F(ServerAnthropic, BlocksRenderAsTheChatOfTheSameConversation) {
  const json m = json::parse(R"({
    "model": "tiny", "max_tokens": 9, "temperature": 0, "system": [{"type": "text", "text": "S."}],
    "stop_sequences": ["###"],
    "messages": [
      {"role": "user", "content": "weather in Paris?"},
      {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Call the tool.", "signature": "x"},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "functions.get_weather:0", "name": "get_weather",
         "input": {"city": "Paris"}}]},
      {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "functions.get_weather:0",
         "content": [{"type": "text", "text": "12 C"}]},
        {"type": "text", "text": "Thanks."}, {"type": "text", "text": "And Rome?"}]}
    ],
    "tools": [{"name": "get_weather", "description": "w",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]})");
  const json c = json::parse(R"({
    "model": "tiny", "max_tokens": 9, "temperature": 0, "stop": ["###"],
    "messages": [
      {"role": "system", "content": "S."},
      {"role": "user", "content": "weather in Paris?"},
      {"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.",
       "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "12 C"},
      {"role": "user", "content": "Thanks.\nAnd Rome?"}
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "w",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})");
  const MessagesRequest r = messages(m);
  const server::CompletionRequest cr = chat(c);
  EXPECT_EQ(r.chat.prompts, cr.prompts);
  EXPECT_EQ(r.chat.sampling.max_tokens, 9);
  EXPECT_EQ(r.chat.sampling.stop_strings, std::vector<std::string>{"###"});
  EXPECT_TRUE(r.chat.tools_given);
  EXPECT_FALSE(r.chat.constraint);
  // tool_choice any / tool, and output_config.format, are enforced as in chat.
  json any = m;
  any["tool_choice"] = {{"type", "any"}};
  EXPECT_TRUE(messages(any).chat.constraint);
  any["tool_choice"] = {{"type", "tool"}, {"name", "get_weather"}};
  EXPECT_TRUE(messages(any).chat.constraint);
  // disable_parallel_tool_use: one call.
  for (const bool disable : {false, true}) {
    any["tool_choice"] = {{"type", "any"}, {"disable_parallel_tool_use", disable}};
    EXPECT_EQ(test::allows_second_call(*served_, messages(any).chat.constraint), !disable);
  }
  EXPECT_TRUE(
      messages({{"max_tokens", 5},
                {"messages", {{{"role", "user"}, {"content", "x"}}}},
                {"output_config",
                 {{"format", {{"type", "json_schema"}, {"schema", {{"type", "object"}}}}}}}})
          .chat.constraint);
  EXPECT_EQ(server::count_message_tokens(m.dump(), ctx()), int64_t(r.chat.prompts[0].size()));
  // A final assistant message is a prefill: the generation prompt, then its text (trailing
  // whitespace trimmed), as the chat endpoint's continue_final_message renders it.
  const json user = {{"role", "user"}, {"content", "x"}};
  const MessagesRequest pre =
      messages({{"max_tokens", 5},
                {"messages", {user, {{"role", "assistant"}, {"content", "The answer is "}}}}});
  const server::CompletionRequest cont =
      chat({{"max_tokens", 5},
            {"messages", {user, {{"role", "assistant"}, {"content", "The answer is"}}}},
            {"continue_final_message", true},
            {"add_generation_prompt", false}});
  EXPECT_EQ(pre.chat.prompts, cont.prompts);
}

TEST_F(ServerAnthropic, BadRequestsNameTheMessagesField) {
  struct Case {
    json body;
    int status;
    std::string param;
  };
  const json user = {{{"role", "user"}, {"content", "x"}}};
  auto with = [&](json extra) {
    json b = {{"max_tokens", 4}, {"messages", user}};
    b.update(extra);
    return b;
  };
  const std::vector<Case> cases = {
      {{{"messages", user}}, 400, "max_tokens"},
      {with({{"max_tokens", 0}}), 400, "max_tokens"},
      {with({{"messages", json::array()}}), 400, "messages"},
      {with({{"messages", {{{"role", "system"}, {"content", "x"}}}}}), 400, "messages.0.role"},
      {with({{"messages", {{{"role", "user"}}}}}), 400, "messages.0.content"},
      {with({{"messages", {{{"role", "user"}, {"content", {{{"type", "image"}}}}}}}}), 400,
       "messages.0.content.0.type"},
      {with({{"messages",
              {user[0],
               {{"role", "assistant"},
                {"content",
                 {{{"type", "tool_use"},
                   {"id", "a"},
                   {"name", "f"},
                   {"input", json::object()}}}}}}}}),
       400, "messages.1"},
      {with({{"messages", {user[0], {{"role", "assistant"}, {"content", "{"}}}},
             {"output_config",
              {{"format", {{"type", "json_schema"}, {"schema", json::object()}}}}}}),
       400, "messages.1"},
      {with({{"messages",
              {user[0],
               {{"role", "assistant"},
                {"content", {{{"type", "tool_use"}, {"id", "a"}, {"name", "f"}, {"input", "x"}}}}},
               user[0]}}}),
       400, "messages.1.content.0.input"},
      {with({{"system", 5}}), 400, "system"},
      {with({{"stop_sequences", {""}}}), 400, "stop_sequences"},
      {with({{"temperature", -1}}), 400, "temperature"},
      {with({{"tools", {{{"type", "bash_20250124"}, {"name", "bash"}}}}}), 400, "tools.0.type"},
      {with({{"tools", {{{"name", "f"}}}}}), 400, "tools.0.input_schema"},
      {with({{"tools", {{{"name", "f"}, {"input_schema", {{"enum", json::array()}}}}}},
             {"tool_choice", {{"type", "any"}}}}),
       400, "tools.0.input_schema"},
      {with({{"tool_choice", {{"type", "any"}}}}), 400, "tool_choice"},
      {with({{"tool_choice", {{"type", "sometimes"}}}}), 400, "tool_choice.type"},
      {with({{"thinking", {{"type", "maybe"}}}}), 400, "thinking.type"},
      {with({{"output_config", {{"effort", "huge"}}}}), 400, "output_config.effort"},
      {with({{"output_config", {{"format", {{"type", "json_schema"}}}}}}), 400,
       "output_config.format.schema"},
      {with({{"model", "claude"}}), 404, "model"},
      {with({{"max_tokens", 100000}}), 400, "max_tokens"},
  };
  for (const Case& c : cases) {
    const ApiError e = error_of([&] { messages(c.body); });
    EXPECT_EQ(e.status, c.status) << c.body.dump() << ": " << e.message;
    EXPECT_EQ(e.param, c.param) << c.body.dump() << ": " << e.message;
  }
  const json shaped = server::anthropic_error(error_of([&] { messages(cases[0].body); }));
  EXPECT_EQ(shaped["type"], "error");
  EXPECT_EQ(shaped["error"]["type"], "invalid_request_error");
  EXPECT_THAT(shaped["error"]["message"].get<std::string>(), HasSubstr("max_tokens"));
  EXPECT_EQ(server::anthropic_error(ApiError(404, "x"))["error"]["type"], "not_found_error");
  EXPECT_EQ(server::anthropic_error(ApiError(503, "x"))["error"]["type"], "overloaded_error");
  EXPECT_EQ(server::anthropic_error(ApiError(500, "x"))["error"]["type"], "api_error");
}

// ---- the builder --------------------------------------------------------------------------------

std::shared_ptr<const MessagesRequest> request(bool tools) {
  auto r = std::make_shared<MessagesRequest>();
  r->chat.tools_given = tools;
  r->chat.chat_template = TemplateKind::kKimi;
  r->chat.prompts = {{1, 2, 3}};
  return r;
}

ChoiceEvent event(std::string text, std::string reasoning) {
  ChoiceEvent e;
  e.text = std::move(text);
  e.reasoning = std::move(reasoning);
  e.tokens = {1};
  return e;
}

// Streams and builds the same events; replays the stream into a message and compares.
json build(std::shared_ptr<const MessagesRequest> req, std::vector<ChoiceEvent> ev,
           std::vector<json>* events = nullptr) {
  const server::ResponseMeta meta{"msg_00ff", 0, "tiny"};
  server::MessageBuilder s(req, meta, true), w(req, meta, false);
  std::string out = s.open();
  for (ChoiceEvent e : ev) {
    ChoiceEvent e2 = e;
    s.add(e);
    w.add(e2);
  }
  s.finish();
  w.finish();
  out += s.take_events();
  std::vector<json> data;
  for (size_t pos = 0; (pos = out.find("event: ", pos)) != std::string::npos;) {
    const size_t nl = out.find('\n', pos), d = out.find("data: ", nl), end = out.find("\n\n", d);
    const std::string raw = out.substr(d + 6, end - d - 6);
    data.push_back(json::parse(raw));
    EXPECT_EQ(out.substr(pos + 7, nl - pos - 7), data.back()["type"]);
    EXPECT_EQ(raw, data.back().dump());  // dump()'s text, also for the per-token events
    pos = end;
  }
  // Replay: message_start's message, blocks from their start, deltas and stop, then the delta.
  EXPECT_EQ(data.front()["type"], "message_start");
  json m = data.front()["message"];
  std::vector<std::string> partial;
  for (const json& e : data) {
    if (e["type"] == "content_block_start") {
      EXPECT_EQ(e["index"], m["content"].size());
      m["content"].push_back(e["content_block"]);
      partial.emplace_back();
    } else if (e["type"] == "content_block_delta") {
      json& b = m["content"].at(e["index"].get<size_t>());
      const json& d = e["delta"];
      if (d["type"] == "text_delta")
        b["text"] = b["text"].get<std::string>() + d["text"].get<std::string>();
      if (d["type"] == "thinking_delta")
        b["thinking"] = b["thinking"].get<std::string>() + d["thinking"].get<std::string>();
      if (d["type"] == "input_json_delta")
        partial.at(e["index"].get<size_t>()) += d["partial_json"];
    } else if (e["type"] == "content_block_stop") {
      json& b = m["content"].at(e["index"].get<size_t>());
      if (b["type"] == "tool_use") b["input"] = json::parse(partial.at(e["index"].get<size_t>()));
    } else if (e["type"] == "message_delta") {
      m["stop_reason"] = e["delta"]["stop_reason"];
      m["stop_sequence"] = e["delta"]["stop_sequence"];
      m["usage"] = e["usage"];
    }
  }
  EXPECT_EQ(data.back()["type"], "message_stop");
  EXPECT_EQ(m, w.message());
  if (events) *events = data;
  return w.message();
}

TEST(ServerMessageBuilder, ThinkingThenTextAsBlocksAndEvents) {
  std::vector<ChoiceEvent> ev = {event("", "Hmm \"x\"\n"), event("", "ok."), event("Hi", ""),
                                 event("", ""), event(" there\\", "")};
  ev.back().finish_reason = "stop";
  ev.back().prompt_tokens = 10;
  ev.back().cached_tokens = 4;
  ev.back().completion_tokens = 5;
  const json m = build(request(false), ev);
  ASSERT_EQ(m["content"].size(), 2u);
  EXPECT_EQ(m["content"][0],
            json({{"type", "thinking"}, {"thinking", "Hmm \"x\"\nok."}, {"signature", ""}}));
  EXPECT_EQ(m["content"][1], json({{"type", "text"}, {"text", "Hi there\\"}}));
  EXPECT_EQ(m["stop_reason"], "end_turn");
  EXPECT_TRUE(m["stop_sequence"].is_null());
  EXPECT_EQ(m["usage"]["input_tokens"], 6);
  EXPECT_EQ(m["usage"]["cache_read_input_tokens"], 4);
  EXPECT_EQ(m["usage"]["output_tokens"], 5);
  // A stop string and a length cut.
  std::vector<ChoiceEvent> s = {event("a", "")};
  s[0].finish_reason = "stop";
  s[0].stop_string = "##";
  const json ms = build(request(false), s);
  EXPECT_EQ(ms["stop_reason"], "stop_sequence");
  EXPECT_EQ(ms["stop_sequence"], "##");
  s[0].finish_reason = "length";
  s[0].stop_string.clear();
  EXPECT_EQ(build(request(false), s)["stop_reason"], "max_tokens");
}

TEST(ServerMessageBuilder, KimiToolCallsBecomeToolUseBlocks) {
  const std::string markup =
      "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
      "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_call_begin|>"
      "functions.time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
  std::vector<ChoiceEvent> ev;
  for (size_t i = 0; i < markup.size(); i += 7) ev.push_back(event(markup.substr(i, 7), ""));
  ev.back().finish_reason = "stop";
  std::vector<json> events;
  const json m = build(request(true), ev, &events);
  ASSERT_EQ(m["content"].size(), 3u) << m.dump();
  EXPECT_EQ(m["content"][0]["text"], "Let me check.");
  EXPECT_EQ(m["content"][1], json({{"type", "tool_use"},
                                   {"id", "functions.get_weather:0"},
                                   {"name", "get_weather"},
                                   {"input", {{"city", "Paris"}}}}));
  EXPECT_EQ(m["content"][2]["input"], json::object());
  EXPECT_EQ(m["stop_reason"], "tool_use");
  int json_deltas = 0;
  for (const json& e : events)
    json_deltas += e["type"] == "content_block_delta" && e["delta"]["type"] == "input_json_delta";
  EXPECT_GT(json_deltas, 2);  // the arguments streamed in pieces
}

TEST(ServerMessageBuilder, ArgumentsThatAreNotAnObjectAreKept) {
  const std::string markup =
      "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
      "[1, 2<|tool_call_end|><|tool_calls_section_end|>";
  std::vector<ChoiceEvent> ev = {event(markup, "")};
  ev[0].finish_reason = "stop";
  const server::ResponseMeta meta{"msg_1", 0, "tiny"};
  server::MessageBuilder b(request(true), meta, false);
  b.add(ev[0]);
  b.finish();
  const json m = b.message();
  ASSERT_EQ(m["content"].size(), 1u) << m.dump();
  EXPECT_EQ(m["content"][0]["input"], json({{"arguments", "[1, 2"}}));
}

TEST(ServerMessageBuilder, AnEngineErrorIsAnErrorEvent) {
  const server::ResponseMeta meta{"msg_1", 0, "tiny"};
  server::MessageBuilder b(request(false), meta, true);
  b.open();
  ChoiceEvent e;
  e.error = "the step failed";
  b.add(e);
  b.finish();
  const std::string out = b.take_events();
  EXPECT_THAT(out, HasSubstr("event: error\ndata: {\"error\":{\"message\":\"the step failed\","
                             "\"type\":\"api_error\"},\"type\":\"error\"}"));
  EXPECT_EQ(out.find("message_stop"), std::string::npos);
}

TEST_F(ServerAnthropic, MutationsNeverCrash) {
  const std::vector<std::string> seeds = {
      R"({"model":"tiny","max_tokens":5,"system":"s","messages":[{"role":"user","content":"hello"}],"stop_sequences":["\n"],"temperature":0.5})",
      R"({"max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":"x"}]},{"role":"assistant","content":[{"type":"thinking","thinking":"t","signature":""},{"type":"tool_use","id":"a","name":"f","input":{"q":1}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"r","is_error":true}]}],"tools":[{"name":"f","input_schema":{"type":"object"}}],"tool_choice":{"type":"auto"}})",
      R"({"max_tokens":5,"messages":[{"role":"user","content":"j"}],"output_config":{"effort":"low","format":{"type":"json_schema","schema":{"type":"object","properties":{"a":{"type":"integer"}}}}},"thinking":{"type":"enabled","budget_tokens":2048}})",
      R"({"max_tokens":5,"messages":[{"role":"user","content":"t"}],"tools":[{"name":"f","input_schema":{"type":"object","properties":{"q":{"type":"string"}}}}],"tool_choice":{"type":"tool","name":"f"},"stream":true})",
  };
  const std::vector<std::string> fragments = {"\"user\"", "\"assistant\"",
                                              "\"type\"", "\"tool_use\"",
                                              "\"text\"", "\"max_tokens\":99999999"};
  const server::ParseContext c = ctx();
  std::mt19937_64 rng(20261206);
  int parsed = 0, rejected = 0;
  const int kCases = 100000;
  for (int i = 0; i < kCases; ++i) {
    const std::string b = test::mutated_body(seeds, fragments, rng);
    try {
      const MessagesRequest r = server::parse_messages_request(b, c);
      ++parsed;
      ASSERT_EQ(r.chat.prompts.size(), 1u) << b;
      ASSERT_LE(int64_t(r.chat.prompts[0].size()) + r.chat.sampling.max_tokens, c.max_model_len);
    } catch (const ApiError& e) {
      ++rejected;
      ASSERT_TRUE(e.status == 400 || e.status == 404) << e.status << " " << b;
      (void)server::anthropic_error(e).dump(-1, ' ', false, json::error_handler_t::replace);
    }
  }
  EXPECT_GT(parsed, kCases / 50);
  EXPECT_GT(rejected, kCases / 10);
}

// ---- through HTTP -------------------------------------------------------------------------------

TEST(ServerHttpAnthropic, TheChatAnswerWholeStreamedAndCounted) {
  TestServer s(2, "sekrit");
  httplib::Headers key = {{"x-api-key", "sekrit"}, {"anthropic-version", "2023-06-01"}};
  auto c = s.client();
  const json body = {
      {"model", "tiny"},      {"max_tokens", 10},
      {"system", "be brief"}, {"messages", {{{"role", "user"}, {"content", "tell me a story"}}}},
      {"temperature", 0},     {"ignore_eos", true}};
  auto r = c.Post("/v1/messages", key, body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json whole = json::parse(r->body);
  EXPECT_EQ(whole["type"], "message");
  EXPECT_EQ(whole["stop_reason"], "max_tokens");
  EXPECT_EQ(whole["usage"]["output_tokens"], 10);
  httplib::Headers bearer = {{"Authorization", "Bearer sekrit"}};
  auto cr = c.Post("/v1/chat/completions", bearer,
                   json({{"messages",
                          {{{"role", "system"}, {"content", "be brief"}},
                           {{"role", "user"}, {"content", "tell me a story"}}}},
                         {"max_tokens", 10},
                         {"temperature", 0},
                         {"ignore_eos", true}})
                       .dump(),
                   "application/json");
  ASSERT_TRUE(cr);
  const json chat = json::parse(cr->body);
  EXPECT_EQ(whole["content"][0]["text"], chat["choices"][0]["message"]["content"]);
  json sbody = body;
  sbody["stream"] = true;
  auto st = c.Post("/v1/messages", key, sbody.dump(), "application/json");
  ASSERT_TRUE(st);
  std::string text;
  for (size_t pos = 0; (pos = st->body.find("data: ", pos)) != std::string::npos; ++pos) {
    const json e = json::parse(st->body.substr(pos + 6, st->body.find("\n\n", pos) - pos - 6));
    if (e["type"] == "content_block_delta") text += e["delta"]["text"].get<std::string>();
  }
  EXPECT_EQ(text, whole["content"][0]["text"]);
  EXPECT_THAT(st->body, HasSubstr("event: message_stop"));
  auto n = c.Post("/v1/messages/count_tokens", key, body.dump(), "application/json");
  ASSERT_TRUE(n);
  EXPECT_EQ(json::parse(n->body)["input_tokens"],
            whole["usage"]["input_tokens"].get<int>() +
                whole["usage"]["cache_read_input_tokens"].get<int>());
  // Errors in Anthropic's shape: a bad field, a wrong key (the connection closed), no route.
  auto bad = c.Post("/v1/messages", key, R"({"messages":[]})", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(json::parse(bad->body)["error"]["type"], "invalid_request_error");
  httplib::Headers wrong = {{"x-api-key", "nope"}};
  auto unauth = c.Post("/v1/messages", wrong, body.dump(), "application/json");
  ASSERT_TRUE(unauth);
  EXPECT_EQ(unauth->status, 401);
  EXPECT_EQ(json::parse(unauth->body)["error"]["type"], "authentication_error");
  EXPECT_EQ(unauth->get_header_value("Connection"), "close");
  auto after = c.Post("/v1/messages", key, body.dump(), "application/json");
  ASSERT_TRUE(after);  // the client reconnects; the server keeps serving
  EXPECT_EQ(after->status, 200);
  auto none = c.Get("/v1/messages/nothing", key);
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 404);
  EXPECT_EQ(json::parse(none->body)["type"], "error");
}

TEST(ServerHttpAnthropic, KimiMarkupComesBackAsToolUse) {
  const std::string markup =
      "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
      "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
      "<|tool_calls_section_end|>";
  TestServer s(2, "", 1 << 20, markup + "<|im_end|>");
  const json body = {{"max_tokens", 200},
                     {"messages", {{{"role", "user"}, {"content", "weather?"}}}},
                     {"tools", {{{"name", "get_weather"}, {"input_schema", {{"type", "object"}}}}}},
                     {"temperature", 0}};
  const json m = post_json(s, "/v1/messages", body);
  ASSERT_EQ(m["content"].size(), 1u) << m.dump();
  EXPECT_EQ(m["content"][0]["type"], "tool_use");
  EXPECT_EQ(m["content"][0]["input"], json({{"city", "Paris"}}));
  EXPECT_EQ(m["stop_reason"], "tool_use");
}

}  // namespace
}  // namespace md
