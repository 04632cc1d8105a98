// The OpenAI request bodies the server accepts, parsed and validated into plain structs before
// anything reaches the engine. Every rejection is an ApiError naming the field (its `param`) and
// carrying the HTTP status, so the front end only has to serialise it.
#pragma once
#include <cstdint>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/engine/sampler.h"
#include "megadecode/engine/token_constraint.h"
#include "megadecode/tokenizer/chat_template.h"

namespace md {

class Generator;
class Tokenizer;

namespace server {

// An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status.
struct ApiError : std::exception {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field (dotted path, e.g. "messages.2.role"); empty: none
  std::string code;   // machine-readable reason; empty: null
  ApiError(int status, std::string message, std::string param = "", std::string code = "",
           std::string type = "");
  const char* what() const noexcept override { return message.c_str(); }
  nlohmann::json to_json() const;
};

// A 400 naming `param`.
ApiError invalid_field(std::string param, std::string message, std::string code = "invalid_value");

// What request parsing needs to know about the served model.
struct ParseContext {
  const Generator* generator = nullptr;  // tokenizer, chat template, default stop ids
  std::vector<std::string> model_names;  // accepted values of "model" (empty: any)
  int64_t vocab_size = 0;
  int max_model_len = 0;      // prompt + generated tokens a sequence may hold
  int max_json_depth = 64;    // deeper bodies are rejected while parsing
  int max_choices = 64;       // prompts x n of one request
  int max_stop_strings = 16;  // entries of "stop"
  int max_logit_bias = 1024;  // entries of "logit_bias"
};

enum class RequestKind { kCompletion, kChat };

// One validated /v1/completions or /v1/chat/completions request.
struct CompletionRequest {
  RequestKind kind = RequestKind::kCompletion;
  std::string model;
  // Token ids of each prompt (a completions request may carry several; a chat has one).
  std::vector<std::vector<int32_t>> prompts;
  int n = 1;                // choices per prompt
  SamplingParams sampling;  // stop ids include the model's unless ignore_eos; seed of choice 0
  bool seed_given = false;
  bool ignore_eos = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool echo = false;           // completions: the prompt text is prepended to each choice
  // Chat: logprobs (bool) and top_logprobs; completions: logprobs = the number of top entries.
  bool logprobs = false;
  int top_logprobs = 0;
  bool tools_given = false;  // the request declared tools: tool calls in the output are parsed
  TemplateKind chat_template = TemplateKind::kKimi;  // chat: the markup the calls are parsed from
  // Chat: what tool_choice enforces on every choice's output (server/chat_constraints.h); null: none.
  std::shared_ptr<const ConstraintProgram> constraint;
  // logit_bias: (token id, bias in [-100, 100]) added to the logits before each draw, ids
  // ascending and unique.
  std::vector<std::pair<int32_t, float>> logit_bias;
  bool skip_special_tokens = true;
  // How many of sampling.stop_token_ids the request gave (the model's own follow them).
  size_t user_stop_ids = 0;
};

// Parses JSON text with a nesting limit; invalid JSON (or invalid UTF-8 in it) is a 400.
nlohmann::json parse_json_body(std::string_view body, int max_depth);

CompletionRequest parse_completion_request(std::string_view body, const ParseContext& ctx);
CompletionRequest parse_chat_request(std::string_view body, const ParseContext& ctx);

// /tokenize: {"prompt": text} or {"messages": [...]} (+ "add_generation_prompt",
// "add_special_tokens"); /detokenize: {"tokens": [ids]}.
struct TokenizeRequest {
  std::vector<int32_t> tokens;
};
TokenizeRequest parse_tokenize_request(std::string_view body, const ParseContext& ctx);
std::vector<int32_t> parse_detokenize_request(std::string_view body, const ParseContext& ctx);

// The model name check shared by every /v1 endpoint that names one (404 when unknown).
void check_model_name(const nlohmann::json& body, const ParseContext& ctx);

}  // namespace server
}  // namespace md
