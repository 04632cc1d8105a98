#include "megadecode/text/generator.h"

#include <algorithm>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"

namespace md {

double GenerationResult::decode_tokens_per_second() const {
  return decode_seconds > 0 && tokens.size() > 1 ? double(tokens.size() - 1) / decode_seconds : 0;
}

Generator::Generator(Model& model, const Tokenizer& tokenizer, std::string chat_template)
    : model_(model), tok_(tokenizer), seq_(model.new_sequence()) {
  MD_CHECK(tok_.vocab_size() <= model.config().vocab_size,
           "tokenizer has {} ids but the model's vocabulary is {}", tok_.vocab_size(),
           model.config().vocab_size);
  try {
    kind_ = chat_template.empty() ? detect_template(tok_.chat_template())
                                  : template_from_name(chat_template);
  } catch (const Error& e) {
    kind_error_ = e.what();  // reported when a chat is rendered, not for raw prompts
  }
}

std::vector<int32_t> Generator::default_stop_ids() const {
  std::vector<int32_t> ids;
  for (int64_t e : model_.config().eos_token_ids) ids.push_back(int32_t(e));
  if (auto e = tok_.eos_id()) ids.push_back(*e);
  if (auto e = tok_.special_id("<|im_end|>")) ids.push_back(*e);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

std::string Generator::render(const std::vector<ChatMessage>& messages,
                              bool add_generation_prompt) const {
  MD_CHECK(kind_.has_value(), "{}", kind_error_);
  return render_chat(*kind_, messages, add_generation_prompt);
}

void Generator::reset() {
  seq_ = model_.new_sequence();
  fed_.clear();
}

GenerationResult Generator::generate(const std::vector<int32_t>& prompt,
                                     const SamplingParams& params,
                                     const std::function<bool(std::string_view)>& on_text) {
  params.validate();
  MD_CHECK(!prompt.empty(), "the prompt is empty (no tokens to start from)");
  const int64_t V = model_.config().vocab_size;
  for (int32_t id : prompt)
    MD_CHECK(id >= 0 && id < V, "prompt token id {} is outside the vocabulary [0, {})", id, V);
  GenerationResult r;
  r.prompt_ids = prompt;

  // Reuse the sequence when the prompt extends what it has consumed (at least one new token must
  // run to produce logits); otherwise start over.
  bool extends = fed_.size() < prompt.size() &&
                 std::equal(fed_.begin(), fed_.end(), prompt.begin());
  if (!extends) reset();
  std::vector<int32_t> todo(prompt.begin() + std::ptrdiff_t(fed_.size()), prompt.end());
  std::vector<float> logits(size_t(V), 0.0f);
  double t0 = now_seconds();
  model_.forward(seq_, todo, logits.data(), false);
  fed_.insert(fed_.end(), todo.begin(), todo.end());
  r.prefilled = int(todo.size());
  double t1 = now_seconds();
  r.prefill_seconds = t1 - t0;

  Sampler sampler(params, V);
  std::vector<int32_t> history = prompt;
  sampler.set_prompt_length(history.size());
  StreamDecoder dec(tok_, /*skip_special=*/true);
  StopMatcher stops(params.stop_strings);
  auto emit = [&](const std::string& piece) {
    if (piece.empty()) return true;
    r.text += piece;
    return on_text ? on_text(piece) : true;
  };
  r.finish_reason = "length";
  for (int i = 0; i < params.max_tokens; ++i) {
    int32_t next = sampler.sample(logits, history);
    r.tokens.push_back(next);
    history.push_back(next);
    if (std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), next) !=
        params.stop_token_ids.end()) {
      r.finish_reason = "stop";
      break;
    }
    auto out = stops.feed(dec.push(next));
    bool keep_going = emit(out.text);
    if (out.stopped) {
      r.finish_reason = "stop";
      break;
    }
    if (!keep_going) {
      r.finish_reason = "cancelled";
      break;
    }
    if (i + 1 == params.max_tokens) break;
    model_.forward(seq_, std::span(&next, 1), logits.data(), false);
    fed_.push_back(next);
  }
  if (r.finish_reason != "cancelled") {
    // Release what was held back: an incomplete character at the end, or text that could still
    // have begun a stop string.
    emit(stops.feed(dec.flush()).text);
    if (!stops.stopped()) emit(stops.flush());
  }
  r.decode_seconds = now_seconds() - t1;
  return r;
}

}  // namespace md
