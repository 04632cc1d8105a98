#include "megadecode/server/engine_loop.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>

#include "engine_slot.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/server/request.h"
#include "megadecode/text/text_stream.h"

namespace md::server {

// ---- RequestStream -----------------------------------------------------------------------------

void RequestStream::push(ChoiceEvent e) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (e.finish_reason || !e.error.empty()) --open_;
    if (consumer_) {
      consumer_(std::move(e), open_ <= 0);
      return;
    }
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

void RequestStream::set_consumer(Consumer consumer) {
  std::lock_guard<std::mutex> lk(mu_);
  consumer_ = std::move(consumer);
  while (!events_.empty()) {
    ChoiceEvent e = std::move(events_.front());
    events_.pop_front();
    consumer_(std::move(e), open_ <= 0 && events_.empty());
  }
}

bool RequestStream::next(ChoiceEvent& out, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return !events_.empty(); }))
    return false;
  out = std::move(events_.front());
  events_.pop_front();
  return true;
}

bool RequestStream::finished() const {
  std::lock_guard<std::mutex> lk(mu_);
  return open_ <= 0 && events_.empty();
}

// ---- log-probabilities -------------------------------------------------------------------------

namespace {

// The model's log-probability of `id` under a logit row (log-softmax in double, the raw logits
// before penalties and temperature, as vLLM reports them) and the `top` most likely ids.
TokenLogprob token_logprob(std::span<const float> row, int32_t id, int top) {
  float mx = -INFINITY;
  for (float x : row) mx = std::max(mx, x);
  double sum = 0;
  for (float x : row) sum += std::exp(double(x) - mx);
  const double lse = double(mx) + std::log(sum);
  TokenLogprob t;
  t.id = id;
  t.logprob = float(double(row[size_t(id)]) - lse);
  if (top > 0) {
    std::vector<int32_t> ids(row.size());
    std::iota(ids.begin(), ids.end(), 0);
    const size_t k = std::min(size_t(top), ids.size());
    // Ties to the lower id, so the list is deterministic.
    std::partial_sort(
        ids.begin(), ids.begin() + std::ptrdiff_t(k), ids.end(), [&](int32_t a, int32_t b) {
          return row[size_t(a)] > row[size_t(b)] || (row[size_t(a)] == row[size_t(b)] && a < b);
        });
    for (size_t i = 0; i < k; ++i)
      t.top.emplace_back(ids[i], float(double(row[size_t(ids[i])]) - lse));
  }
  return t;
}

double now() {
  return now_seconds();
}

}  // namespace

// ---- EngineLoop --------------------------------------------------------------------------------

namespace {
// Appends `more` to `into`: the later tokens, text and logprobs after the earlier ones.
void append_event(ChoiceEvent& into, ChoiceEvent&& more) {
  into.choice = more.choice;
  into.tokens.insert(into.tokens.end(), more.tokens.begin(), more.tokens.end());
  into.text += more.text;
  into.reasoning += more.reasoning;
  into.logprobs.insert(into.logprobs.end(), std::make_move_iterator(more.logprobs.begin()),
                       std::make_move_iterator(more.logprobs.end()));
  if (!more.prompt_logprobs.empty()) into.prompt_logprobs = std::move(more.prompt_logprobs);
  into.finish_reason = std::move(more.finish_reason);
  into.stop_string = std::move(more.stop_string);
  into.error = std::move(more.error);
  into.prompt_tokens = more.prompt_tokens;
  into.completion_tokens = more.completion_tokens;
  into.cached_tokens = more.cached_tokens;
}
}  // namespace

