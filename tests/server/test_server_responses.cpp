// The Responses API without HTTP: requests become the chat request of the same conversation
// (the same prompt tokens as /v1/chat/completions renders), bad ones a 4xx naming the Responses
// field; the output builder's items and streamed events agree; the store keeps and evicts; a
// mutation run over the parser finds no crash and no other exception.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "megadecode/server/responses_api.h"
#include "server/server_test_util.h"

namespace md {
namespace {

using test::error_of;

using nlohmann::json;
using server::ApiError;
using server::ChoiceEvent;
using server::ResponsesRequest;
using ::testing::HasSubstr;

class ServerResponses : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { served_ = new test::ServedModel(1); }
  static void TearDownTestSuite() {
    delete served_;
    served_ = nullptr;
  }
  static server::ParseContext ctx() { return served_->context(1024); }
  static ResponsesRequest responses(const json& body, server::ResponseStore* store = nullptr) {
    return server::parse_responses_request(body.dump(), ctx(), store);
  }
  static server::CompletionRequest chat(const json& body) {
    return server::parse_chat_request(body.dump(), ctx());
  }
  static test::ServedModel* served_;
};
test::ServedModel* ServerResponses::served_ = nullptr;

// Every input item kind, the instructions and the tools render as the chat messages and tools
// of the same meaning do.
TEST_F(ServerResponses, InputItemsRenderAsTheChatOfTheSameConversation) {
  const json r = json::parse(R"({
    "model": "tiny", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0,
    "input": [
      {"role": "user", "content": "weather in Paris?"},
      {"type": "reasoning", "id": "rs_1", "summary": [],
       "content": [{"type": "reasoning_text", "text": "I should call the tool."}]},
      {"type": "message", "role": "assistant",
       "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
      {"type": "function_call", "call_id": "functions.get_weather:0", "name": "get_weather",
       "arguments": "{\"city\": \"Paris\"}"},
      {"type": "function_call_output", "call_id": "functions.get_weather:0", "output": "12 C"},
      {"role": "developer", "content": [{"type": "input_text", "text": "Use Celsius."},
                                        {"type": "input_text", "text": "Be kind."}]}
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "w",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
               "strict": true}]})");
  const json c = json::parse(R"({
    "model": "tiny", "max_tokens": 9, "temperature": 0,
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "weather in Paris?"},
      {"role": "assistant", "content": "Checking.", "reasoning_content": "I should call the tool.",
       "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "12 C"},
      {"role": "system", "content": "Use Celsius.\nBe kind."}
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "w",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})");
  const ResponsesRequest rr = responses(r);
  const server::CompletionRequest cr = chat(c);
  ASSERT_EQ(rr.chat.prompts.size(), 1u);
  EXPECT_EQ(rr.chat.prompts, cr.prompts);
  EXPECT_EQ(rr.chat.sampling.max_tokens, 9);
  EXPECT_EQ(rr.chat.sampling.temperature, 0.0f);
  EXPECT_TRUE(rr.chat.tools_given);
  EXPECT_EQ(rr.chat.kind, server::RequestKind::kChat);
  EXPECT_FALSE(rr.chat.constraint);  // tool_choice auto
  // The conversation kept for a later turn has no instructions; the items have ids.
  ASSERT_EQ(rr.conversation.size(), 4u);
  EXPECT_EQ(rr.conversation[0].role, "user");
  EXPECT_EQ(rr.conversation[1].reasoning, "I should call the tool.");
  ASSERT_EQ(rr.conversation[1].tool_calls.size(), 1u);
  EXPECT_EQ(rr.conversation[2].tool_call_id, "functions.get_weather:0");
  ASSERT_EQ(rr.input_items.size(), 6u);
  for (const json& it : rr.input_items) EXPECT_TRUE(it["id"].is_string()) << it.dump();
  EXPECT_EQ(rr.input_items[1]["id"], "rs_1");  // kept when given
  // What the response repeats.
  EXPECT_EQ(rr.echo["instructions"], "Be brief.");
  EXPECT_EQ(rr.echo["max_output_tokens"], 9);
  EXPECT_EQ(rr.echo["tools"][0]["name"], "get_weather");
  EXPECT_EQ(rr.echo["tools"][0]["strict"], true);
  EXPECT_EQ(rr.echo["tool_choice"], "auto");
  EXPECT_TRUE(rr.store);
  // A string input is one user message.
  EXPECT_EQ(responses({{"input", "hello"}}).chat.prompts,
            chat({{"messages", {{{"role", "user"}, {"content", "hello"}}}}}).prompts);
}

