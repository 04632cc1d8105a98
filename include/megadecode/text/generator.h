// Text in, text out: prompt text (raw or a chat) -> token ids -> prefill + sampled decode ->
// streamed text, with stop tokens, stop strings and max tokens. Used by `run`, `chat` and the
// server. Keeps one sequence whose fed tokens are remembered, so a follow-up prompt that extends
// them (the next chat turn) only prefills the new suffix.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/engine/model.h"
#include "megadecode/engine/sampler.h"
#include "megadecode/tokenizer/chat_template.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace md {

struct GenerationResult {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> tokens;  // generated ids (the stop token included if one was sampled)
  std::string text;             // the emitted text (stop strings removed)
  std::string finish_reason;    // "stop" (stop token or string), "length" or "cancelled"
  int prefilled = 0;            // prompt tokens actually run (the rest were reused)
  double prefill_seconds = 0, decode_seconds = 0;
  double decode_tokens_per_second() const;
};

class Generator {
 public:
  // `chat_template`: a template kind name overriding the checkpoint's (empty: detect it from the
  // checkpoint's tokenizer_config.json; an unknown template is an error only when chat is used).
  Generator(Model& model, const Tokenizer& tokenizer, std::string chat_template = "");

  // The checkpoint's stop ids: eos ids from config.json and the template's end-of-message token.
  std::vector<int32_t> default_stop_ids() const;

  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  std::vector<int32_t> encode(std::string_view text) const { return tok_.encode(text, true); }

  // Generates from prompt ids. on_text receives each piece of text as soon as it is safe to show
  // (complete UTF-8, not possibly the start of a stop string); returning false cancels.
  // params.stop_token_ids is used as given (add default_stop_ids() for the usual behaviour).
  GenerationResult generate(const std::vector<int32_t>& prompt, const SamplingParams& params,
                            const std::function<bool(std::string_view)>& on_text = {});

  void reset();  // forget the sequence
  const Tokenizer& tokenizer() const { return tok_; }
  Model& model() { return model_; }

 private:
  Model& model_;
  const Tokenizer& tok_;
  std::optional<TemplateKind> kind_;
  std::string kind_error_;
  SequenceState seq_;
  std::vector<int32_t> fed_;  // ids the sequence state has consumed
};

}  // namespace md