EngineLoop::EngineLoop(Executor& executor, const Tokenizer& tokenizer, EngineOptions options,
                       EngineObserver observer)
    : ex_(executor), tok_(tokenizer), opt_(options), obs_(std::move(observer)) {
  MD_CHECK(opt_.max_batch >= 1 && opt_.max_batch <= executor.max_batch(),
           "serve: --max-batch {} is outside 1..{} (the executor's batch)", opt_.max_batch,
           executor.max_batch());
  MD_CHECK(opt_.prefill_chunk >= 1 && opt_.prefill_chunk <= plan::kMaxRows,
           "serve: --prefill-chunk {} is outside 1..{}", opt_.prefill_chunk, plan::kMaxRows);
  MD_CHECK(opt_.max_queue >= 0, "serve: --max-queue must not be negative");
  MD_CHECK(opt_.max_model_len >= 2, "serve: --max-model-len must be at least 2");
  MD_CHECK(opt_.stream_interval >= 1, "serve: --stream-interval must be at least 1");
  for (int32_t id : opt_.test_forced_tokens)
    MD_CHECK(id >= 0 && id < executor.model().config().vocab_size,
             "test_forced_tokens: id {} is outside the vocabulary", id);
  if (opt_.make_drafter) {
    // Forced tokens would differ from the drafts the sequence consumed.
    MD_CHECK(opt_.test_forced_tokens.empty(), "test_forced_tokens exclude speculative decoding");
    const std::unique_ptr<Drafter> probe = opt_.make_drafter();
    MD_CHECK(probe, "serve: the speculative drafter factory gave no drafter");
    aux_layers_.assign(probe->aux_layers().begin(), probe->aux_layers().end());
    spec_ = std::make_unique<SpeculativeDecoder>(executor, aux_layers_, opt_.speculative);
    counters_.speculative = true;
  }
  MD_CHECK(opt_.prefix_cache >= 0, "serve: --prefix-cache must not be negative");
  if (opt_.prefix_cache > 0) {
    MD_CHECK(aux_layers_.empty(),
             "serve: the prefix cache does not run beside a drafter that observes the target's "
             "rows (a DSpark draft): --prefix-cache 0");
    const int slots = executor.states().max_sequences();
    MD_CHECK(opt_.max_batch + opt_.prefix_cache <= slots,
             "serve: --max-batch {} and --prefix-cache {} need {} state slots; the pool has {} "
             "(--max-sequences)",
             opt_.max_batch, opt_.prefix_cache, opt_.max_batch + opt_.prefix_cache, slots);
    cache_ = std::make_unique<PrefixCache>(
        executor.states(), opt_.prefix_cache, opt_.prefix_cache_min_tokens,
        [&executor](SequenceState& d, const SequenceState& s) { executor.copy_sequence(d, s); });
  }
  thread_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() {
  shutdown(0);
}

std::string EngineLoop::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failure_;
}

std::shared_ptr<RequestStream> EngineLoop::submit(EngineRequest request) {
  MD_CHECK(!request.choices.empty(), "a request needs at least one choice");
  auto stream = std::make_shared<RequestStream>(int(request.choices.size()));
  stream->submitted_at = now();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!accepting_) throw ApiError(503, "the server is shutting down", "", "server_shutting_down");
    const int64_t free_slots = opt_.max_batch - counters_.running.load();
    if (int64_t(queue_.size() + request.choices.size()) > opt_.max_queue + free_slots)
      throw ApiError(503,
                     fmt::format("the server is busy: {} requests wait for {} slots (--max-queue "
                                 "{}); retry later",
                                 queue_.size(), opt_.max_batch, opt_.max_queue),
                     "", "queue_full");
    const auto& cs = request.choices;
    for (size_t i = 0; i < cs.size(); ++i) {
      const bool fork = std::any_of(cs.begin() + std::ptrdiff_t(i) + 1, cs.end(),
                                    [&](const ChoiceSpec& c) { return c.prompt == cs[i].prompt; });
      queue_.push_back({stream, int(i), std::move(request.choices[i]), request.top_logprobs,
                        request.prompt_logprobs, fork});
    }
    counters_.waiting.store(int64_t(queue_.size()));
  }
  cv_.notify_all();
  return stream;
}

void EngineLoop::shutdown(double grace_seconds) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    accepting_ = false;
  }
  if (!thread_.joinable()) return;
  const double deadline = now() + grace_seconds;
  while (now() < deadline) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (queue_.empty() && counters_.running.load() == 0) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    abort_all_ = true;
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  cache_.reset();  // its states go back to the pool now, not after the executor is gone
}

void EngineLoop::run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty() || !slots_.empty(); });
      if (abort_all_) {
        for (Pending& p : queue_) {
          ChoiceEvent e;
          e.choice = p.choice;
          e.finish_reason = "abort";
          e.prompt_tokens = int(p.spec.prompt.size());
          p.stream->push(std::move(e));
        }
        queue_.clear();
        counters_.waiting.store(0);
      }
      if (stop_ && queue_.empty() && slots_.empty()) break;
    }
    try {
      admit();
      if (!slots_.empty()) step();
    } catch (const std::exception& e) {
      // Nothing above should throw past its own handling; if something does, the running
      // sequences end with the error rather than the process.
      for (auto& sp : slots_)
        if (!sp->done) {
          ChoiceEvent ev;
          ev.choice = sp->choice;
          ev.error = fmt::format("the engine failed: {}", e.what());
          retire(*sp, std::move(ev));
        }
      slots_.clear();
      std::lock_guard<std::mutex> lk(mu_);
      failure_ = e.what();
    }
  }
}