TEST_F(ServerResponses, FormatsToolChoiceAndReasoningBecomeTheChatFields) {
  const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}};
  const ResponsesRequest js = responses(
      {{"input", "x"},
       {"text", {{"format", {{"type", "json_schema"}, {"name", "s"}, {"schema", schema}}}}}});
  EXPECT_TRUE(js.chat.constraint);
  EXPECT_EQ(js.echo["text"]["format"]["name"], "s");
  EXPECT_TRUE(responses({{"input", "x"}, {"text", {{"format", {{"type", "json_object"}}}}}})
                  .chat.constraint);
  const json tools = json::array({{{"type", "function"}, {"name", "f"}}});
  const ResponsesRequest named = responses(
      {{"input", "x"}, {"tools", tools}, {"tool_choice", {{"type", "function"}, {"name", "f"}}}});
  EXPECT_TRUE(named.chat.constraint);
  EXPECT_EQ(named.echo["tool_choice"], json({{"type", "function"}, {"name", "f"}}));
  // The same prompt and a constraint as the chat request's named tool_choice.
  const server::CompletionRequest cn =
      chat({{"messages", {{{"role", "user"}, {"content", "x"}}}},
            {"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}},
            {"tool_choice", {{"type", "function"}, {"function", {{"name", "f"}}}}}});
  EXPECT_EQ(named.chat.prompts, cn.prompts);
  EXPECT_TRUE(
      responses({{"input", "x"}, {"tools", tools}, {"tool_choice", "required"}}).chat.constraint);
  // parallel_tool_calls false: one call.
  const json weather = json::array({{{"type", "function"}, {"name", "get_weather"}}});
  for (const bool parallel : {true, false})
    EXPECT_EQ(test::allows_second_call(*served_, responses({{"input", "x"},
                                                            {"tools", weather},
                                                            {"tool_choice", "required"},
                                                            {"parallel_tool_calls", parallel}})
                                                     .chat.constraint),
              parallel);
  // Logprobs: asked by include or top_logprobs.
  const ResponsesRequest lp =
      responses({{"input", "x"}, {"include", {"message.output_text.logprobs"}}});
  EXPECT_TRUE(lp.chat.logprobs);
  EXPECT_EQ(lp.chat.top_logprobs, 0);
  EXPECT_TRUE(responses({{"input", "x"}, {"top_logprobs", 3}}).chat.logprobs);
  EXPECT_FALSE(responses({{"input", "x"}}).chat.logprobs);
  EXPECT_EQ(responses({{"input", "x"}, {"reasoning", {{"effort", "low"}}}}).echo["reasoning"],
            json({{"effort", "low"}, {"summary", nullptr}}));
  EXPECT_FALSE(responses({{"input", "x"}, {"store", false}}).store);
}

TEST_F(ServerResponses, PreviousResponseIdContinuesItsConversation) {
  server::ResponseStore store(4);
  auto prev = std::make_shared<server::StoredResponse>();
  prev->conversation = {{"user", "a", "", "", {}, ""}, {"assistant", "b", "", "", {}, ""}};
  store.put("resp_prev", prev);
  const ResponsesRequest r = responses(
      {{"previous_response_id", "resp_prev"}, {"input", "c"}, {"instructions", "sys"}}, &store);
  const server::CompletionRequest c = chat({{"messages",
                                             {{{"role", "system"}, {"content", "sys"}},
                                              {{"role", "user"}, {"content", "a"}},
                                              {{"role", "assistant"}, {"content", "b"}},
                                              {{"role", "user"}, {"content", "c"}}}}});
  EXPECT_EQ(r.chat.prompts, c.prompts);
  ASSERT_EQ(r.conversation.size(), 3u);  // no instructions
  EXPECT_EQ(r.echo["previous_response_id"], "resp_prev");
  const ApiError e = error_of([&] {
    responses({{"previous_response_id", "resp_x"}, {"input", "c"}}, &store);
  });
  EXPECT_EQ(e.status, 404);
  EXPECT_EQ(e.param, "previous_response_id");
  EXPECT_EQ(error_of([&] {
              responses({{"previous_response_id", "resp_prev"}, {"input", "c"}});
            }).status,
            404);  // no store
}

