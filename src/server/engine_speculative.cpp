// The engine loop's speculative steps (engine_loop.h, docs/server.md "Speculative decoding"):
// every decoding slot verifies its drafts in one plan step, prompt chunks riding along.
#include <fmt/format.h>

#include "engine_slot.h"
#include "megadecode/base/util.h"

namespace md::server {

// Every decoding slot verifies its anchor and K drafts in one plan step
// (SpeculativeDecoder::step_batch), and the tokens it emits go through take_token one by one, so
// a stop id, stop string or limit ends the slot exactly where plain decoding would (the sequence
// is committed to match). The step's gap since the slot's last tokens is shared by the tokens it
// emitted, for the inter-token latency histogram. Waiting prompts feed a chunk in the same step
// (SpecExtra), capped at kMaxChainedRows and the row log's rows (the step keeps every row for a
// commit), so running streams keep speculating while a prompt goes in.
void EngineLoop::speculative_step(bool prefilling) {
  std::vector<Slot*> dec;
  for (auto& sp : slots_)
    if (!sp->prefilling()) dec.push_back(sp.get());
  const size_t B = dec.size();
  std::vector<SpecSeq> batch(B);
  std::vector<ChoiceEvent> events(B);
  std::vector<int> emitted(B, 0);
  std::vector<char> running(B, 1);
  double t = 0;
  for (size_t b = 0; b < B; ++b) {
    Slot& s = *dec[b];
    SpecSeq& q = batch[b];
    q.seq = &s.seq;
    q.history = &s.history;
    q.sampler = s.sampler.get();
    q.drafter = s.drafter.get();
    q.logits = s.top_logprobs >= 0;
    q.emit = [&, b](int32_t id, std::span<const float> row) {
      if (emitted[b]++ == 0) t = now_seconds();
      running[b] = take_token(*dec[b], id, row, t, -1, events[b], true);
      return bool(running[b]);
    };
  }
  // The prompt rows riding along, their tokens, logits (for logprobs) and aux rows.
  std::vector<Part> parts;
  std::vector<StepSeq> pseqs;
  std::vector<SampleRow> prows;
  int plogits = 0;
  if (prefilling) {
    const int cap =
        std::min({opt_.prefill_chunk, plan::kMaxChainedRows, ex_.states().options().commit_rows});
    add_prompt_parts(cap, cap, parts, pseqs, prows, plogits);
  }
  const size_t V = size_t(ex_.model().config().vocab_size);
  bool want_logits = false;
  int prompt_rows = 0;
  for (const Part& p : parts) {
    want_logits =
        want_logits || p.slot->top_logprobs >= 0 || p.slot->prompt_logprobs || keeps_logits(p);
    prompt_rows += p.rows;
  }
  std::vector<int32_t> pnext(size_t(std::max(plogits, 1)), -1);
  if (want_logits && logits_.size() < size_t(plogits) * V) logits_.resize(size_t(plogits) * V);
  const size_t aux_width = aux_layers_.size() * size_t(ex_.model().config().hidden_size);
  aux_.assign(size_t(prompt_rows) * aux_width, 0.0f);
  SpecExtra extra;
  extra.seqs = pseqs;
  extra.sampling = prows;
  extra.next_ids = pnext.data();
  extra.logits = want_logits ? logits_.data() : nullptr;
  extra.aux = aux_;

  const SpeculativeStats before = spec_->stats();
  const double t_step = now_seconds();
  try {
    spec_->step_batch(batch, extra);
  } catch (const std::exception& e) {
    // Bad state (a budget, the watchdog): the sequences of this step cannot go on.
    for (size_t b = 0; b < B; ++b) {
      if (dec[b]->done) continue;
      ChoiceEvent ev = std::move(events[b]);
      ev.error = fmt::format("the engine failed: {}", e.what());
      ev.choice = dec[b]->choice;
      retire(*dec[b], std::move(ev));
    }
    fail_parts(parts, e.what());
    return;
  }
  const double t_end = now_seconds();
  counters_.steps.fetch_add(1);
  const SpeculativeStats& after = spec_->stats();
  counters_.spec_drafts.fetch_add(after.steps - before.steps);
  counters_.spec_draft_tokens.fetch_add(after.drafted - before.drafted);
  counters_.spec_accepted_tokens.fetch_add(after.accepted - before.accepted);
  for (size_t k = 0; k < after.accepted_at.size(); ++k)
    counters_.spec_accepted_at[k].fetch_add(after.accepted_at[k] - before.accepted_at[k]);
  if (obs_.step)
    obs_.step(t_end - t_step, int(B) * (spec_->options().num_draft_tokens + 1) + prompt_rows);
  if (obs_.decode_batch) obs_.decode_batch(int(B));
  for (size_t b = 0; b < B; ++b) {
    Slot& s = *dec[b];
    if (emitted[b] > 0 && obs_.inter_token_latency) {
      const double gap = (t - s.t_last) / emitted[b];
      // The first token's latency was not observed by take_token (gap -1), nor the others'.
      for (int i = 0; i < emitted[b]; ++i) obs_.inter_token_latency(gap);
    }
    s.t_last = t;
    if (running[b] && !s.done) send_tokens(s, std::move(events[b]), false);
  }
  // The prompt parts: their drafters observe the rows, then the prompt bookkeeping (and the
  // first token where a prompt ended).
  observe_parts(parts, pseqs, aux_width);
  end_parts(parts, want_logits ? logits_.data() : nullptr, pnext.data(), prows);
}

}  // namespace md::server
