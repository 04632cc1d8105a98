// Request parsing and validation: every bad input the issue lists gets a 4xx ApiError naming the
// field, valid ones become the expected struct, and a mutation run over the parsers finds no
// crash and no other exception.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "megadecode/base/util.h"
#include "megadecode/server/responses.h"
#include "server/server_test_util.h"

namespace md {
namespace {

using test::error_of;

using server::ApiError;
using server::CompletionRequest;
using ::testing::HasSubstr;

class ServerRequest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { served_ = new test::ServedModel(1); }
  static void TearDownTestSuite() {
    delete served_;
    served_ = nullptr;
  }
  static server::ParseContext ctx() { return served_->context(256); }
  static CompletionRequest completion(const std::string& body) {
    return server::parse_completion_request(body, ctx());
  }
  static CompletionRequest chat(const std::string& body) {
    return server::parse_chat_request(body, ctx());
  }
  static test::ServedModel* served_;
};
test::ServedModel* ServerRequest::served_ = nullptr;

TEST_F(ServerRequest, CompletionFieldsAreParsed) {
  const CompletionRequest r = completion(
      R"({"model":"tiny","prompt":"hello world","max_tokens":7,"temperature":0,"top_p":0.5,
          "top_k":-1,"min_p":0.1,"presence_penalty":0.5,"frequency_penalty":-0.5,
          "repetition_penalty":1.1,"seed":42,"stop":["x","yz"],"stop_token_ids":[3],
          "ignore_eos":true,"stream":true,"stream_options":{"include_usage":true},
          "logprobs":2,"echo":true,"n":2,"user":"ignored","logit_bias":{"7":-3.5,"2":100,"0":0}})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0], served_->gen->encode("hello world"));
  EXPECT_EQ(r.sampling.max_tokens, 7);
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_EQ(r.sampling.top_p, 0.5f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.1f);
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -0.5f);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.1f);
  EXPECT_EQ(r.sampling.seed, 42u);
  EXPECT_EQ(r.sampling.stop_strings, (std::vector<std::string>{"x", "yz"}));
  EXPECT_EQ(r.sampling.stop_token_ids, std::vector<int32_t>{3});  // ignore_eos: no eos ids
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 2);
  EXPECT_TRUE(r.echo);
  EXPECT_EQ(r.n, 2);
  using Bias = std::vector<std::pair<int32_t, float>>;
  EXPECT_EQ(r.logit_bias, (Bias{{0, 0.0f}, {2, 100.0f}, {7, -3.5f}}));  // ids ascending
}

TEST_F(ServerRequest, PromptForms) {
  const auto ids = served_->gen->encode("abc");
  EXPECT_EQ(completion(R"({"prompt":["abc","abc"]})").prompts,
            (std::vector<std::vector<int32_t>>{ids, ids}));
  EXPECT_EQ(completion(R"({"prompt":[5,6,7]})").prompts,
            (std::vector<std::vector<int32_t>>{{5, 6, 7}}));
  EXPECT_EQ(completion(R"({"prompt":[[5],[6,7]]})").prompts,
            (std::vector<std::vector<int32_t>>{{5}, {6, 7}}));
  // Defaults: completions get 16 tokens, the model's stop ids, a fresh seed each time.
  const CompletionRequest a = completion(R"({"prompt":"abc"})"),
                          b = completion(R"({"prompt":"abc"})");
  EXPECT_EQ(a.sampling.max_tokens, 16);
  EXPECT_EQ(a.sampling.stop_token_ids, served_->gen->default_stop_ids());
  EXPECT_FALSE(a.seed_given);
  EXPECT_NE(a.sampling.seed, b.sampling.seed);
}

TEST_F(ServerRequest, ChatMessagesAreRendered) {
  const CompletionRequest r = chat(
      R"({"messages":[{"role":"developer","content":"be brief"},
                      {"role":"user","content":[{"type":"text","text":"hi"},{"type":"text","text":"there"}]}],
          "logprobs":true,"top_logprobs":3,"max_completion_tokens":5})");
  std::vector<ChatMessage> msgs = {{"system", "be brief", "", "", {}, ""},
                                   {"user", "hi\nthere", "", "", {}, ""}};
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0], served_->gen->encode_chat(msgs, true));
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 3);
  EXPECT_EQ(r.sampling.max_tokens, 5);
  // Without max_tokens a chat may fill the context.
  const CompletionRequest d = chat(R"({"messages":[{"role":"user","content":"hi"}]})");
  EXPECT_EQ(d.sampling.max_tokens, 256 - int(d.prompts[0].size()));
  // Tool calls and results go through the template.
  const CompletionRequest t = chat(
      R"({"messages":[{"role":"user","content":"weather?"},
                      {"role":"assistant","content":null,"tool_calls":[{"id":"functions.w:0","type":"function","function":{"name":"w","arguments":"{}"}}]},
                      {"role":"tool","tool_call_id":"functions.w:0","content":"sunny"}],
          "tools":[{"type":"function","function":{"name":"w","parameters":{"type":"object"}}}]})");
  EXPECT_TRUE(t.tools_given);
  EXPECT_GT(t.prompts[0].size(), d.prompts[0].size());
}