TEST_F(ServerResponses, BadRequestsNameTheResponsesField) {
  struct Case {
    json body;
    int status;
    std::string param;
  };
  const json tool = {{"type", "function"}, {"name", "f"}};
  std::string long_text;
  for (int i = 0; i < 1500; ++i) long_text += "word" + std::to_string(i) + " ";
  const std::vector<Case> cases = {
      {json::object(), 400, "input"},
      {{{"input", 3}}, 400, "input"},
      {{{"input", json::array()}}, 400, "input"},
      {{{"input", {{{"role", "robot"}, {"content", "x"}}}}}, 400, "input.0.role"},
      {{{"input", {{{"role", "user"}}}}}, 400, "input.0.content"},
      {{{"input", {{{"role", "user"}, {"content", {{{"type", "input_image"}}}}}}}},
       400,
       "input.0.content.0.type"},
      {{{"input", {"x", {{"type", "web_search_call"}}}}}, 400, "input.0"},
      {{{"input", {{{"type", "web_search_call"}}}}}, 400, "input.0.type"},
      {{{"input", {{{"type", "function_call"}, {"name", "f"}, {"arguments", "{}"}}}}},
       400,
       "input.0.call_id"},
      {{{"input", {{{"type", "function_call_output"}, {"call_id", "c"}}}}}, 400, "input.0.output"},
      {{{"input", "x"}, {"max_output_tokens", 0}}, 400, "max_output_tokens"},
      {{{"input", "x"}, {"max_output_tokens", 100000}}, 400, "max_output_tokens"},
      {{{"input", "x"}, {"temperature", 3}}, 400, "temperature"},
      {{{"input", "x"}, {"top_logprobs", 21}}, 400, "top_logprobs"},
      {{{"input", "x"}, {"tools", {{{"type", "web_search"}}}}}, 400, "tools.0.type"},
      {{{"input", "x"}, {"tools", {{{"type", "function"}}}}}, 400, "tools.0.name"},
      {{{"input", "x"}, {"tools", {tool}}, {"tool_choice", {{"type", "function"}, {"name", "g"}}}},
       400,
       "tool_choice.name"},
      {{{"input", "x"}, {"tool_choice", "required"}}, 400, "tool_choice"},
      {{{"input", "x"}, {"tool_choice", "sometimes"}}, 400, "tool_choice"},
      {{{"input", "x"}, {"text", {{"format", {{"type", "json_schema"}, {"name", "s"}}}}}},
       400,
       "text.format.schema"},
      {{{"input", "x"}, {"text", {{"format", {{"type", "yaml"}}}}}}, 400, "text.format.type"},
      {{{"input", "x"},
        {"text",
         {{"format",
           {{"type", "json_schema"}, {"name", "s"}, {"schema", json::parse(R"({"enum":[]})")}}}}}},
       400,
       "text.format.schema"},
      {{{"input", "x"}, {"reasoning", {{"effort", "huge"}}}}, 400, "reasoning.effort"},
      {{{"input", "x"}, {"background", true}}, 400, "background"},
      {{{"input", "x"}, {"truncation", "auto"}}, 400, "truncation"},
      {{{"input", "x"}, {"conversation", "conv_1"}}, 400, "conversation"},
      {{{"input", "x"}, {"include", "all"}}, 400, "include"},
      {{{"input", "x"}, {"metadata", {{"k", 1}}}}, 400, "metadata.k"},
      {{{"input", "x"}, {"stream_options", json::object()}}, 400, "stream_options"},
      {{{"input", "x"}, {"model", "other"}}, 404, "model"},
      {{{"input", long_text}}, 400, "input"},  // longer than the context
  };
  for (const Case& c : cases) {
    const ApiError e = error_of([&] { responses(c.body); });
    EXPECT_EQ(e.status, c.status) << c.body.dump() << ": " << e.message;
    EXPECT_EQ(e.param, c.param) << c.body.dump() << ": " << e.message;
  }
  // The chat parser's messages are renamed too.
  const ApiError m = error_of([&] { responses({{"input", "x"}, {"max_output_tokens", 100000}}); });
  EXPECT_THAT(m.message, HasSubstr("'max_output_tokens'"));
}