bool EngineLoop::admit() {
  bool any = false;
  std::lock_guard<std::mutex> lk(mu_);
  // In order, but past choices that wait for a sibling's state (they keep their place).
  for (size_t i = 0; int(slots_.size()) < opt_.max_batch && i < queue_.size();) {
    if (waits_for_sibling(queue_[i])) {
      ++i;
      continue;
    }
    Pending p = std::move(queue_[i]);
    queue_.erase(queue_.begin() + std::ptrdiff_t(i));
    auto s = std::make_unique<Slot>();
    s->stream = std::move(p.stream);
    s->choice = p.choice;
    s->spec = std::move(p.spec);
    s->top_logprobs = p.top_logprobs;
    s->prompt_logprobs = p.prompt_logprobs;
    s->fork = p.fork;
    if (s->stream->cancelled()) {  // the client left while it waited
      ChoiceEvent e;
      e.choice = s->choice;
      e.finish_reason = "abort";
      e.prompt_tokens = int(s->spec.prompt.size());
      s->stream->push(std::move(e));
      continue;
    }
    try {
      if (cache_) {
        cache_->free_a_slot();  // (the pool is sized so that this evicts nothing)
        count_cache();
      }
      s->seq = ex_.new_sequence();
      // max_tokens 0 (echo: the prompt only) never draws; the sampler wants at least 1.
      SamplingParams sp = s->spec.sampling;
      sp.max_tokens = std::max(sp.max_tokens, 1);
      s->sampler = std::make_unique<Sampler>(sp, ex_.model().config().vocab_size);
      s->sampler->set_prompt_length(s->spec.prompt.size());
      s->text = std::make_unique<TokenTextStream>(tok_, sp.stop_strings, s->spec.prompt);
      if (opt_.make_drafter) {
        s->drafter = opt_.make_drafter();
        s->drafter->reset();
      }
      if (s->spec.constraint) {
        // The vocabulary's bytes, grouped for the masks: built at the first constrained choice.
        if (!constraint_vocab_)
          constraint_vocab_ =
              std::make_shared<const ConstraintVocab>(tok_, ex_.model().config().vocab_size);
        s->constraint.emplace(s->spec.constraint, constraint_vocab_);
      }
      if (cache_) restore_prefix(*s);
    } catch (const std::exception& e) {  // a pool budget, parameters the engine refuses
      ChoiceEvent ev;
      ev.choice = s->choice;
      ev.error = e.what();
      s->stream->push(std::move(ev));
      continue;  // the slot's sequence (if taken) goes back with `s`
    }
    s->history = s->spec.prompt;
    s->t_last = now();
    slots_.push_back(std::move(s));
    counters_.running.fetch_add(1);
    any = true;
  }
  counters_.waiting.store(int64_t(queue_.size()));
  return any;
}

void EngineLoop::finish(Slot& s, const std::string& reason, ChoiceEvent e) {
  if (reason != "abort") {
    const TextDelta d = s.text->finish();
    e.text += d.text;
    e.reasoning += d.reasoning;
  }
  e.choice = s.choice;
  e.finish_reason = reason;
  e.prompt_tokens = int(s.spec.prompt.size());
  e.completion_tokens = s.generated;
  e.cached_tokens = int(s.cached);
  // A finished generation's state: after the prompt and every generated token but the last
  // (drawn, never fed). A chat's next turn starts with them.
  if (cache_ && reason != "abort" && !s.prefilling()) keep_prefix(s, s.history.size() - 1);
  // (Unless the first token took them: max_tokens 0, or an abort before any token.)
  if (s.prompt_logprobs && s.generated == 0 && e.prompt_logprobs.empty())
    e.prompt_logprobs = std::move(s.prompt_lp);
  retire(s, std::move(e));
  if (obs_.request_finished) obs_.request_finished(reason);
}