struct BadCase {
  const char* endpoint;  // "completions" | "chat" | "tokenize" | "detokenize"
  std::string body;
  int status;
  const char* param;  // the field the error must name
};

TEST_F(ServerRequest, BadInputsNameTheField) {
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  const std::string long_prompt = "[" + [] {
    std::string s;
    for (int i = 0; i < 300; ++i) s += (i ? ",5" : "5");
    return s;
  }() + "]";
  const std::vector<BadCase> cases = {
      {"completions", "not json", 400, ""},
      {"completions", "{\"prompt\": \"abc\"", 400, ""},
      {"completions", "[1,2]", 400, ""},
      {"completions", "{\"prompt\":\"a\xff\"}", 400, ""},  // invalid UTF-8 inside JSON
      {"chat", "{\"messages\":[{\"role\":\"user\",\"content\":\"\xc3\x28\"}]}", 400, ""},
      {"completions", "{\"prompt\":" + deep + "}", 400, ""},
      {"completions", "{}", 400, "prompt"},
      {"completions", R"({"prompt":5})", 400, "prompt"},
      {"completions", R"({"prompt":[]})", 400, "prompt"},
      {"completions", R"({"prompt":""})", 400, "prompt"},
      {"completions", R"({"prompt":[1,"a"]})", 400, "prompt.1"},
      {"completions", R"({"prompt":[1,999999]})", 400, "prompt.1"},
      {"completions", R"({"prompt":[-1]})", 400, "prompt.0"},
      {"completions", R"({"prompt":[true]})", 400, "prompt"},
      {"completions", "{\"prompt\":" + long_prompt + "}", 400, "prompt"},
      {"completions", R"({"prompt":"a","max_tokens":-1})", 400, "max_tokens"},
      {"completions", R"({"prompt":"a","max_tokens":0})", 400, "max_tokens"},
      {"completions", R"({"prompt":"a","max_tokens":1.5})", 400, "max_tokens"},
      {"completions", R"({"prompt":"a","max_tokens":"7"})", 400, "max_tokens"},
      {"completions", R"({"prompt":"a","max_tokens":100000})", 400, "max_tokens"},
      {"completions", R"({"prompt":"a","temperature":-0.1})", 400, "temperature"},
      {"completions", R"({"prompt":"a","temperature":"hot"})", 400, "temperature"},
      {"completions", R"({"prompt":"a","top_p":0})", 400, "top_p"},
      {"completions", R"({"prompt":"a","top_p":1.01})", 400, "top_p"},
      {"completions", R"({"prompt":"a","top_k":-2})", 400, "top_k"},
      {"completions", R"({"prompt":"a","min_p":2})", 400, "min_p"},
      {"completions", R"({"prompt":"a","presence_penalty":3})", 400, "presence_penalty"},
      {"completions", R"({"prompt":"a","frequency_penalty":-3})", 400, "frequency_penalty"},
      {"completions", R"({"prompt":"a","repetition_penalty":0})", 400, "repetition_penalty"},
      {"completions", R"({"prompt":"a","seed":"x"})", 400, "seed"},
      {"completions", R"({"prompt":"a","seed":18446744073709551615})", 400, "seed"},
      {"completions", R"({"prompt":"a","stop":5})", 400, "stop"},
      {"completions", R"({"prompt":"a","stop":[""]})", 400, "stop"},
      {"completions", R"({"prompt":"a","stop":["a",1]})", 400, "stop.1"},
      {"completions", R"({"prompt":"a","stop_token_ids":[1,-4]})", 400, "stop_token_ids.1"},
      {"completions", R"({"prompt":"a","ignore_eos":1})", 400, "ignore_eos"},
      {"completions", R"({"prompt":"a","stream":"yes"})", 400, "stream"},
      {"completions", R"({"prompt":"a","stream_options":{"include_usage":true}})", 400,
       "stream_options"},
      {"completions", R"({"prompt":"a","n":0})", 400, "n"},
      {"completions", R"({"prompt":"a","n":1000})", 400, "n"},
      {"completions", R"({"prompt":"a","best_of":3})", 400, "best_of"},
      {"completions", R"({"prompt":"a","logprobs":21})", 400, "logprobs"},
      {"completions", R"({"prompt":"a","logprobs":true})", 400, "logprobs"},
      {"completions", R"({"prompt":"a","suffix":"b"})", 400, "suffix"},
      {"completions", R"({"prompt":"a","logit_bias":5})", 400, "logit_bias"},
      {"completions", R"({"prompt":"a","logit_bias":[1]})", 400, "logit_bias"},
      {"completions", R"({"prompt":"a","logit_bias":{"x":1}})", 400, "logit_bias"},
      {"completions", R"({"prompt":"a","logit_bias":{"05":1}})", 400, "logit_bias"},
      {"completions", R"({"prompt":"a","logit_bias":{"-1":1}})", 400, "logit_bias"},
      {"completions", R"({"prompt":"a","logit_bias":{"":1}})", 400, "logit_bias"},
      {"completions", R"({"prompt":"a","logit_bias":{"999999":1}})", 400, "logit_bias"},
      {"completions", R"({"prompt":"a","logit_bias":{"99999999999999999999":1}})", 400,
       "logit_bias"},
      {"completions", R"({"prompt":"a","logit_bias":{"5":"a"}})", 400, "logit_bias.5"},
      {"completions", R"({"prompt":"a","logit_bias":{"5":true}})", 400, "logit_bias.5"},
      {"completions", R"({"prompt":"a","logit_bias":{"5":100.5}})", 400, "logit_bias.5"},
      {"chat", R"({"messages":[{"role":"user","content":"a"}],"logit_bias":{"5":-101}})", 400,
       "logit_bias.5"},
      {"completions", R"({"prompt":"a","model":"gpt-4"})", 404, "model"},
      {"completions", R"({"prompt":"a","model":7})", 400, "model"},
      {"completions", R"({"prompt":"a","temperature":1e999})", 400, ""},
      {"chat", "{}", 400, "messages"},
      {"chat", R"({"messages":[]})", 400, "messages"},
      {"chat", R"({"messages":"hi"})", 400, "messages"},
      {"chat", R"({"messages":[5]})", 400, "messages.0"},
      {"chat", R"({"messages":[{"content":"hi"}]})", 400, "messages.0.role"},
      {"chat", R"({"messages":[{"role":"wizard","content":"hi"}]})", 400, "messages.0.role"},
      {"chat", R"({"messages":[{"role":"user"}]})", 400, "messages.0.content"},
      {"chat", R"({"messages":[{"role":"user","content":5}]})", 400, "messages.0.content"},
      {"chat", R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", 400,
       "messages.0.content.0.type"},
      {"chat", R"({"messages":[{"role":"user","content":[{"type":"text"}]}]})", 400,
       "messages.0.content.0.text"},
      {"chat", R"({"messages":[{"role":"user","content":"a","tool_calls":[]}]})", 400,
       "messages.0.tool_calls"},
      {"chat", R"({"messages":[{"role":"assistant","tool_calls":[{"function":{}}]}]})", 400,
       "messages.0.tool_calls.0.function.name"},
      {"chat", R"({"messages":[{"role":"user","content":"a"}],"tools":[{"type":"retrieval"}]})",
       400, "tools.0.type"},
      {"chat", R"({"messages":[{"role":"user","content":"a"}],"tool_choice":"sometimes"})", 400,
       "tool_choice"},
      {"chat", R"({"messages":[{"role":"user","content":"a"}],"top_logprobs":2})", 400,
       "top_logprobs"},
      {"chat", R"({"messages":[{"role":"user","content":"a"}],"logprobs":2})", 400, "logprobs"},
      {"chat", R"({"messages":[{"role":"user","content":"a"}],"response_format":{"type":"xml"}})",
       400, "response_format.type"},
      {"chat", R"({"messages":[{"role":"user","content":"a"}],"model":"other"})", 404, "model"},
      {"tokenize", "{}", 400, "prompt"},
      {"tokenize", R"({"prompt":"a","messages":[]})", 400, "messages"},
      {"tokenize", R"({"prompt":7})", 400, "prompt"},
      {"detokenize", R"({"tokens":[1,1000000]})", 400, "tokens.1"},
      {"detokenize", R"({"tokens":"1"})", 400, "tokens"},
      {"detokenize", "{}", 400, "tokens"},
  };
  const server::ParseContext c = ctx();
  for (const BadCase& bc : cases) {
    SCOPED_TRACE(std::string(bc.endpoint) + " " + bc.body.substr(0, 120));
    const std::string ep = bc.endpoint;
    const ApiError e = error_of([&] {
      if (ep == "completions") server::parse_completion_request(bc.body, c);
      if (ep == "chat") server::parse_chat_request(bc.body, c);
      if (ep == "tokenize") server::parse_tokenize_request(bc.body, c);
      if (ep == "detokenize") server::parse_detokenize_request(bc.body, c);
    });
    EXPECT_EQ(e.status, bc.status) << e.message;
    EXPECT_EQ(e.param, bc.param) << e.message;
    EXPECT_FALSE(e.message.empty());
    const nlohmann::json j = e.to_json();
    ASSERT_TRUE(j.contains("error"));
    for (const char* k : {"message", "type", "param", "code"}) EXPECT_TRUE(j["error"].contains(k));
  }
}

