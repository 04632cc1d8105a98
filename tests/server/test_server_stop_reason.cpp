// vLLM's `stop_reason` on completion and chat choices: the stop string that ended the choice, or
// the id of one of the request's own stop_token_ids; null for the model's end of turn and for a
// length cut. Whole and streamed (on the last chunk), through HTTP with a forced output.
#include <gtest/gtest.h>

#include "megadecode/server/responses.h"
#include "server/http_test_server.h"

namespace md {
namespace {

using nlohmann::json;
using test::post_json;
using test::TestServer;

TEST(ServerStopReason, StringIdOrNull) {
  test::ServedModel m(1);
  const server::ParseContext ctx = m.context();
  const server::CompletionRequest r = server::parse_completion_request(
      R"({"prompt":"x","stop":["##"],"stop_token_ids":[7,9]})", ctx);
  ASSERT_EQ(r.user_stop_ids, 2u);
  ASSERT_GT(r.sampling.stop_token_ids.size(), 2u);  // the model's own end follows
  const int32_t eos = r.sampling.stop_token_ids.back();
  EXPECT_EQ(server::stop_reason_json(r, "stop", "##", {1, 2}), "##");
  EXPECT_EQ(server::stop_reason_json(r, "stop", "", {1, 9}), 9);
  EXPECT_TRUE(server::stop_reason_json(r, "stop", "", {1, eos}).is_null());
  EXPECT_TRUE(server::stop_reason_json(r, "length", "", {1, 9}).is_null());
  EXPECT_TRUE(server::stop_reason_json(r, "stop", "", {}).is_null());
}

TEST(ServerStopReason, ThroughHttpWholeAndStreamed) {
  TestServer s(2, "", 1 << 20, "alpha beta ## gamma<|im_end|>");
  json body = {{"prompt", "x"}, {"max_tokens", 40}, {"temperature", 0}, {"stop", {"##"}}};
  const json c = post_json(s, "/v1/completions", body);
  EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(c["choices"][0]["text"], "alpha beta ");
  EXPECT_EQ(c["choices"][0]["stop_reason"], "##");
  body["stream"] = true;
  auto cl = s.client();
  auto r = cl.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  json last;
  for (const std::string& d : test::sse_data(r->body))
    if (d != "[DONE]") last = json::parse(d);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(last["choices"][0]["stop_reason"], "##");
  // Without the stop string the forced output ends with the model's end of turn: null.
  const json chat = post_json(s, "/v1/chat/completions",
                              {{"messages", {{{"role", "user"}, {"content", "x"}}}},
                               {"max_tokens", 40},
                               {"temperature", 0}});
  EXPECT_EQ(chat["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(chat["choices"][0]["stop_reason"].is_null());
  // A length cut: null.
  const json cut = post_json(s, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 2}});
  EXPECT_EQ(cut["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(cut["choices"][0]["stop_reason"].is_null());
}

}  // namespace
}  // namespace md