void EngineLoop::retire(Slot& s, ChoiceEvent e) {
  // The slot counts as free before the client hears of the end, so a client that saw its last
  // event never sees its sequence still running.
  s.done = true;
  counters_.running.fetch_sub(1);
  if (!s.pending.tokens.empty()) {  // what --stream-interval held goes out first
    append_event(s.pending, std::move(e));
    e = std::move(s.pending);
  }
  s.stream->push(std::move(e));
  events_pushed_ = true;
}

void EngineLoop::step() {
  bool abort_all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    abort_all = abort_all_;
  }
  for (auto& s : slots_)
    if (abort_all || s->stream->cancelled()) finish(*s, "abort", {});
  std::erase_if(slots_, [](const auto& s) { return s->done; });
  if (slots_.empty()) return;

  // The step: every decoding sequence's last token, and prefill chunks. While anything decodes,
  // the step's prompt rows are at most one chunk (--prefill-chunk), taken from the earliest
  // admitted prompts (several short ones may share it), so running streams wait at most one
  // chunk's time a step; with nothing decoding, every waiting prompt feeds a chunk.
  // Whole prompts restored from the prefix cache: their first tokens, from the cached logits.
  for (auto& s : slots_)
    if (!s->cached_logits.empty()) draw_from_cache(*s);
  std::erase_if(slots_, [](const auto& s) { return s->done; });
  if (slots_.empty()) return;

  bool decoding = false, prefilling = false;
  for (auto& s : slots_) {
    decoding = decoding || !s->prefilling();
    prefilling = prefilling || s->prefilling();
  }
  // A verify feeds K + 1 rows from the anchor's position: only while every sequence has room for
  // them within --max-model-len (the pool's budget per slot); near the end, plain rows.
  bool room = true;
  for (auto& s : slots_)
    room = room &&
           int64_t(s->history.size()) + opt_.speculative.num_draft_tokens <= opt_.max_model_len;
  // A constrained or biased choice draws on the host from its logits: plain steps while it lasts.
  for (auto& s : slots_) room = room && !s->host_draw();
  // Speculation goes on while prompts are fed: their chunks ride in the verify step, at most
  // kMaxChainedRows (and the row log's) rows a step, since that step keeps every row for a
  // commit; with nothing decoding, prompts feed whole chunks in plain steps.
  if (spec_ && decoding && room) return speculative_step(prefilling);
  std::vector<Part> parts;
  std::vector<StepSeq> seqs;
  std::vector<SampleRow> rows;
  int logit_rows = 0;
  for (auto& sp : slots_) {
    Slot& s = *sp;
    if (s.prefilling()) continue;
    parts.push_back({&s, 1, 1, logit_rows, true, s.seq.pos});
    seqs.push_back({&s.seq, std::span<const int32_t>(&s.next, 1), LogitRows::kLast});
    rows.push_back(s.sampler->prepare(s.history));
    logit_rows += 1;
  }
  add_prompt_parts(decoding ? opt_.prefill_chunk : 0, opt_.prefill_chunk, parts, seqs, rows,
                   logit_rows);

  // The logits come back only when a request asks for logprobs; otherwise the step returns just
  // the tokens it drew (a CUDA executor's logits then stay on the device). The buffer is kept
  // between steps (5 MB at batch 8 on a 163840-token vocabulary).
  const size_t V = size_t(ex_.model().config().vocab_size);
  bool want_logits = false;
  for (const Part& p : parts)
    want_logits = want_logits || p.slot->top_logprobs >= 0 || p.slot->prompt_logprobs ||
                  (p.samples && p.slot->host_draw()) || keeps_logits(p);
  if (want_logits && logits_.size() < size_t(logit_rows) * V)
    logits_.resize(size_t(logit_rows) * V);
  const std::vector<float>& logits = logits_;
  std::vector<int32_t> next_ids(std::max(logit_rows, 1), -1);
  // The drafters see every row the sequences consume (and the aux rows they ask for).
  StepOptions so;
  const size_t aux_width = aux_layers_.size() * size_t(ex_.model().config().hidden_size);
  if (aux_width > 0) {
    size_t fed = 0;
    for (const Part& p : parts) fed += size_t(p.rows);
    aux_.assign(fed * aux_width, 0.0f);
    so.aux = AuxCapture{aux_layers_, aux_.data()};
  }
  const double t_step = now();
  try {
    ex_.step(seqs, want_logits ? logits_.data() : nullptr, next_ids.data(), rows, so);
  } catch (const std::exception& e) {
    // Bad state (a budget, the watchdog): the sequences of this step cannot go on.
    fail_parts(parts, e.what());
    return;
  }
  counters_.steps.fetch_add(1);
  if (obs_.step) {
    int fed = 0;
    for (const Part& p : parts) fed += p.rows;
    obs_.step(now() - t_step, fed);
  }
  int decode_batch = 0;
  for (const Part& p : parts) decode_batch += p.slot->prefilling() ? 0 : 1;
  if (obs_.decode_batch && decode_batch > 0) obs_.decode_batch(decode_batch);

  if (spec_) observe_parts(parts, seqs, aux_width);
  end_parts(parts, want_logits ? logits.data() : nullptr, next_ids.data(), rows);
}

