// /v1/responses through HTTP on a free loopback port: the answer is the chat endpoint's for the
// same conversation, streamed events add up to the whole response, stored responses come back
// by id and continue with previous_response_id, tool calls come back as function_call items.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/http_test_server.h"

namespace md {
namespace {

using nlohmann::json;
using test::post_json;
using test::TestServer;
using ::testing::HasSubstr;

struct Event {
  std::string type;
  json data;
};

std::vector<Event> events_of(const std::string& body) {
  std::vector<Event> out;
  size_t pos = 0;
  while ((pos = body.find("event: ", pos)) != std::string::npos) {
    const size_t nl = body.find('\n', pos);
    const size_t data = body.find("data: ", nl);
    const size_t end = body.find("\n\n", data);
    out.push_back(
        {body.substr(pos + 7, nl - pos - 7), json::parse(body.substr(data + 6, end - data - 6))});
    pos = end;
  }
  return out;
}

json get_json(const TestServer& s, const std::string& path, int want = 200) {
  auto c = s.client();
  auto r = c.Get(path.c_str());
  EXPECT_TRUE(r) << path;
  if (!r) return {};
  EXPECT_EQ(r->status, want) << r->body;
  return json::parse(r->body);
}

std::string output_text(const json& response) {
  std::string t;
  for (const json& it : response["output"])
    if (it["type"] == "message")
      for (const json& p : it["content"]) t += p["text"].get<std::string>();
  return t;
}

class ServerHttpResponses : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = new TestServer(4); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static TestServer* server_;
};
TestServer* ServerHttpResponses::server_ = nullptr;

TEST_F(ServerHttpResponses, TheChatAnswerWholeStreamedAndStored) {
  const json body = {{"input", "tell me a story"}, {"instructions", "You are terse."},
                     {"max_output_tokens", 12},    {"temperature", 0},
                     {"ignore_eos", true},         {"include", {"message.output_text.logprobs"}},
                     {"metadata", {{"run", "1"}}}};
  const json whole = post_json(*server_, "/v1/responses", body);
  EXPECT_EQ(whole["object"], "response");
  EXPECT_THAT(whole["id"].get<std::string>(), ::testing::StartsWith("resp_"));
  EXPECT_EQ(whole["status"], "incomplete");
  EXPECT_EQ(whole["incomplete_details"]["reason"], "max_output_tokens");
  EXPECT_EQ(whole["usage"]["output_tokens"], 12);
  EXPECT_EQ(whole["metadata"]["run"], "1");
  EXPECT_EQ(whole["instructions"], "You are terse.");
  ASSERT_EQ(whole["output"].size(), 1u);
  EXPECT_EQ(whole["output"][0]["role"], "assistant");
  EXPECT_EQ(whole["output"][0]["content"][0]["type"], "output_text");
  EXPECT_LE(whole["output"][0]["content"][0]["logprobs"].size(), 12u);
  EXPECT_GE(whole["output"][0]["content"][0]["logprobs"].size(), 1u);
  // The chat endpoint's answer to the same conversation, token for token.
  const json chat = post_json(*server_, "/v1/chat/completions",
                              {{"messages",
                                {{{"role", "system"}, {"content", "You are terse."}},
                                 {{"role", "user"}, {"content", "tell me a story"}}}},
                               {"max_tokens", 12},
                               {"temperature", 0},
                               {"ignore_eos", true}});
  EXPECT_EQ(output_text(whole), chat["choices"][0]["message"]["content"]);
  EXPECT_EQ(whole["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);

  // Streamed: typed events, numbered, adding up to the same response.
  json sbody = body;
  sbody["stream"] = true;
  auto c = server_->client();
  auto r = c.Post("/v1/responses", sbody.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_THAT(r->get_header_value("Content-Type"), HasSubstr("text/event-stream"));
  EXPECT_EQ(r->body.find("[DONE]"), std::string::npos);
  const std::vector<Event> ev = events_of(r->body);
  ASSERT_GE(ev.size(), 8u);
  EXPECT_EQ(ev[0].type, "response.created");
  EXPECT_EQ(ev[1].type, "response.in_progress");
  EXPECT_EQ(ev.back().type, "response.incomplete");
  std::string deltas;
  for (size_t i = 0; i < ev.size(); ++i) {
    EXPECT_EQ(ev[i].data["sequence_number"], i);
    if (ev[i].type == "response.output_text.delta")
      deltas += ev[i].data["delta"].get<std::string>();
  }
  const json& final = ev.back().data["response"];
  EXPECT_EQ(deltas, output_text(whole));
  EXPECT_EQ(output_text(final), output_text(whole));
  EXPECT_EQ(final["usage"]["output_tokens"], 12);

  // Stored: fetched by id as returned, its input items listed, deleted.
  const std::string id = whole["id"];
  EXPECT_EQ(get_json(*server_, "/v1/responses/" + id), whole);
  EXPECT_EQ(get_json(*server_, "/v1/responses/" + final["id"].get<std::string>()), final);
  const json items = get_json(*server_, "/v1/responses/" + id + "/input_items");
  EXPECT_EQ(items["object"], "list");
  ASSERT_EQ(items["data"].size(), 1u);
  EXPECT_EQ(items["data"][0]["content"][0]["text"], "tell me a story");
  auto d = c.Delete(("/v1/responses/" + id).c_str());
  ASSERT_TRUE(d);
  EXPECT_EQ(d->status, 200);
  EXPECT_EQ(json::parse(d->body)["deleted"], true);
  EXPECT_EQ(get_json(*server_, "/v1/responses/" + id, 404)["error"]["code"], "response_not_found");
  // store: false keeps nothing.
  json nostore = body;
  nostore["store"] = false;
  const json n = post_json(*server_, "/v1/responses", nostore);
  get_json(*server_, "/v1/responses/" + n["id"].get<std::string>(), 404);
}

TEST_F(ServerHttpResponses, PreviousResponseIdGoesOnFromItsConversation) {
  const json first = post_json(*server_, "/v1/responses",
                               {{"input", "hi there, who are you"},
                                {"max_output_tokens", 6},
                                {"temperature", 0},
                                {"ignore_eos", true}});
  const json next = post_json(*server_, "/v1/responses",
                              {{"previous_response_id", first["id"]},
                               {"input", "and then?"},
                               {"max_output_tokens", 6},
                               {"temperature", 0},
                               {"ignore_eos", true}});
  EXPECT_EQ(next["previous_response_id"], first["id"]);
  const json chat = post_json(*server_, "/v1/chat/completions",
                              {{"messages",
                                {{{"role", "user"}, {"content", "hi there, who are you"}},
                                 {{"role", "assistant"}, {"content", output_text(first)}},
                                 {{"role", "user"}, {"content", "and then?"}}}},
                               {"max_tokens", 6},
                               {"temperature", 0},
                               {"ignore_eos", true}});
  EXPECT_EQ(output_text(next), chat["choices"][0]["message"]["content"]);
  EXPECT_EQ(next["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
  // The first turn's state came from the prefix cache.
  EXPECT_GT(next["usage"]["input_tokens_details"]["cached_tokens"].get<int>(), 0);
  // Unknown ids are 404s naming the field; bad bodies 400s naming theirs.
  const json e = post_json(*server_, "/v1/responses",
                           {{"previous_response_id", "resp_nope"}, {"input", "x"}}, 404);
  EXPECT_EQ(e["error"]["param"], "previous_response_id");
  EXPECT_EQ(
      post_json(*server_, "/v1/responses", {{"input", "x"}, {"tools", {{{"type", "file_search"}}}}},
                400)["error"]["param"],
      "tools.0.type");
  EXPECT_EQ(post_json(*server_, "/v1/responses", {{"input", "x"}, {"max_output_tokens", -1}},
                      400)["error"]["param"],
            "max_output_tokens");
  get_json(*server_, "/v1/responses/resp_nope/input_items", 404);
  EXPECT_EQ(
      get_json(*server_, "/v1/responses/" + first["id"].get<std::string>() + "/input_items?limit=0",
               400)["error"]["param"],
      "limit");
}

TEST(ServerHttpResponsesTools, KimiMarkupComesBackAsFunctionCallItems) {
  const std::string markup =
      "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
      "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
      "<|tool_calls_section_end|>";
  TestServer s(2, "", 1 << 20, markup + "<|im_end|>");
  json body = {
      {"input", "weather?"},
      {"tools",
       {{{"type", "function"}, {"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}},
      {"max_output_tokens", 200},
      {"temperature", 0}};
  const json whole = post_json(s, "/v1/responses", body);
  EXPECT_EQ(whole["status"], "completed");
  ASSERT_EQ(whole["output"].size(), 2u) << whole.dump();
  EXPECT_EQ(output_text(whole), "Let me check.");
  const json& call = whole["output"][1];
  EXPECT_EQ(call["type"], "function_call");
  EXPECT_EQ(call["call_id"], "functions.get_weather:0");
  EXPECT_EQ(call["name"], "get_weather");
  EXPECT_EQ(call["arguments"], "{\"city\": \"Paris\"}");
  EXPECT_EQ(whole["tools"][0]["name"], "get_weather");

  body["stream"] = true;
  auto c = s.client();
  auto r = c.Post("/v1/responses", body.dump(), "application/json");
  ASSERT_TRUE(r);
  std::string arguments;
  int pieces = 0;
  for (const Event& e : events_of(r->body)) {
    if (e.type == "response.function_call_arguments.delta") {
      arguments += e.data["delta"].get<std::string>();
      ++pieces;
    }
    if (e.type == "response.function_call_arguments.done") {
      EXPECT_EQ(e.data["arguments"], arguments);
    }
  }
  EXPECT_EQ(arguments, "{\"city\": \"Paris\"}");
  EXPECT_GT(pieces, 1);  // streamed as they came

  // The call's output goes back as an input item, continuing the stored conversation.
  const json next = post_json(
      s, "/v1/responses",
      {{"previous_response_id", whole["id"]},
       {"input",
        {{{"type", "function_call_output"}, {"call_id", call["call_id"]}, {"output", "12 C"}}}},
       {"tools", body["tools"]},
       {"max_output_tokens", 4},
       {"temperature", 0}});
  EXPECT_GT(next["usage"]["input_tokens"].get<int>(), whole["usage"]["input_tokens"].get<int>());
}

}  // namespace
}  // namespace md
