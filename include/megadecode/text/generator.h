// Text in, text out: prompt text (raw or a chat) -> token ids -> prefill + sampled decode ->
// streamed text, with stop tokens, stop strings and max tokens. Used by `run` and `chat`.
// Keeps one sequence whose fed tokens are remembered, so a follow-up prompt that extends
// them (the next chat turn) only prefills the new suffix.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/engine/constrained_draw.h"
#include "megadecode/engine/model.h"
#include "megadecode/engine/sampler.h"
#include "megadecode/exec/executor.h"
#include "megadecode/spec/speculative.h"
#include "megadecode/tokenizer/chat_template.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace md {

struct GenerationResult {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> tokens;  // generated ids (the stop token included if one was sampled)
  std::string text;             // the emitted text (stop strings removed); for Kimi K3 output
                                // the response channel (and anything outside a channel)
  std::string reasoning;        // Kimi K3: the think channel's text (not in `text`)
  std::string finish_reason;    // "stop" (stop token or string), "length" or "cancelled"
  int prefilled = 0;            // prompt tokens actually run (the rest were reused)
  bool speculative = false;     // decoded by speculative steps (set_speculative)
  SpeculativeStats speculative_stats;  // this generation's steps
  double prefill_seconds = 0, decode_seconds = 0;
  double decode_tokens_per_second() const;
};

// Follows the channel structure of Kimi K3 "XTML" output, token by token: <|open|>NAME…<|sep|>
// opens and <|close|>NAME<|sep|> closes a section. Text in a `think` section is reasoning, text
// in a `response` section (or outside any) is the answer; the markup of `message`, `think` and
// `response` is dropped, other sections (tool calls) are kept as their markup text. Enabled when
// the tokenizer has <|open|>, <|close|> and <|sep|>; otherwise feed() always returns false.
class XtmlChannels {
 public:
  enum class Channel { kNone, kThink, kResponse };
  explicit XtmlChannels(const Tokenizer& tokenizer);
  bool enabled() const { return enabled_; }
  // Takes `id` when it is markup (a structure token or a tag's text) and returns true; markup text
  // to show (of a non-channel tag) is appended to `shown`. Returns false for content ids.
  bool feed(int32_t id, std::string& shown);
  Channel channel() const { return channel_; }

 private:
  const Tokenizer& tok_;
  bool enabled_ = false;
  int32_t open_ = -1, close_ = -1, sep_ = -1, end_ = -1;
  bool in_tag_ = false, opening_ = false;
  std::string tag_;
  Channel channel_ = Channel::kNone;
};

class Generator {
 public:
  // `chat_template`: a template kind name overriding the checkpoint's (empty: detect it from the
  // checkpoint's tokenizer_config.json; an unknown template is an error only when chat is used).
  Generator(Model& model, const Tokenizer& tokenizer, std::string chat_template = "");

  // The checkpoint's stop ids: eos ids from config.json and the templates' end-of-message tokens
  // (<|im_end|>, Kimi K3's <|end_of_msg|>) that the tokenizer has.
  std::vector<int32_t> default_stop_ids() const;

  // The chat template kind in use; throws (the detection error) when there is none.
  TemplateKind template_kind() const;
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                     const ChatOptions& options = {}) const;
  std::vector<int32_t> encode(std::string_view text) const { return tok_.encode(text, true); }
  // The chat's prompt ids, tokenized the way the checkpoint's tokenizer does it: segment by
  // segment (render_chat_segments), message text without special tokens for Kimi K3. `tools`:
  // OpenAI function-tool declarations, rendered by the template.
  std::vector<int32_t> encode_chat(const std::vector<ChatMessage>& messages,
                                   bool add_generation_prompt, const ChatOptions& options = {},
                                   const std::vector<nlohmann::json>& tools = {}) const;

  // Generates from prompt ids. on_text receives each piece of text as soon as it is safe to show
  // (complete UTF-8, not possibly the start of a stop string); returning false cancels.
  // on_reasoning likewise receives Kimi K3 think-channel text (stop strings do not apply to it).
  // params.stop_token_ids is used as given (add default_stop_ids() for the usual behaviour).
  GenerationResult generate(const std::vector<int32_t>& prompt, const SamplingParams& params,
                            const std::function<bool(std::string_view)>& on_text = {},
                            const std::function<bool(std::string_view)>& on_reasoning = {});

  // Run through a decode-plan executor (megakernel or opbyop, built on the same model) instead
  // of Model::forward: the prompt goes through the plan in steps of `prefill_chunk` rows, then
  // each decode step runs the plan, whose sample instruction draws the next token with this
  // generation's sampler. nullptr: the reference path. The plan's rows compute what the
  // reference path computes one token at a time, bit for bit; the reference's one-call prefill
  // differs from that in fp32 order only, so the tokens can differ only where two logits
  // are within rounding of each other. The sequence starts over in the executor's state pool.
  // Drops a speculative decoder set before (it ran on the old executor).
  void set_executor(Executor* executor, int prefill_chunk = 16) {
    spec_.reset();
    executor_ = executor;
    prefill_chunk_ = prefill_chunk;
    reset();
  }

  // Decode by speculative steps (spec/speculative.h) with this drafter on the executor set by
  // set_executor (required); null: plain decode steps again. The emitted tokens are those plain
  // decoding gives (greedy: the same ids; sampling: the same distribution, another draw of it).
  // The drafter outlives its use here.
  void set_speculative(Drafter* drafter, const SpeculativeOptions& options = {});
  // Totals over every generation since set_speculative (null when not speculative).
  const SpeculativeStats* speculative_stats() const {
    return spec_ ? &spec_->stats() : nullptr;
  }

  // Hold the following generations' tokens to a constraint program (engine/token_constraint.h:
  // a grammar, a regex, a JSON schema, a choice, as the server builds them); null: none. Each
  // generate() starts the program over. Not with speculative decoding (generate() refuses it).
  void set_constraint(std::shared_ptr<const ConstraintProgram> program) {
    constraint_ = std::move(program);
  }

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
  Executor* executor_ = nullptr;
  int prefill_chunk_ = 16;
  std::unique_ptr<SpeculativeDecoder> spec_;
  std::shared_ptr<const ConstraintProgram> constraint_;
  std::shared_ptr<const ConstraintVocab> constraint_vocab_;  // built at the first constraint
  ConstrainedDrawScratch draw_scratch_;
};

}  // namespace md
