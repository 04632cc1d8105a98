// The engine loop's running sequences (engine_loop.h), shared by its source files: a slot is one
// admitted choice, its sequence and sampler, its text stream and what it has produced.
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include "megadecode/server/engine_loop.h"
#include "megadecode/text/text_stream.h"

namespace md::server {

struct EngineLoop::Slot {
  std::shared_ptr<RequestStream> stream;
  int choice = 0;
  ChoiceSpec spec;
  int top_logprobs = -1;
  bool prompt_logprobs = false;
  SequenceState seq;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<TokenTextStream> text;
  std::vector<int32_t> history;  // prompt + generated
  size_t fed = 0;                // prompt tokens the sequence has consumed
  int64_t cached = 0;            // of them, restored from the prefix cache
  size_t keep_at = 0;            // > fed: keep a state there (a chunk ends there)
  // The whole prompt restored from the prefix cache: the logits its first token is drawn from
  // (at the next step, on the host; empty: none pending).
  std::vector<float> cached_logits;
  bool fork = false;  // Pending::fork
  int32_t next = -1;  // the last sampled id, fed by the next step
  int generated = 0;
  double t_last = 0;
  bool done = false;
  std::vector<TokenLogprob> prompt_lp;
  ChoiceEvent pending;                        // tokens held for --stream-interval
  std::unique_ptr<Drafter> drafter;           // speculative decoding: this sequence's
  std::optional<TokenConstraint> constraint;  // spec.constraint's state
  bool prefilling() const { return fed < spec.prompt.size(); }
  // The constraint still decides tokens (its steps are plain, with the logits on the host).
  bool constrained() const {
    return constraint && !constraint->finished() && !constraint->broken();
  }
  // The token is drawn on the host from the step's logit row: a constraint that still decides,
  // or a logit bias (plain steps, never speculative, while this holds).
  bool host_draw() const { return constrained() || !spec.logit_bias.empty(); }
};

}  // namespace md::server