TEST_F(ServerRequest, DeepNestingIsRefusedQuickly) {
  // A million brackets: refused at the depth limit, without building (or recursing into) them.
  std::string body = "{\"prompt\":";
  body.append(1 << 20, '[');
  body += '}';
  const ApiError e = error_of([&] { completion(body); });
  EXPECT_EQ(e.status, 400);
  EXPECT_THAT(e.message, HasSubstr("nested deeper"));
  EXPECT_EQ(e.code, "json_too_deep");
}

// Kimi's tool-call markup in generated text becomes OpenAI tool_calls; text without it is all
// content.
// Random mutations of valid bodies (byte edits, splices of hostile fragments, field values of
// every JSON type) through both parsers: each case either parses into a request that respects
// the limits or throws an ApiError with a 4xx status; anything else (another exception, a
// crash under the sanitizers) fails. Deterministic: a fixed seed.
TEST_F(ServerRequest, MutationsNeverCrash) {
  const std::vector<std::string> seeds = {
      R"({"model":"tiny","prompt":"hello","max_tokens":5,"temperature":0.7,"stop":["\n"]})",
      R"({"prompt":[1,2,3],"logprobs":2,"echo":true,"n":2,"seed":3})",
      R"({"prompt":[[1,2],[3]],"stream":true,"stream_options":{"include_usage":true}})",
      R"({"prompt":["a","b"],"top_k":5,"top_p":0.9,"min_p":0.05,"stop_token_ids":[4]})",
      R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":3})",
      R"({"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"x"}]}],"logprobs":true,"top_logprobs":2})",
      R"({"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"a","content":"r"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"auto"})",
      R"({"messages":[{"role":"user","content":"j"}],"response_format":{"type":"json_schema","json_schema":{"name":"s","schema":{"type":"object","properties":{"a":{"type":"integer"},"b":{"enum":["x",1,null]},"c":{"anyOf":[{"type":"string"},{"$ref":"#"}]},"d":{"type":"array","items":{"$ref":"#/$defs/D"}}},"required":["a"],"additionalProperties":false,"$defs":{"D":{"type":["number","null"]}}}}}})",
      R"({"messages":[{"role":"user","content":"p"}],"response_format":{"type":"json_schema","json_schema":{"name":"p","schema":{"type":"object","properties":{"a":{"type":"string","pattern":"^[A-Z]{2}-\\d{3}(x|y)*[^\\s]?$","maxLength":9},"b":{"type":"number","minimum":-1.5,"exclusiveMaximum":10},"c":{"type":"string","format":"date-time"},"d":{"type":"integer","exclusiveMinimum":true,"minimum":3}}}}}})",
      R"({"prompt":"q","structured_outputs":{"regex":"[A-Z]{2}-\\d{3}( (ok|no))?\\u00e9*"},"guided_decoding_backend":"x"})",
      R"({"messages":[{"role":"user","content":"c"}],"structured_outputs":{"choice":["yes","no","n/a"]}})",
      R"({"prompt":"g","grammar":"root ::= item{1,3}\nitem ::= [a-z]+ \"\\n\" # items"})",
      R"({"messages":[{"role":"user","content":"g"}],"guided_json":{"type":"object","properties":{"a":{"type":"integer"}}},"guided_regex":null})",
      R"({"messages":[{"role":"user","content":"t"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"q":{"type":"string"}},"required":["q"]}}}],"tool_choice":{"type":"function","function":{"name":"f"}},"logit_bias":{"3":-5}})",
  };
  const std::vector<std::string> fragments = {"\"messages\"", "\"prompt\"", "\"role\"",
                                              "\"content\"", "\"max_tokens\":99999999"};
  const server::ParseContext c = ctx();
  std::mt19937_64 rng(20261201);
  int parsed = 0, rejected = 0;
  const int kCases = 100000;
  for (int i = 0; i < kCases; ++i) {
    const std::string b = test::mutated_body(seeds, fragments, rng);
    try {
      const bool is_chat = b.find("\"messages\"") != std::string::npos && (i & 1);
      CompletionRequest r =
          is_chat ? server::parse_chat_request(b, c) : server::parse_completion_request(b, c);
      ++parsed;
      ASSERT_FALSE(r.prompts.empty()) << b;
      for (const auto& p : r.prompts) {
        ASSERT_FALSE(p.empty()) << b;
        ASSERT_LE(int64_t(p.size()) + r.sampling.max_tokens, c.max_model_len) << b;
        for (int32_t id : p) ASSERT_TRUE(id >= 0 && id < c.vocab_size) << b;
      }
      ASSERT_GE(r.n, 1);
      ASSERT_LE(int(r.prompts.size()) * r.n, c.max_choices) << b;
      ASSERT_LE(int(r.sampling.stop_strings.size()), c.max_stop_strings) << b;
    } catch (const ApiError& e) {
      ++rejected;
      ASSERT_TRUE(e.status == 400 || e.status == 404) << e.status << " " << b;
      ASSERT_FALSE(e.message.empty()) << b;
      (void)e.to_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
  }
  EXPECT_EQ(parsed + rejected, kCases);
  RecordProperty("parsed", parsed);
  RecordProperty("rejected", rejected);
  // The run must exercise both outcomes, or the mutations are too weak (or too strong).
  EXPECT_GT(parsed, kCases / 50);
  EXPECT_GT(rejected, kCases / 10);
}

