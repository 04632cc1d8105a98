#include "megadecode/text/generator.h"

#include <algorithm>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/text/text_stream.h"

namespace md {

double GenerationResult::decode_tokens_per_second() const {
  return decode_seconds > 0 && tokens.size() > 1 ? double(tokens.size() - 1) / decode_seconds : 0;
}

XtmlChannels::XtmlChannels(const Tokenizer& tokenizer) : tok_(tokenizer) {
  auto o = tok_.special_id("<|open|>"), c = tok_.special_id("<|close|>"),
       s = tok_.special_id("<|sep|>");
  enabled_ = o && c && s;
  if (!enabled_) return;
  open_ = *o;
  close_ = *c;
  sep_ = *s;
  end_ = tok_.special_id(kKimiK3EndOfMessage).value_or(-1);
}

bool XtmlChannels::feed(int32_t id, std::string& shown) {
  if (!enabled_) return false;
  if (id == open_ || id == close_) {
    in_tag_ = true;
    opening_ = id == open_;
    tag_.clear();
    return true;
  }
  if (id == end_) {
    in_tag_ = false;
    channel_ = Channel::kNone;
    return true;
  }
  if (!in_tag_) return id == sep_;  // a stray <|sep|> is markup too
  if (id != sep_) {
    tag_ += tok_.token_bytes(id);
    return true;
  }
  in_tag_ = false;
  const std::string name = tag_.substr(0, tag_.find(' '));
  if (name == "think" || name == "response") {
    channel_ = !opening_ ? Channel::kNone : name == "think" ? Channel::kThink : Channel::kResponse;
  } else if (name == "message") {
    channel_ = Channel::kNone;
  } else {
    shown += opening_ ? "<|open|>" : "<|close|>";
    shown += tag_;
    shown += "<|sep|>";
  }
  return true;
}

Generator::Generator(Model& model, const Tokenizer& tokenizer, std::string chat_template)
    : model_(model), tok_(tokenizer), seq_(model.new_sequence()) {
  MD_CHECK(tok_.vocab_size() <= model.config().vocab_size,
           "tokenizer has {} ids but the model's vocabulary is {}", tok_.vocab_size(),
           model.config().vocab_size);
  try {
    // A checkpoint without a template whose tokenizer has Kimi K3's structure tokens is K3.
    kind_ =
        chat_template.empty()
            ? detect_template(tok_.chat_template(),
                              [this](std::string_view t) { return tok_.special_id(t).has_value(); })
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
  if (auto e = tok_.special_id(kKimiK3EndOfMessage)) ids.push_back(*e);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

TemplateKind Generator::template_kind() const {
  MD_CHECK(kind_.has_value(), "{}", kind_error_);
  return *kind_;
}

std::string Generator::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                              const ChatOptions& options) const {
  return render_chat(template_kind(), messages, add_generation_prompt, {}, options);
}

std::vector<int32_t> Generator::encode_chat(const std::vector<ChatMessage>& messages,
                                            bool add_generation_prompt, const ChatOptions& options,
                                            const std::vector<nlohmann::json>& tools) const {
  std::vector<int32_t> ids;
  for (const ChatSegment& s :
       render_chat_segments(template_kind(), messages, add_generation_prompt, tools, options)) {
    std::vector<int32_t> part = tok_.encode(s.text, s.allow_special);
    ids.insert(ids.end(), part.begin(), part.end());
  }
  return ids;
}

void Generator::set_speculative(Drafter* drafter, const SpeculativeOptions& options) {
  spec_.reset();
  if (!drafter) return;
  MD_CHECK(executor_, "speculative decoding needs a plan executor (megakernel or opbyop)");
  SpeculativeOptions o = options;
  o.prefill_chunk = prefill_chunk_;
  spec_ = std::make_unique<SpeculativeDecoder>(*executor_, *drafter, o);
  reset();
}

void Generator::reset() {
  seq_ = SequenceState();  // the old slot back to its pool first
  seq_ = executor_ ? executor_->new_sequence() : model_.new_sequence();
  fed_.clear();
  if (spec_) spec_->reset();
}

GenerationResult Generator::generate(const std::vector<int32_t>& prompt,
                                     const SamplingParams& params,
                                     const std::function<bool(std::string_view)>& on_text,
                                     const std::function<bool(std::string_view)>& on_reasoning) {
  params.validate();
  MD_CHECK(!prompt.empty(), "the prompt is empty (no tokens to start from)");
  const int64_t V = model_.config().vocab_size;
  for (int32_t id : prompt)
    MD_CHECK(id >= 0 && id < V, "prompt token id {} is outside the vocabulary [0, {})", id, V);
  GenerationResult r;
  r.prompt_ids = prompt;

  // Reuse the sequence when the prompt extends what it has consumed (at least one new token must
  // run to produce logits); otherwise start over.
  bool extends =
      fed_.size() < prompt.size() && std::equal(fed_.begin(), fed_.end(), prompt.begin());
  if (!extends) reset();
  std::vector<int32_t> todo(prompt.begin() + std::ptrdiff_t(fed_.size()), prompt.end());
  std::vector<float> logits(size_t(V), 0.0f);
  double t0 = now_seconds();
  if (spec_)
    spec_->prefill(seq_, todo, logits.data());
  else if (executor_)
    executor_->prefill(seq_, todo, logits.data(), prefill_chunk_);
  else
    model_.forward(seq_, todo, logits.data(), false);
  fed_.insert(fed_.end(), todo.begin(), todo.end());
  r.prefilled = int(todo.size());
  double t1 = now_seconds();
  r.prefill_seconds = t1 - t0;

  Sampler sampler(params, V);
  std::vector<int32_t> history = prompt;
  sampler.set_prompt_length(history.size());
  TokenTextStream out(tok_, params.stop_strings, prompt);
  // Hands a token's released text to the callbacks; false cancels.
  auto deliver = [&](const TextDelta& d) {
    r.reasoning += d.reasoning;
    r.text += d.text;
    bool keep_going = true;
    if (!d.reasoning.empty() && on_reasoning) keep_going = on_reasoning(d.reasoning);
    if (keep_going && !d.text.empty() && on_text) keep_going = on_text(d.text);
    return keep_going;
  };
  r.finish_reason = "length";
  // Takes the next generated token (already appended to history); false ends the generation.
  auto take = [&](int32_t next) {
    r.tokens.push_back(next);
    if (std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), next) !=
        params.stop_token_ids.end()) {
      r.finish_reason = "stop";
      return false;
    }
    const TextDelta d = out.push(next);
    const bool keep_going = deliver(d);
    if (d.stopped) {
      r.finish_reason = "stop";
      return false;
    }
    if (!keep_going) {
      r.finish_reason = "cancelled";
      return false;
    }
    return int(r.tokens.size()) < params.max_tokens;
  };
  // A constraint (set_constraint): every token drawn on the host from the masked logits by the
  // step's SampleRow, as the server's engine loop draws them (engine/constrained_draw.h).
  std::optional<TokenConstraint> constraint;
  if (constraint_) {
    MD_CHECK(!spec_,
             "constrained decoding (a grammar, regex, JSON schema or choice) runs without "
             "speculative decoding");
    if (!constraint_vocab_) constraint_vocab_ = std::make_shared<const ConstraintVocab>(tok_, V);
    constraint.emplace(constraint_, constraint_vocab_);
  }
  auto draw = [&](const SampleRow& row, int32_t drawn) {
    const int32_t id = constrained_draw(&*constraint, {}, logits, row, drawn, draw_scratch_);
    constraint->accept(id);
    return id;
  };
  // The first token comes from the prompt's logits; the sequence has consumed all of history but
  // its last token from then on.
  history.push_back(constraint ? draw(sampler.prepare(history), -1)
                               : sampler.sample(logits, history));
  if (spec_) {
    const SpeculativeStats before = spec_->stats();
    r.speculative = true;
    if (take(history.back()))
      while (spec_->step(seq_, history, &sampler, take)) {
      }
    const SpeculativeStats& after = spec_->stats();
    SpeculativeStats& d = r.speculative_stats;
    d.steps = after.steps - before.steps;
    d.drafted = after.drafted - before.drafted;
    d.accepted = after.accepted - before.accepted;
    d.emitted = after.emitted - before.emitted;
    d.draft_seconds = after.draft_seconds - before.draft_seconds;
    d.verify_seconds = after.verify_seconds - before.verify_seconds;
    d.accept_seconds = after.accept_seconds - before.accept_seconds;
    d.commit_seconds = after.commit_seconds - before.commit_seconds;
  } else {
    int32_t planned = -1;  // the next id the executor's plan sampled, if any
    while (take(history.back())) {
      const int32_t next = history.back();
      std::optional<SampleRow> row;
      if (executor_) {
        SequenceState* sp = &seq_;
        row = sampler.prepare(history);  // plain data the plan samples with
        executor_->step(std::span(&sp, 1), std::span(&next, 1), logits.data(), &planned,
                        std::span(&*row, 1));
      } else {
        model_.forward(seq_, std::span(&next, 1), logits.data(), false);
      }
      if (constraint)
        history.push_back(draw(row ? *row : sampler.prepare(history), planned));
      else
        history.push_back(planned >= 0 ? planned : sampler.sample(logits, history));
      planned = -1;
    }
  }
  fed_.assign(history.begin(), history.end() - 1);
  if (r.finish_reason != "cancelled") {
    // Release what was held back: an incomplete character at the end, or text that could still
    // have begun a stop string.
    deliver(out.finish());
  }
  r.decode_seconds = now_seconds() - t1;
  return r;
}

}  // namespace md
