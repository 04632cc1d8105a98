// GET /openapi.json: the routes, their request fields (types and ranges as request.cpp enforces
// them) and the shapes of their answers, for clients and schema-driven testers.
#include <nlohmann/json.hpp>

#include "megadecode/server/http_server.h"

namespace md::server {

using nlohmann::ordered_json;

namespace {

ordered_json num(double lo, double hi, bool lo_open = false) {
  ordered_json s = {{"type", "number"}, {"maximum", hi}, {"nullable", true}};
  if (lo_open)
    s["minimum"] = lo, s["exclusiveMinimum"] = true;
  else
    s["minimum"] = lo;
  return s;
}
ordered_json integer(int64_t lo, int64_t hi) {
  return {{"type", "integer"}, {"minimum", lo}, {"maximum", hi}, {"nullable", true}};
}
ordered_json boolean() {
  return {{"type", "boolean"}, {"nullable", true}};
}
ordered_json str() {
  return {{"type", "string"}};
}
ordered_json ids() {
  return {{"type", "array"}, {"items", {{"type", "integer"}, {"minimum", 0}}}};
}
ordered_json ref(const char* name) {
  return {{"$ref", std::string("#/components/schemas/") + name}};
}

ordered_json sampling_fields() {
  return {
      {"model", str()},
      {"max_tokens", integer(0, 2147483647)},
      {"max_completion_tokens", integer(0, 2147483647)},
      {"temperature", num(0, 2)},
      {"top_p", num(0, 1, true)},
      {"top_k", integer(-1, 2147483647)},
      {"min_p", num(0, 1)},
      {"presence_penalty", num(-2, 2)},
      {"frequency_penalty", num(-2, 2)},
      {"repetition_penalty", num(0, 100, true)},
      {"seed", {{"type", "integer"}, {"nullable", true}}},
      {"stop",
       {{"oneOf", {str(), {{"type", "array"}, {"items", str()}, {"maxItems", 16}}}},
        {"nullable", true}}},
      {"stop_token_ids", ids()},
      {"logit_bias",
       {{"type", "object"},
        {"nullable", true},
        {"maxProperties", 1024},
        {"additionalProperties", {{"type", "number"}, {"minimum", -100}, {"maximum", 100}}}}},
      {"ignore_eos", boolean()},
      {"n", integer(1, 64)},
      {"stream", boolean()},
      {"stream_options",
       {{"type", "object"}, {"nullable", true}, {"properties", {{"include_usage", boolean()}}}}},
  };
}

// vLLM's structured outputs (server/structured_outputs.h), on both generation endpoints.
void structured_output_fields(ordered_json& props) {
  const ordered_json choice = {
      {"type", "array"}, {"items", str()}, {"minItems", 1}, {"nullable", true}};
  const ordered_json schema = {{"oneOf", {{{"type", "object"}}, str()}}, {"nullable", true}};
  props["structured_outputs"] = {{"type", "object"},
                                 {"nullable", true},
                                 {"properties",
                                  {{"json", schema},
                                   {"regex", {{"type", "string"}, {"nullable", true}}},
                                   {"choice", choice},
                                   {"grammar", {{"type", "string"}, {"nullable", true}}},
                                   {"json_object", boolean()},
                                   {"disable_fallback", boolean()}}},
                                 {"additionalProperties", false}};
  props["guided_json"] = schema;
  props["guided_regex"] = {{"type", "string"}, {"nullable", true}};
  props["guided_choice"] = choice;
  props["guided_grammar"] = {{"type", "string"}, {"nullable", true}};
  props["grammar"] = {{"type", "string"}, {"nullable", true}};
  props["guided_decoding_backend"] = {{"type", "string"}, {"nullable", true}};
}

ordered_json json_response(const char* schema, const char* what) {
  return {{"description", what}, {"content", {{"application/json", {{"schema", ref(schema)}}}}}};
}

ordered_json errors() {
  ordered_json e = {{"description", "an OpenAI-style error"},
                    {"content", {{"application/json", {{"schema", ref("Error")}}}}}};
  return {{"400", e}, {"401", e}, {"404", e}, {"413", e}, {"503", e}};
}

ordered_json post(const char* summary, const char* request, const char* response) {
  ordered_json responses = errors();
  responses["200"] = json_response(response, "success");
  responses["200"]["content"]["text/event-stream"] = {{"schema", str()}};
  return {{"post",
           {{"summary", summary},
            {"requestBody",
             {{"required", true}, {"content", {{"application/json", {{"schema", ref(request)}}}}}}},
            {"responses", responses}}}};
}

ordered_json get(const char* summary, ordered_json content) {
  return {{"get", {{"summary", summary}, {"responses", {{"200", content}}}}}};
}

// An operation on one stored response (/v1/responses/{response_id}...): 404 when unknown.
ordered_json by_id(const char* summary, const char* response, ordered_json query = nullptr) {
  ordered_json params = {{{"name", "response_id"},
                          {"in", "path"},
                          {"required", true},
                          {"schema", {{"type", "string"}, {"pattern", "^[^/]+$"}}}}};
  if (query.is_array())
    for (auto& q : query) params.push_back(q);
  ordered_json responses = errors();
  responses["200"] = json_response(response, "success");
  return {{"summary", summary}, {"parameters", params}, {"responses", responses}};
}

// POST /v1/messages and /v1/messages/count_tokens: Anthropic's fields (anthropic_request.cpp),
// errors in Anthropic's shape.
ordered_json anthropic_post(const char* summary, const char* request, const char* response) {
  ordered_json e = {{"description", "an Anthropic-style error"},
                    {"content", {{"application/json", {{"schema", ref("AnthropicError")}}}}}};
  ordered_json responses = {{"400", e}, {"401", e}, {"404", e}, {"413", e}, {"503", e}};
  responses["200"] = json_response(response, "success");
  responses["200"]["content"]["text/event-stream"] = {{"schema", str()}};
  return {{"post",
           {{"summary", summary},
            {"requestBody",
             {{"required", true}, {"content", {{"application/json", {{"schema", ref(request)}}}}}}},
            {"responses", responses}}}};
}

ordered_json messages_request(bool count) {
  ordered_json block = {
      {"type", "object"},
      {"required", {"type"}},
      {"properties",
       {{"type",
         {{"type", "string"},
          {"enum", {"text", "tool_use", "tool_result", "thinking", "redacted_thinking"}}}},
        {"text", str()}}}};
  ordered_json content = {{"oneOf", {str(), {{"type", "array"}, {"items", block}}}}};
  ordered_json message = {
      {"type", "object"},
      {"required", {"role", "content"}},
      {"properties",
       {{"role", {{"type", "string"}, {"enum", {"user", "assistant"}}}}, {"content", content}}}};
  ordered_json tool = {{"type", "object"},
                       {"required", {"name", "input_schema"}},
                       {"properties",
                        {{"name", str()},
                         {"description", str()},
                         {"input_schema", {{"type", "object"}}},
                         {"type", {{"type", "string"}, {"enum", {"custom"}}}}}}};
  ordered_json props = {
      {"model", str()},
      {"messages", {{"type", "array"}, {"items", message}, {"minItems", 1}}},
      {"system", content},
      {"tools", {{"type", "array"}, {"items", tool}}},
      {"tool_choice",
       {{"type", "object"},
        {"required", {"type"}},
        {"properties",
         {{"type", {{"type", "string"}, {"enum", {"auto", "any", "tool", "none"}}}},
          {"name", str()}}}}},
      {"thinking",
       {{"type", "object"},
        {"required", {"type"}},
        {"properties",
         {{"type", {{"type", "string"}, {"enum", {"enabled", "adaptive", "disabled"}}}},
          {"budget_tokens", {{"type", "integer"}, {"minimum", 1}}}}}}},
      {"output_config",
       {{"type", "object"},
        {"properties",
         {{"effort",
           {{"type", "string"}, {"enum", {"low", "medium", "high", "xhigh", "max"}}}}}}}}};
  if (!count) {
    props["max_tokens"] = {{"type", "integer"}, {"minimum", 1}, {"maximum", 2147483647}};
    props["stop_sequences"] = {
        {"type", "array"}, {"items", {{"type", "string"}, {"minLength", 1}}}, {"maxItems", 16}};
    props["stream"] = boolean();
    props["temperature"] = num(0, 2);
    props["top_p"] = num(0, 1, true);
    props["top_k"] = integer(-1, 2147483647);
  }
  ordered_json r = {{"type", "object"}, {"properties", props}};
  r["required"] = count ? ordered_json{"messages"} : ordered_json{"messages", "max_tokens"};
  return r;
}

// POST /v1/responses: the fields responses_request.cpp reads, the sampling ones shared.
ordered_json responses_request() {
  ordered_json text_part = {{"type", "object"},
                            {"required", {"type", "text"}},
                            {"properties", {{"type", str()}, {"text", str()}}}};
  ordered_json content = {{"oneOf", {str(), {{"type", "array"}, {"items", text_part}}}}};
  ordered_json item = {
      {"type", "object"},
      {"properties",
       {{"type",
         {{"type", "string"},
          {"enum", {"message", "function_call", "function_call_output", "reasoning"}}}},
        {"role", {{"type", "string"}, {"enum", {"user", "system", "developer", "assistant"}}}},
        {"content", content},
        {"call_id", str()},
        {"name", str()},
        {"arguments", str()},
        {"output", content}}}};
  ordered_json tool = {{"type", "object"},
                       {"required", {"type", "name"}},
                       {"properties",
                        {{"type", {{"type", "string"}, {"enum", {"function"}}}},
                         {"name", str()},
                         {"description", str()},
                         {"parameters", {{"type", "object"}, {"nullable", true}}},
                         {"strict", boolean()}}}};
  ordered_json r = {{"type", "object"}, {"required", {"input"}}};
  ordered_json props = sampling_fields();
  for (const char* k : {"max_tokens", "max_completion_tokens", "n", "stream_options"})
    props.erase(k);
  props["max_output_tokens"] = integer(1, 2147483647);
  props["input"] = {{"oneOf", {str(), {{"type", "array"}, {"items", item}, {"minItems", 1}}}}};
  props["instructions"] = {{"type", "string"}, {"nullable", true}};
  props["previous_response_id"] = {{"type", "string"}, {"nullable", true}};
  props["store"] = boolean();
  props["tools"] = {{"type", "array"}, {"items", tool}};
  props["tool_choice"] = {
      {"oneOf",
       {{{"type", "string"}, {"enum", {"none", "auto", "required"}}},
        {{"type", "object"},
         {"required", {"type", "name"}},
         {"properties",
          {{"type", {{"type", "string"}, {"enum", {"function"}}}}, {"name", str()}}}}}}};
  props["parallel_tool_calls"] = boolean();
  props["text"] = {
      {"type", "object"},
      {"properties",
       {{"format",
         {{"type", "object"},
          {"required", {"type"}},
          {"properties",
           {{"type", {{"type", "string"}, {"enum", {"text", "json_object", "json_schema"}}}},
            {"name", str()},
            {"schema", {{"type", "object"}}},
            {"strict", boolean()}}}}}}}};
  props["reasoning"] = {{"type", "object"},
                        {"nullable", true},
                        {"properties",
                         {{"effort",
                           {{"type", "string"},
                            {"nullable", true},
                            {"enum", {"none", "minimal", "low", "medium", "high", "xhigh"}}}}}}};
  props["include"] = {{"type", "array"}, {"nullable", true}, {"items", str()}};
  props["top_logprobs"] = integer(0, 20);
  props["metadata"] = {{"type", "object"},
                       {"nullable", true},
                       {"maxProperties", 16},
                       {"additionalProperties", {{"type", "string"}, {"maxLength", 512}}}};
  props["truncation"] = {{"type", "string"}, {"nullable", true}, {"enum", {"disabled"}}};
  props["background"] = {{"type", "boolean"}, {"nullable", true}, {"enum", {false}}};
  props["user"] = str();
  props["stream_options"] = {{"type", "object"}, {"nullable", true}};
  r["properties"] = std::move(props);
  return r;
}

}  // namespace

std::string openapi_json(const std::string& model_name) {
  ordered_json completion = {{"type", "object"}, {"required", {"prompt"}}};
  completion["properties"] = sampling_fields();
  completion["properties"]["prompt"] = {{"oneOf",
                                         {str(),
                                          {{"type", "array"}, {"items", str()}, {"minItems", 1}},
                                          ids(),
                                          {{"type", "array"}, {"items", ids()}, {"minItems", 1}}}}};
  completion["properties"]["echo"] = boolean();
  completion["properties"]["logprobs"] = integer(0, 20);
  structured_output_fields(completion["properties"]);

  ordered_json part = {
      {"type", "object"},
      {"required", {"type", "text"}},
      {"properties", {{"type", {{"type", "string"}, {"enum", {"text"}}}}, {"text", str()}}}};
  ordered_json message = {
      {"type", "object"},
      {"required", {"role"}},
      {"properties",
       {{"role",
         {{"type", "string"}, {"enum", {"system", "developer", "user", "assistant", "tool"}}}},
        {"content", {{"oneOf", {str(), {{"type", "array"}, {"items", part}}}}, {"nullable", true}}},
        {"name", str()},
        {"tool_call_id", str()},
        {"reasoning_content", str()},
        {"tool_calls", {{"type", "array"}, {"items", {{"type", "object"}}}}}}}};
  ordered_json chat = {{"type", "object"}, {"required", {"messages"}}};
  chat["properties"] = sampling_fields();
  chat["properties"]["messages"] = {{"type", "array"}, {"items", message}, {"minItems", 1}};
  chat["properties"]["logprobs"] = boolean();
  chat["properties"]["top_logprobs"] = integer(0, 20);
  chat["properties"]["tools"] = {{"type", "array"}, {"items", {{"type", "object"}}}};
  chat["properties"]["tool_choice"] = {{"oneOf", {str(), {{"type", "object"}}}}};
  chat["properties"]["chat_template_kwargs"] = {{"type", "object"}};
  chat["properties"]["continue_final_message"] = boolean();
  chat["properties"]["parallel_tool_calls"] = boolean();
  chat["properties"]["add_generation_prompt"] = boolean();
  chat["properties"]["response_format"] = {
      {"type", "object"},
      {"nullable", true},
      {"required", {"type"}},
      {"properties",
       {{"type", {{"type", "string"}, {"enum", {"text", "json_object", "json_schema"}}}},
        {"json_schema",
         {{"type", "object"}, {"properties", {{"schema", {{"type", "object"}}}}}}}}}};
  structured_output_fields(chat["properties"]);

  ordered_json usage = {
      {"type", "object"},
      {"properties",
       {{"prompt_tokens", {{"type", "integer"}}},
        {"completion_tokens", {{"type", "integer"}}},
        {"total_tokens", {{"type", "integer"}}},
        {"prompt_tokens_details",
         {{"type", "object"}, {"properties", {{"cached_tokens", {{"type", "integer"}}}}}}}}}};
  ordered_json completion_resp = {
      {"type", "object"},
      {"required", {"id", "object", "created", "model", "choices"}},
      {"properties",
       {{"id", str()},
        {"object", str()},
        {"created", {{"type", "integer"}}},
        {"model", str()},
        {"choices", {{"type", "array"}, {"items", {{"type", "object"}}}}},
        {"usage", usage}}}};
  ordered_json error = {{"type", "object"},
                        {"required", {"error"}},
                        {"properties",
                         {{"error",
                           {{"type", "object"},
                            {"required", {"message", "type", "param", "code"}},
                            {"properties",
                             {{"message", str()},
                              {"type", str()},
                              {"param", {{"type", "string"}, {"nullable", true}}},
                              {"code", {{"type", "string"}, {"nullable", true}}}}}}}}}};
  ordered_json tokenize = {{"type", "object"},
                           {"properties",
                            {{"model", str()},
                             {"prompt", str()},
                             {"add_special_tokens", boolean()},
                             {"messages", {{"type", "array"}, {"items", message}}},
                             {"add_generation_prompt", boolean()}}}};
  ordered_json detokenize = {{"type", "object"},
                             {"required", {"tokens"}},
                             {"properties", {{"model", str()}, {"tokens", ids()}}}};
  ordered_json any_object = {{"type", "object"}};
  ordered_json anthropic_message = {
      {"type", "object"},
      {"required", {"id", "type", "role", "model", "content", "stop_reason", "usage"}},
      {"properties",
       {{"id", str()},
        {"type", {{"type", "string"}, {"enum", {"message"}}}},
        {"role", {{"type", "string"}, {"enum", {"assistant"}}}},
        {"model", str()},
        {"content", {{"type", "array"}, {"items", {{"type", "object"}}}}},
        {"stop_reason",
         {{"type", "string"}, {"enum", {"end_turn", "max_tokens", "stop_sequence", "tool_use"}}}},
        {"stop_sequence", {{"type", "string"}, {"nullable", true}}},
        {"usage",
         {{"type", "object"},
          {"required", {"input_tokens", "output_tokens"}},
          {"properties",
           {{"input_tokens", {{"type", "integer"}}},
            {"output_tokens", {{"type", "integer"}}}}}}}}}};
  ordered_json anthropic_error_schema = {
      {"type", "object"},
      {"required", {"type", "error"}},
      {"properties",
       {{"type", {{"type", "string"}, {"enum", {"error"}}}},
        {"error",
         {{"type", "object"},
          {"required", {"type", "message"}},
          {"properties", {{"type", str()}, {"message", str()}}}}}}}};
  ordered_json response_object = {
      {"type", "object"},
      {"required", {"id", "object", "created_at", "model", "status", "output"}},
      {"properties",
       {{"id", str()},
        {"object", {{"type", "string"}, {"enum", {"response"}}}},
        {"created_at", {{"type", "integer"}}},
        {"model", str()},
        {"status",
         {{"type", "string"}, {"enum", {"completed", "incomplete", "failed", "in_progress"}}}},
        {"output", {{"type", "array"}, {"items", {{"type", "object"}}}}},
        {"usage",
         {{"type", "object"},
          {"nullable", true},
          {"properties",
           {{"input_tokens", {{"type", "integer"}}},
            {"output_tokens", {{"type", "integer"}}},
            {"total_tokens", {{"type", "integer"}}}}}}}}}};

  ordered_json doc = {
      {"openapi", "3.0.3"},
      {"info",
       {{"title", "megadecode OpenAI-compatible server"},
        {"version", "0.1.0"},
        {"description", "serving " + model_name + "; see docs/server.md"}}},
      {"paths",
       {{"/v1/completions", post("text completion", "CompletionRequest", "CompletionResponse")},
        {"/v1/chat/completions", post("chat completion", "ChatRequest", "CompletionResponse")},
        {"/tokenize", post("text or chat -> token ids", "TokenizeRequest", "Object")},
        {"/detokenize", post("token ids -> text", "DetokenizeRequest", "Object")},
        {"/v1/models", get("the served model", json_response("Object", "model list"))},
        {"/health", get("liveness", json_response("Object", "ok"))},
        {"/version", get("server version", json_response("Object", "version"))},
        {"/metrics",
         get("Prometheus metrics", {{"description", "text exposition format"},
                                    {"content", {{"text/plain", {{"schema", str()}}}}}})},
        {"/openapi.json", get("this document", json_response("Object", "OpenAPI 3"))},
        {"/v1/responses", post("a response (Responses API)", "ResponsesRequest", "Response")},
        {"/v1/messages",
         anthropic_post("a message (Anthropic Messages API)", "MessagesRequest", "Message")},
        {"/v1/messages/count_tokens", anthropic_post("the prompt's tokens of a Messages request",
                                                     "CountTokensRequest", "Object")},
        {"/v1/responses/{response_id}",
         {{"get", by_id("a stored response", "Response")},
          {"delete", by_id("delete a stored response", "Object")}}},
        {"/v1/responses/{response_id}/input_items",
         {{"get", by_id("a stored response's input items", "Object",
                        {{{"name", "order"},
                          {"in", "query"},
                          {"schema", {{"type", "string"}, {"enum", {"asc", "desc"}}}}},
                         {{"name", "limit"},
                          {"in", "query"},
                          {"schema", {{"type", "integer"}, {"minimum", 1}, {"maximum", 100}}}},
                         {{"name", "after"}, {"in", "query"}, {"schema", str()}}})}}}}},
      {"components",
       {{"schemas",
         {{"CompletionRequest", completion},
          {"ChatRequest", chat},
          {"TokenizeRequest", tokenize},
          {"DetokenizeRequest", detokenize},
          {"CompletionResponse", completion_resp},
          {"ResponsesRequest", responses_request()},
          {"MessagesRequest", messages_request(false)},
          {"CountTokensRequest", messages_request(true)},
          {"Message", anthropic_message},
          {"AnthropicError", anthropic_error_schema},
          {"Response", response_object},
          {"Error", error},
          {"Object", any_object}}}}}};
  return doc.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

}  // namespace md::server