void EngineLoop::fail_parts(std::span<const Part> parts, const std::string& why) {
  for (const Part& p : parts) {
    ChoiceEvent ev;
    ev.error = fmt::format("the engine failed: {}", why);
    ev.choice = p.slot->choice;
    retire(*p.slot, std::move(ev));
  }
  std::lock_guard<std::mutex> lk(mu_);
  failure_ = why;
  std::erase_if(slots_, [](const auto& s) { return s->done; });
}

void EngineLoop::observe_parts(std::span<const Part> parts, std::span<const StepSeq> seqs,
                               size_t aux_width) {
  size_t at = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const size_t n = size_t(parts[i].rows);
    parts[i].slot->drafter->observe(
        seqs[i].tokens, parts[i].pos,
        aux_width > 0 ? std::span<const float>(aux_).subspan(at * aux_width, n * aux_width)
                      : std::span<const float>());
    at += n;
  }
}

void EngineLoop::end_parts(std::span<const Part> parts, const float* logits,
                           const int32_t* next_ids, std::span<const SampleRow> rows) {
  const double t = now();
  for (const Part& p : parts) after_part(p, logits, next_ids, rows, t);
  std::erase_if(slots_, [](const auto& s) { return s->done; });
  yield_to_readers();
}

void EngineLoop::yield_to_readers() {
  // This step's events woke their readers: clients on this host (whose sockets the engine
  // thread wrote), or HTTP threads. On a host whose cores all run spinning workers, a woken
  // thread preempts one of them in the middle of the next step, and the other workers wait for it
  // at a counter. Yielding here lets it run now, between steps, on this thread's core, while the
  // other workers only wait for the step to start. (Measured on 2 vCPUs: the preemptions of the
  // other worker fell from 1552-2529 to 83 over 4096 streamed tokens; bench/RESULTS.md.) With
  // nothing else runnable the yield returns at once.
  if (!events_pushed_) return;
  events_pushed_ = false;
  std::this_thread::yield();
}

// The prompt parts of a step: chunks of the earliest admitted prompts. budget > 0 (something
// decodes): at most `budget` prompt rows in all, from one or several prompts; budget 0: every
// waiting prompt feeds up to `chunk` rows.
void EngineLoop::add_prompt_parts(int budget, int chunk, std::vector<Part>& parts,
                                  std::vector<StepSeq>& seqs, std::vector<SampleRow>& rows,
                                  int& logit_rows) {
  const bool capped = budget > 0;
  for (auto& sp : slots_) {
    Slot& s = *sp;
    if (!s.prefilling()) continue;
    if (capped && budget == 0) break;
    const size_t left = s.spec.prompt.size() - s.fed;
    int n = int(std::min<size_t>(left, size_t(capped ? std::min(budget, chunk) : chunk)));
    if (s.keep_at > s.fed) n = int(std::min<size_t>(size_t(n), s.keep_at - s.fed));
    if (capped) budget -= n;
    const bool last = size_t(n) == left;
    const bool samples = last && s.spec.sampling.max_tokens > 0;
    const LogitRows lr = s.prompt_logprobs ? LogitRows::kAll
                         : last            ? LogitRows::kLast
                                           : LogitRows::kNone;
    const int nl = lr == LogitRows::kAll ? n : lr == LogitRows::kLast ? 1 : 0;
    parts.push_back({&s, n, nl, logit_rows, samples, s.seq.pos});
    seqs.push_back({&s.seq, std::span<const int32_t>(s.spec.prompt.data() + s.fed, size_t(n)), lr});
    for (int i = 0; i < nl; ++i)
      rows.push_back(samples && i == nl - 1 ? s.sampler->prepare(s.history) : SampleRow{});
    logit_rows += nl;
  }
}