// ---- the output --------------------------------------------------------------------------------

std::shared_ptr<const ResponsesRequest> plain_request(bool logprobs, bool tools) {
  auto r = std::make_shared<ResponsesRequest>();
  r->chat.logprobs = logprobs;
  r->chat.tools_given = tools;
  r->chat.chat_template = TemplateKind::kKimi;
  r->echo = {{"tools", json::array()}, {"tool_choice", "auto"}, {"parallel_tool_calls", true}};
  r->conversation = {{"user", "q", "", "", {}, ""}};
  return r;
}

ChoiceEvent event(std::string text, std::string reasoning, std::vector<int32_t> tokens) {
  ChoiceEvent e;
  e.text = std::move(text);
  e.reasoning = std::move(reasoning);
  e.tokens = std::move(tokens);
  return e;
}

struct Sse {
  std::string type;
  json data;
};
std::vector<Sse> parse_events(const std::string& s) {
  std::vector<Sse> out;
  size_t pos = 0;
  while ((pos = s.find("event: ", pos)) != std::string::npos) {
    const size_t nl = s.find('\n', pos);
    const size_t data = s.find("data: ", nl);
    const size_t end = s.find("\n\n", data);
    const std::string raw = s.substr(data + 6, end - data - 6);
    out.push_back({s.substr(pos + 7, nl - pos - 7), json::parse(raw)});
    // Written as dump() writes it (the per-token events are written without a JSON tree).
    EXPECT_EQ(raw, out.back().data.dump());
    pos = end;
  }
  return out;
}

// Drops the random ids so that two builds of one output compare equal.
json without_ids(json j) {
  if (j.is_object()) {
    j.erase("id");
    j.erase("item_id");
    for (auto& [k, v] : j.items()) v = without_ids(v);
  } else if (j.is_array()) {
    for (auto& v : j) v = without_ids(v);
  }
  return j;
}

// Feeds the same events to a streamed and a whole builder: the events are in order, numbered,
// each item opened, filled and closed, and the deltas add up to the whole response's output.
json build_both(std::shared_ptr<const ResponsesRequest> req, std::vector<ChoiceEvent> events,
                std::vector<Sse>* streamed, std::shared_ptr<const server::StoredResponse>* kept) {
  const server::ResponseMeta meta{"resp_00ff", 1796432931, "tiny"};
  static const test::ServedModel* served = new test::ServedModel(1);  // kept for the process
  const Tokenizer& tok = *served->tok;
  server::ResponseBuilder s(req, meta, tok, true), w(req, meta, tok, false);
  std::string text = s.open();
  EXPECT_TRUE(w.open().empty());
  for (ChoiceEvent e : events) {
    ChoiceEvent e2 = e;
    s.add(e);
    w.add(e2);
    text += s.take_events();
  }
  s.finish();
  w.finish();
  text += s.take_events();
  EXPECT_TRUE(w.take_events().empty());
  *streamed = parse_events(text);
  EXPECT_EQ(without_ids(s.response()), without_ids(w.response()));
  if (kept) *kept = w.stored();
  // Replays the events into items.
  json items = json::array();
  for (size_t i = 0; i < streamed->size(); ++i) {
    const Sse& e = (*streamed)[i];
    EXPECT_EQ(e.data["sequence_number"], i);
    EXPECT_EQ(e.data["type"], e.type);
    if (e.type == "response.output_item.added") {
      EXPECT_EQ(e.data["output_index"], items.size());
      items.push_back(e.data["item"]);
    } else if (e.type == "response.output_text.delta" ||
               e.type == "response.reasoning_text.delta") {
      json& it = items.at(e.data["output_index"].get<size_t>());
      if (it["content"].empty())
        it["content"] = json::array(
            {{{"type", e.type == "response.output_text.delta" ? "output_text" : "reasoning_text"},
              {"text", ""}}});
      it["content"][0]["text"] =
          it["content"][0]["text"].get<std::string>() + e.data["delta"].get<std::string>();
    } else if (e.type == "response.function_call_arguments.delta") {
      json& it = items.at(e.data["output_index"].get<size_t>());
      it["arguments"] = it["arguments"].get<std::string>() + e.data["delta"].get<std::string>();
    } else if (e.type == "response.output_item.done") {
      const json& done = e.data["item"];
      const json& it = items.at(e.data["output_index"].get<size_t>());
      if (done["type"] == "function_call") {
        EXPECT_EQ(it["arguments"], done["arguments"]);
      } else {
        EXPECT_EQ(it["content"][0]["text"], done["content"][0]["text"]);
      }
      items[e.data["output_index"].get<size_t>()] = done;
    }
  }
  EXPECT_EQ(items, s.response()["output"]);
  return s.response();
}