// A chunk from its template is byte for byte the dumped chunk, for texts with every kind of
// character JSON escapes (quotes, backslashes, control bytes, the marker's own \x01), multi-byte
// UTF-8 and invalid UTF-8 (replaced), in both chunk kinds, with and without the usage field.
TEST(ServerChunkTemplate, EqualsTheDumpedChunk) {
  const server::ResponseMeta meta{"cmpl-00ab", 1796432931, "tiny"};
  std::mt19937 rng(5);
  const std::vector<std::string> pieces = {"a",
                                           " ",
                                           "\"",
                                           "\\",
                                           "\n",
                                           "\t",
                                           "\x01",
                                           "\x1f",
                                           "/",
                                           "\xc3\xa9",
                                           "\xe2\x82\xac",
                                           "\xf0\x9f\x98\x80",
                                           "\xff",
                                           "\xc3",
                                           "{",
                                           "}",
                                           "megadecode-chunk-text"};
  for (const bool chat : {false, true})
    for (const bool usage : {false, true}) {
      auto chunk = [&](const std::string& text) {
        nlohmann::json j =
            chat ? server::chat_chunk(meta, 2, {{"content", text}}, nullptr, std::nullopt)
                 : server::completion_chunk(meta, 2, text, nullptr, std::nullopt);
        if (usage) j["usage"] = nullptr;
        return j;
      };
      const server::ChunkTemplate t(chunk(server::ChunkTemplate::kMarker));
      ASSERT_TRUE(t.valid());
      for (int n = 0; n < 400; ++n) {
        std::string text;
        const int len = int(rng() % 12);
        for (int k = 0; k < len; ++k) text += pieces[rng() % pieces.size()];
        EXPECT_EQ(t.sse(text), "data: " + server::dump(chunk(text)) + "\n\n") << text;
      }
    }
  // A chunk without the marker, or with it twice, has no template.
  EXPECT_FALSE(server::ChunkTemplate(server::completion_chunk(meta, 0, "x", nullptr, {})).valid());
  const std::string m = server::ChunkTemplate::kMarker;
  EXPECT_FALSE(
      server::ChunkTemplate(server::chat_chunk(meta, 0, {{"content", m}, {"reasoning_content", m}},
                                               nullptr, std::nullopt))
          .valid());
}

}  // namespace
}  // namespace md