// After a step: a part's prompt bookkeeping (rows fed, prompt logprobs, the end of its prompt)
// and the token its last logit row drew (next_ids / logits indexed by the part's logit rows).
void EngineLoop::after_part(const Part& p, const float* logits, const int32_t* next_ids,
                            std::span<const SampleRow> rows, double t) {
  const size_t V = size_t(ex_.model().config().vocab_size);
  {
    Slot& s = *p.slot;
    auto row = [&](int i) {
      return std::span<const float>(logits + size_t(p.first_logit + i) * V, V);
    };
    if (s.prefilling()) {
      if (s.prompt_logprobs)
        for (int i = 0; i < p.rows; ++i) {
          const size_t target = s.fed + size_t(i) + 1;  // the prompt token row i predicts
          if (target < s.spec.prompt.size())
            s.prompt_lp.push_back(
                token_logprob(row(i), s.spec.prompt[target], std::max(s.top_logprobs, 0)));
        }
      s.fed += size_t(p.rows);
      counters_.prompt_tokens.fetch_add(p.rows);
      if (cache_ && s.fed == s.keep_at) keep_prefix(s, s.fed);
      if (cache_ && !s.prefilling())
        keep_prefix(s, s.fed, logits ? row(p.logit_rows - 1) : std::span<const float>());
      if (s.prefilling()) return;
      if (!p.samples) {  // max_tokens 0: the prompt (and its logprobs) only
        finish(s, "length", {});
        return;
      }
    }
    const int last = p.first_logit + p.logit_rows - 1;
    int32_t id = next_ids[size_t(last)];
    if (s.host_draw()) id = host_draw(s, row(p.logit_rows - 1), rows[size_t(last)], id);
    emit(s, id, logits ? row(p.logit_rows - 1) : std::span<const float>(), t);
  }
}

void EngineLoop::emit(Slot& s, int32_t id, std::span<const float> row, double t) {
  if (size_t(s.generated) < opt_.test_forced_tokens.size())
    id = opt_.test_forced_tokens[size_t(s.generated)];
  if (s.constraint) s.constraint->accept(id);
  ChoiceEvent e;
  const bool first = s.generated == 0;
  const double gap = t - s.t_last;
  s.t_last = t;
  if (take_token(s, id, s.top_logprobs >= 0 ? row : std::span<const float>(), t, gap, e))
    send_tokens(s, std::move(e), first);
}

// The draw the prompt's last step would have made, from the same logits with the same sampling
// row (its uniform from the slot's sampler, as in a step), on the host.
void EngineLoop::draw_from_cache(Slot& s) {
  const std::vector<float> logits = std::move(s.cached_logits);
  s.cached_logits.clear();
  if (s.spec.sampling.max_tokens <= 0) {  // the prompt only
    finish(s, "length", {});
    return;
  }
  const SampleRow row = s.sampler->prepare(s.history);
  const int32_t id =
      s.host_draw() ? host_draw(s, logits, row, -1) : sample_row(row, logits, draw_scratch_.sample);
  emit(s, id, logits, now());
}

bool EngineLoop::keeps_logits(const Part& p) const {
  return cache_ && p.samples && p.slot->prefilling() &&
         int64_t(p.slot->spec.prompt.size()) >= cache_->min_tokens();
}

void EngineLoop::restore_prefix(Slot& s) {
  const std::vector<int32_t>& prompt = s.spec.prompt;
  counters_.prefix_cache_queries.fetch_add(int64_t(prompt.size()));
  // Prompt logprobs need every prompt row's logits.
  if (s.prompt_logprobs) return;
  const PrefixCache::Match m = cache_->match(prompt);
  if (m.whole >= 0) {  // the same prompt again: nothing to feed
    cache_->restore_whole(m, s.seq, s.cached_logits);
    s.fed = prompt.size();
    s.cached = int64_t(prompt.size());
    counters_.prefix_cache_hits.fetch_add(s.cached);
    if (s.drafter) s.drafter->observe(prompt, 0, {});
    return;
  }
  if (m.entry >= 0) {
    cache_->restore(m, s.seq);
    s.fed = size_t(m.cached);
    s.cached = m.cached;
    counters_.prefix_cache_hits.fetch_add(m.cached);
    if (s.drafter)  // (a drafter without aux rows: the tokens are all it observes)
      s.drafter->observe(std::span<const int32_t>(prompt.data(), s.fed), 0, {});
  }
  // Where the prompt departs from a cached one (a shared system prompt, few-shot examples, the
  // same prompt again): keep a state there too, so the next prompt sharing it hits. At most the
  // prompt's last token but one: the last is fed to get the first draw's logits.
  // (n > 1: the prompt's end, with its logits, is kept anyway; the siblings wait for it.)
  const int64_t at = std::min<int64_t>(m.shared, int64_t(prompt.size()) - 1);
  if (at > m.cached && at >= cache_->min_tokens()) s.keep_at = size_t(at);
}