TEST(ServerResponseBuilder, ReasoningThenTextAsItemsAndEvents) {
  std::vector<ChoiceEvent> ev = {event("", "Let me \"", {1}), event("", "think.\\\n", {2}),
                                 event("Hello", "", {3}), event("", "", {4}),
                                 event(" world\x01", "", {5})};
  ev[2].logprobs = {{3, -0.5f, {{3, -0.5f}}}};
  ev[3].logprobs = {{4, -0.25f, {}}};
  ev[4].logprobs = {{5, -1.0f, {}}};
  ev[4].finish_reason = "stop";
  ev[4].prompt_tokens = 7;
  ev[4].completion_tokens = 5;
  std::vector<Sse> streamed;
  std::shared_ptr<const server::StoredResponse> kept;
  const json r = build_both(plain_request(true, false), ev, &streamed, &kept);
  std::vector<std::string> types;
  for (const Sse& e : streamed) types.push_back(e.type);
  EXPECT_EQ(types, (std::vector<std::string>{
                       "response.created", "response.in_progress", "response.output_item.added",
                       "response.content_part.added", "response.reasoning_text.delta",
                       "response.reasoning_text.delta", "response.reasoning_text.done",
                       "response.content_part.done", "response.output_item.done",
                       "response.output_item.added", "response.content_part.added",
                       "response.output_text.delta", "response.output_text.delta",
                       "response.output_text.done", "response.content_part.done",
                       "response.output_item.done", "response.completed"}));
  EXPECT_EQ(r["status"], "completed");
  ASSERT_EQ(r["output"].size(), 2u);
  EXPECT_EQ(r["output"][0]["type"], "reasoning");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Let me \"think.\\\n");
  EXPECT_EQ(r["output"][1]["content"][0]["text"], "Hello world\x01");
  // The held-back token's logprob goes out with the next text.
  EXPECT_EQ(r["output"][1]["content"][0]["logprobs"].size(), 3u);
  EXPECT_EQ(streamed[12].data["logprobs"].size(), 2u);
  EXPECT_EQ(r["usage"]["input_tokens"], 7);
  EXPECT_EQ(r["usage"]["output_tokens"], 5);
  EXPECT_EQ(r["usage"]["total_tokens"], 12);
  EXPECT_EQ(r["usage"]["output_tokens_details"]["reasoning_tokens"], 2);
  ASSERT_EQ(kept->conversation.size(), 2u);
  EXPECT_EQ(kept->conversation[1].role, "assistant");
  EXPECT_EQ(kept->conversation[1].content, "Hello world\x01");
  EXPECT_EQ(kept->conversation[1].reasoning, "Let me \"think.\\\n");
}

