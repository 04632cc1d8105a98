// Request bodies -> validated structs. Fields follow the OpenAI API (and vLLM's extensions:
// top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, chat_template_kwargs); a null
// field is treated as absent, as the OpenAI clients send it. Unknown fields are ignored.
#include "megadecode/server/request.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>

#include "json_fields.h"
#include "megadecode/base/error.h"
#include "megadecode/server/structured_outputs.h"
#include "megadecode/text/generator.h"

namespace md::server {

using nlohmann::json;

ApiError::ApiError(int status_, std::string message_, std::string param_, std::string code_,
                   std::string type_)
    : status(status_),
      message(std::move(message_)),
      param(std::move(param_)),
      code(std::move(code_)) {
  if (!type_.empty())
    type = std::move(type_);
  else if (status >= 500)
    type = "server_error";
  else if (status == 401)
    type = "authentication_error";
  else if (status == 404)
    type = "not_found_error";
}

json ApiError::to_json() const {
  json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return {{"error", e}};
}

ApiError invalid_field(std::string param, std::string message, std::string code) {
  return ApiError(400, std::move(message), std::move(param), std::move(code));
}

json parse_json_body(std::string_view body, int max_depth) {
  // The callback sees every value's depth before it is built, so a deeply nested body is
  // refused before it costs memory or stack.
  json::parser_callback_t limit = [max_depth](int depth, json::parse_event_t, json&) {
    if (depth > max_depth)
      throw invalid_field("",
                          fmt::format("the JSON body is nested deeper than {} levels", max_depth),
                          "json_too_deep");
    return true;
  };
  try {
    json j = json::parse(body.begin(), body.end(), limit);
    if (!j.is_object())
      throw invalid_field("", "the request body must be a JSON object", "invalid_json");
    return j;
  } catch (const json::exception& e) {
    throw invalid_field("", fmt::format("the request body is not valid JSON: {}", e.what()),
                        "invalid_json");
  }
}

namespace {

using namespace detail;

uint64_t fresh_seed() {
  // Requests without a seed still differ from each other; the counter keeps two requests in the
  // same clock tick apart.
  static std::atomic<uint64_t> counter{0};
  const uint64_t t = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  return t * 0x9E3779B97F4A7C15ull + counter.fetch_add(1) * 0xBF58476D1CE4E5B9ull;
}

}  // namespace

namespace detail {

// The fields both endpoints share: sampling, stops, streaming, n.
void parse_common(const json& j, const ParseContext& ctx, CompletionRequest& r) {
  check_model_name(j, ctx);
  if (const json* m = field(j, "model")) r.model = m->get<std::string>();
  SamplingParams& p = r.sampling;
  p.temperature = float(get_number(j, "temperature", 0.0, 2.0, 1.0));
  p.top_p = float(get_number(j, "top_p", 0.0, 1.0, 1.0, /*lo_open=*/true));
  const int64_t top_k = get_int(j, "top_k", -1, ctx.vocab_size, 0);
  p.top_k = top_k < 0 ? 0 : int(top_k);  // vLLM's -1 means off, as 0 does here
  p.min_p = float(get_number(j, "min_p", 0.0, 1.0, 0.0));
  p.presence_penalty = float(get_number(j, "presence_penalty", -2.0, 2.0, 0.0));
  p.frequency_penalty = float(get_number(j, "frequency_penalty", -2.0, 2.0, 0.0));
  p.repetition_penalty =
      float(get_number(j, "repetition_penalty", 0.0, 100.0, 1.0, /*lo_open=*/true));
  if (const json* s = field(j, "seed")) {
    r.seed_given = true;
    p.seed = uint64_t(as_int(*s, "seed", std::numeric_limits<int64_t>::min(),
                             std::numeric_limits<int64_t>::max()));
  } else {
    p.seed = fresh_seed();
  }
  if (const json* s = field(j, "stop")) {
    if (s->is_string()) {
      p.stop_strings.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (size_t i = 0; i < s->size(); ++i)
        p.stop_strings.push_back(as_string((*s)[i], "stop." + std::to_string(i)));
    } else {
      throw invalid_field(
          "stop",
          fmt::format("'stop' must be a string or a list of strings, not {}", type_name(*s)),
          "invalid_type");
    }
    if (int(p.stop_strings.size()) > ctx.max_stop_strings)
      throw invalid_field("stop", fmt::format("'stop' has {} entries; at most {} are allowed",
                                              p.stop_strings.size(), ctx.max_stop_strings));
    for (const std::string& s : p.stop_strings)
      if (s.empty()) throw invalid_field("stop", "'stop' strings must not be empty");
  }
  if (const json* s = field(j, "stop_token_ids"))
    p.stop_token_ids = as_ids(*s, "stop_token_ids", ctx.vocab_size);
  r.user_stop_ids = p.stop_token_ids.size();
  r.ignore_eos = get_bool(j, "ignore_eos", false);
  if (!r.ignore_eos)
    for (int32_t id : ctx.generator->default_stop_ids()) p.stop_token_ids.push_back(id);
  r.skip_special_tokens = get_bool(j, "skip_special_tokens", true);
  if (!r.skip_special_tokens)
    throw invalid_field("skip_special_tokens", "'skip_special_tokens': false is not supported",
                        "unsupported_parameter");
  r.stream = get_bool(j, "stream", false);
  if (const json* so = field(j, "stream_options")) {
    if (!r.stream)
      throw invalid_field("stream_options",
                          "'stream_options' is only allowed when 'stream' is true");
    if (!so->is_object())
      throw invalid_field("stream_options", "'stream_options' must be an object", "invalid_type");
    r.include_usage = get_bool(*so, "include_usage", false);
  }
  r.n = int(get_int(j, "n", 1, ctx.max_choices, 1));
  if (const json* b = field(j, "best_of"))
    if (as_int(*b, "best_of", 1, ctx.max_choices) != r.n)
      throw invalid_field("best_of", "'best_of' different from 'n' is not supported",
                          "unsupported_parameter");
  if (const json* lb = field(j, "logit_bias")) r.logit_bias = parse_logit_bias(*lb, ctx);
}

// "logit_bias": {"<token id>": bias, ...} as OpenAI defines it: ids as decimal strings (no sign,
// no leading zeros: one spelling per id) inside the vocabulary, biases numbers in [-100, 100].
std::vector<std::pair<int32_t, float>> parse_logit_bias(const json& lb, const ParseContext& ctx) {
  if (!lb.is_object())
    throw invalid_field("logit_bias",
                        fmt::format("'logit_bias' must be an object mapping token ids to biases, "
                                    "not {}",
                                    type_name(lb)),
                        "invalid_type");
  if (int(lb.size()) > ctx.max_logit_bias)
    throw invalid_field("logit_bias", fmt::format("'logit_bias' has {} entries; at most {} are "
                                                  "allowed",
                                                  lb.size(), ctx.max_logit_bias));
  std::vector<std::pair<int32_t, float>> out;
  for (const auto& [key, value] : lb.items()) {
    const std::string param = "logit_bias." + key;
    const bool digits =
        !key.empty() && key.size() <= 10 && (key == "0" || key[0] != '0') &&
        std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    const int64_t id = digits ? std::stoll(key) : -1;
    if (id < 0 || id >= ctx.vocab_size)
      throw invalid_field("logit_bias",
                          fmt::format("'logit_bias' key '{}' is not a token id of the vocabulary "
                                      "(a decimal integer in [0, {}])",
                                      key, ctx.vocab_size - 1));
    if (!value.is_number())
      throw invalid_field(param,
                          fmt::format("'{}' must be a number, not {}", param, type_name(value)),
                          "invalid_type");
    const double b = value.get<double>();
    if (!(b >= -100.0 && b <= 100.0))
      throw invalid_field(param, fmt::format("'{}' is {}; it must be in [-100, 100]", param, b));
    out.emplace_back(int32_t(id), float(b));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// max_tokens / max_completion_tokens against the context; `def`: the default when neither is
// given (0: fill the context).
void parse_length(const json& j, const ParseContext& ctx, CompletionRequest& r, int def) {
  const char* name = field(j, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  const int64_t lo = r.echo ? 0 : 1;
  const json* v = field(j, name);
  size_t longest = 0;
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    const std::string param = r.kind == RequestKind::kChat ? "messages" : "prompt";
    if (r.prompts[i].empty())
      throw invalid_field(param, fmt::format("the {} is empty (no tokens to start from)",
                                             r.kind == RequestKind::kChat ? "chat" : "prompt"));
    if (int64_t(r.prompts[i].size()) >= ctx.max_model_len)
      throw invalid_field(param,
                          fmt::format("this model's maximum context length is {} tokens; the "
                                      "prompt has {} tokens",
                                      ctx.max_model_len, r.prompts[i].size()),
                          "context_length_exceeded");
    longest = std::max(longest, r.prompts[i].size());
  }
  const int64_t room = ctx.max_model_len - int64_t(longest);
  if (v) {
    const int64_t m = as_int(*v, name, lo, std::numeric_limits<int32_t>::max());
    if (m > room)
      throw invalid_field(name,
                          fmt::format("this model's maximum context length is {} tokens; the "
                                      "prompt has {} and '{}' asks for {} more",
                                      ctx.max_model_len, longest, name, m),
                          "context_length_exceeded");
    r.sampling.max_tokens = int(m);
  } else {
    r.sampling.max_tokens = int(def > 0 ? std::min<int64_t>(def, room) : room);
  }
  if (int64_t(r.prompts.size()) * r.n > ctx.max_choices)
    throw invalid_field("n", fmt::format("{} prompts x n = {} choices; at most {} are allowed",
                                         r.prompts.size(), r.n, ctx.max_choices));
}

void final_check(CompletionRequest& r) {
  try {
    // max_tokens 0 (echo only) is checked above; SamplingParams wants >= 1.
    SamplingParams p = r.sampling;
    p.max_tokens = std::max(p.max_tokens, 1);
    p.validate();
  } catch (const Error& e) {
    throw invalid_field("", e.what());
  }
}

}  // namespace detail

void check_model_name(const json& j, const ParseContext& ctx) {
  const json* m = field(j, "model");
  if (!m) return;  // as vLLM: the served model when absent
  const std::string name = as_string(*m, "model");
  if (ctx.model_names.empty()) return;
  for (const std::string& n : ctx.model_names)
    if (n == name) return;
  throw ApiError(404,
                 fmt::format("the model '{}' does not exist; this server serves '{}'", name,
                             ctx.model_names.front()),
                 "model", "model_not_found");
}

CompletionRequest parse_completion_request(std::string_view body, const ParseContext& ctx) {
  const json j = parse_json_body(body, ctx.max_json_depth);
  CompletionRequest r;
  r.kind = RequestKind::kCompletion;
  parse_common(j, ctx, r);
  r.echo = get_bool(j, "echo", false);
  if (const json* lp = field(j, "logprobs")) {
    r.logprobs = true;
    r.top_logprobs = int(as_int(*lp, "logprobs", 0, 20));
  }
  reject_if_given(j, "suffix", "this model does no fill-in-the-middle");
  const json* p = field(j, "prompt");
  if (!p) throw invalid_field("prompt", "'prompt' is required", "missing_required_parameter");
  if (p->is_string()) {
    r.prompts.push_back(ctx.generator->encode(p->get<std::string>()));
  } else if (p->is_array()) {
    if (p->empty()) throw invalid_field("prompt", "'prompt' is an empty list");
    const json& first = (*p)[0];
    if (first.is_number_integer()) {
      r.prompts.push_back(as_ids(*p, "prompt", ctx.vocab_size));
    } else {
      for (size_t i = 0; i < p->size(); ++i) {
        const json& e = (*p)[i];
        const std::string param = "prompt." + std::to_string(i);
        if (first.is_string())
          r.prompts.push_back(ctx.generator->encode(as_string(e, param)));
        else if (first.is_array())
          r.prompts.push_back(as_ids(e, param, ctx.vocab_size));
        else
          throw invalid_field("prompt",
                              "'prompt' must be a string, a list of strings, a list of token ids "
                              "or a list of lists of token ids",
                              "invalid_type");
      }
    }
  } else {
    throw invalid_field("prompt",
                        fmt::format("'prompt' must be a string or a list, not {}", type_name(*p)),
                        "invalid_type");
  }
  if (int64_t(r.prompts.size()) > ctx.max_choices)
    throw invalid_field("prompt", fmt::format("{} prompts; at most {} are allowed",
                                              r.prompts.size(), ctx.max_choices));
  parse_length(j, ctx, r, /*def=*/16);  // OpenAI's default for completions
  final_check(r);
  // Structured outputs: the whole continuation, then a stop token (no template around it).
  if (std::optional<StructuredOutput> so = parse_structured_outputs(j)) {
    std::vector<ConstraintElement> el(2);
    el[0] = std::move(so->body);
    el[1].kind = ConstraintElement::Kind::kStop;
    el[1].stop_ids = r.sampling.stop_token_ids;
    r.constraint = std::make_shared<const ConstraintProgram>(std::move(el));
  }
  return r;
}

}  // namespace md::server