bool EngineLoop::waits_for_sibling(const Pending& p) const {
  if (!cache_ || p.prompt_logprobs) return false;
  for (const auto& sp : slots_) {
    const Slot& s = *sp;
    if (s.stream == p.stream && s.fork && s.prefilling() &&
        int64_t(p.spec.prompt.size()) >= cache_->min_tokens() && s.spec.prompt == p.spec.prompt)
      return true;
  }
  return false;
}

void EngineLoop::keep_prefix(Slot& s, size_t tokens, std::span<const float> logits) {
  // The slot's sequence is at `tokens` of its history wherever this is called; a sequence that is
  // not (nothing known to happen) is skipped rather than cached wrong.
  if (int64_t(tokens) != s.seq.pos || tokens > s.history.size()) return;
  cache_->insert(std::span<const int32_t>(s.history.data(), tokens), s.seq, logits);
  count_cache();
}

void EngineLoop::count_cache() {
  counters_.prefix_cache_entries.store(cache_->size());
  counters_.prefix_cache_bytes.store(int64_t(cache_->bytes()));
}

// The slot's token drawn again under its constraint and logit bias (engine/constrained_draw.h).
int32_t EngineLoop::host_draw(Slot& s, std::span<const float> logits, const SampleRow& row,
                              int32_t drawn) {
  return constrained_draw(s.constrained() ? &*s.constraint : nullptr, s.spec.logit_bias, logits,
                          row, drawn, draw_scratch_);
}

bool EngineLoop::take_token(Slot& s, int32_t id, std::span<const float> row, double t, double gap,
                            ChoiceEvent& e, bool in_history) {
  e.tokens.push_back(id);
  // The prompt's logprobs travel with the first token, so a stream can send them with it.
  if (s.prompt_logprobs && s.generated == 0) e.prompt_logprobs = std::move(s.prompt_lp);
  if (s.top_logprobs >= 0) e.logprobs.push_back(token_logprob(row, id, s.top_logprobs));
  if (!in_history) s.history.push_back(id);
  ++s.generated;
  counters_.generation_tokens.fetch_add(1);
  if (s.generated == 1) {
    if (obs_.time_to_first_token) obs_.time_to_first_token(t - s.stream->submitted_at);
  } else if (obs_.inter_token_latency && gap >= 0) {
    obs_.inter_token_latency(gap);
  }
  const auto& stop_ids = s.spec.sampling.stop_token_ids;
  if (std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end()) {
    finish(s, "stop", std::move(e));
    return false;
  }
  TextDelta d;
  try {
    d = s.text->push(id);
  } catch (const Error& err) {  // an id the tokenizer lacks (a model vocabulary beyond it)
    e.error = err.what();
    retire(s, std::move(e));
    return false;
  }
  e.text += d.text;
  e.reasoning += d.reasoning;
  if (d.stopped) {
    e.stop_string = s.text->stop_string();
    finish(s, "stop", std::move(e));
    return false;
  }
  if (s.generated >= s.spec.sampling.max_tokens ||
      int64_t(s.history.size()) >= opt_.max_model_len) {
    finish(s, "length", std::move(e));
    return false;
  }
  s.next = id;
  return true;
}

void EngineLoop::send_tokens(Slot& s, ChoiceEvent e, bool first) {
  e.choice = s.choice;
  append_event(s.pending, std::move(e));
  if (first || int(s.pending.tokens.size()) >= opt_.stream_interval) {
    s.stream->push(std::move(s.pending));
    events_pushed_ = true;
    s.pending = ChoiceEvent{};
  }
}

}  // namespace md::server