TEST(ServerResponseBuilder, PlainTextEventsWithoutLogprobs) {
  std::vector<ChoiceEvent> ev;
  const std::vector<std::string> pieces = {"a",    "\"q\"", "\\",       "\n\t",
                                           "\x01", "</s>",  "\xc3\xa9", "\xe4\xb8\xad"};
  for (const std::string& p : pieces) ev.push_back(event(p, "", {1}));
  ev.back().finish_reason = "stop";
  std::vector<Sse> streamed;
  const json r = build_both(plain_request(false, false), ev, &streamed, nullptr);
  std::string all;
  for (const std::string& p : pieces) all += p;
  EXPECT_EQ(r["output"][0]["content"][0]["text"], all);
  EXPECT_TRUE(r["output"][0]["content"][0]["logprobs"].empty());
  EXPECT_EQ(streamed.size(), 2u + 2u + pieces.size() + 4u);
}

TEST(ServerResponseBuilder, KimiToolCallsBecomeFunctionCallItems) {
  const std::string markup =
      "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
      "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_call_begin|>"
      "functions.time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
  std::vector<ChoiceEvent> ev;
  for (size_t i = 0; i < markup.size(); i += 5) ev.push_back(event(markup.substr(i, 5), "", {1}));
  ev.back().finish_reason = "stop";
  std::vector<Sse> streamed;
  std::shared_ptr<const server::StoredResponse> kept;
  const json r = build_both(plain_request(false, true), ev, &streamed, &kept);
  ASSERT_EQ(r["output"].size(), 3u) << r.dump();
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Let me check.");
  EXPECT_EQ(r["output"][1]["type"], "function_call");
  EXPECT_EQ(r["output"][1]["call_id"], "functions.get_weather:0");
  EXPECT_EQ(r["output"][1]["name"], "get_weather");
  EXPECT_EQ(r["output"][1]["arguments"], "{\"city\": \"Paris\"}");
  EXPECT_EQ(r["output"][1]["status"], "completed");
  EXPECT_EQ(r["output"][2]["name"], "time");
  EXPECT_EQ(r["output"][2]["arguments"], "{}");
  const ChatMessage& m = kept->conversation.back();
  EXPECT_EQ(m.content, "Let me check.");
  ASSERT_EQ(m.tool_calls.size(), 2u);
  EXPECT_EQ(m.tool_calls[0].id, "functions.get_weather:0");
  EXPECT_EQ(m.tool_calls[1].arguments, "{}");
}

TEST(ServerResponseBuilder, CutShortIsIncompleteAndAnErrorFailed) {
  std::vector<ChoiceEvent> ev = {event("abc", "", {1})};
  ev[0].finish_reason = "length";
  std::vector<Sse> streamed;
  const json r = build_both(plain_request(false, false), ev, &streamed, nullptr);
  EXPECT_EQ(r["status"], "incomplete");
  EXPECT_EQ(r["incomplete_details"]["reason"], "max_output_tokens");
  EXPECT_EQ(r["output"][0]["status"], "incomplete");
  EXPECT_EQ(streamed.back().type, "response.incomplete");
  std::vector<ChoiceEvent> bad = {event("", "", {})};
  bad[0].error = "engine failed";
  const json f = build_both(plain_request(false, false), bad, &streamed, nullptr);
  EXPECT_EQ(f["status"], "failed");
  EXPECT_EQ(f["error"]["message"], "engine failed");
  EXPECT_TRUE(f["output"].empty());
  EXPECT_EQ(streamed.back().type, "response.failed");
}

TEST(ServerResponseStore, KeepsTheMostRecentlyUsed) {
  server::ResponseStore s(2);
  auto r = [](int i) {
    auto x = std::make_shared<server::StoredResponse>();
    x->response = i;
    return x;
  };
  s.put("a", r(1));
  s.put("b", r(2));
  ASSERT_TRUE(s.get("a"));  // a is now the most recent
  s.put("c", r(3));
  EXPECT_FALSE(s.get("b"));
  EXPECT_EQ(s.get("a")->response, 1);
  EXPECT_EQ(s.get("c")->response, 3);
  EXPECT_EQ(s.size(), 2u);
  EXPECT_TRUE(s.erase("a"));
  EXPECT_FALSE(s.erase("a"));
  EXPECT_EQ(s.size(), 1u);
  server::ResponseStore none(0);
  none.put("a", r(1));
  EXPECT_FALSE(none.get("a"));
}

TEST(ServerResponseStore, InputItemPages) {
  json items = json::array();
  for (int i = 0; i < 5; ++i) items.push_back({{"id", "i" + std::to_string(i)}});
  const json d = server::input_items_page(items, "", "2", "");
  EXPECT_EQ(d["data"], json::parse(R"([{"id":"i4"},{"id":"i3"}])"));
  EXPECT_EQ(d["first_id"], "i4");
  EXPECT_EQ(d["last_id"], "i3");
  EXPECT_TRUE(d["has_more"]);
  const json a = server::input_items_page(items, "asc", "10", "i2");
  EXPECT_EQ(a["data"], json::parse(R"([{"id":"i3"},{"id":"i4"}])"));
  EXPECT_FALSE(a["has_more"]);
  for (auto [o, l, af] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"up", "", ""}, {"", "0", ""}, {"", "101", ""}, {"", "x", ""}, {"", "", "nope"}})
    EXPECT_EQ(error_of([&] { server::input_items_page(items, o, l, af); }).status, 400);
}

// Random mutations of valid bodies through the parser: a request within the limits or a 4xx
// ApiError, nothing else (deterministic: a fixed seed).
TEST_F(ServerResponses, MutationsNeverCrash) {
  const std::vector<std::string> seeds = {
      R"({"model":"tiny","input":"hello","max_output_tokens":5,"temperature":0.7,"stop":["\n"]})",
      R"({"input":[{"role":"user","content":[{"type":"input_text","text":"x"}]}],"instructions":"s","store":false,"stream":true})",
      R"({"input":[{"role":"user","content":"w"},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":"r"}],"tools":[{"type":"function","name":"f","parameters":{"type":"object"}}],"tool_choice":"auto"})",
      R"({"input":"j","text":{"format":{"type":"json_schema","name":"s","schema":{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}}}})",
      R"({"input":[{"type":"reasoning","id":"rs","summary":[],"content":[{"type":"reasoning_text","text":"t"}]},{"role":"assistant","content":[{"type":"output_text","text":"a"}]}],"reasoning":{"effort":"low"},"include":["message.output_text.logprobs"],"top_logprobs":2})",
      R"({"input":"t","tools":[{"type":"function","name":"f"}],"tool_choice":{"type":"function","name":"f"},"metadata":{"k":"v"},"previous_response_id":"resp_x"})",
  };
  const std::vector<std::string> fragments = {"\"input\"",     "\"role\"",
                                              "\"type\"",      "\"function_call\"",
                                              "\"reasoning\"", "\"max_output_tokens\":99999999"};
  server::ResponseStore store(2);
  auto prev = std::make_shared<server::StoredResponse>();
  prev->conversation = {{"user", "a", "", "", {}, ""}, {"assistant", "b", "", "", {}, ""}};
  store.put("resp_x", prev);
  const server::ParseContext c = ctx();
  std::mt19937_64 rng(20261205);
  int parsed = 0, rejected = 0;
  const int kCases = 100000;
  for (int i = 0; i < kCases; ++i) {
    const std::string b = test::mutated_body(seeds, fragments, rng);
    try {
      const ResponsesRequest r = server::parse_responses_request(b, c, &store);
      ++parsed;
      ASSERT_EQ(r.chat.prompts.size(), 1u) << b;
      ASSERT_FALSE(r.chat.prompts[0].empty()) << b;
      ASSERT_LE(int64_t(r.chat.prompts[0].size()) + r.chat.sampling.max_tokens, c.max_model_len)
          << b;
      ASSERT_EQ(r.chat.n, 1);
      ASSERT_TRUE(r.input_items.is_array()) << b;
    } catch (const ApiError& e) {
      ++rejected;
      ASSERT_TRUE(e.status == 400 || e.status == 404) << e.status << " " << b;
      ASSERT_FALSE(e.message.empty()) << b;
    }
  }
  EXPECT_EQ(parsed + rejected, kCases);
  EXPECT_GT(parsed, kCases / 50);
  EXPECT_GT(rejected, kCases / 10);
}

}  // namespace
}  // namespace md
