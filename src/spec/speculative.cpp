#include "megadecode/spec/speculative.h"

#include <algorithm>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/spec/acceptance.h"

namespace md {

void validate(const SpeculativeOptions& o) {
  MD_CHECK(o.num_draft_tokens >= 1 && o.num_draft_tokens <= kMaxDraftTokens,
           "speculative decoding: --num-draft-tokens {} is not in 1..{} (the verify step of "
           "K + 1 rows must fit a commit's row log of {} rows)",
           o.num_draft_tokens, kMaxDraftTokens, kMaxDraftTokens + 1);
  MD_CHECK(o.fixed_acceptance_length >= -1 && o.fixed_acceptance_length <= o.num_draft_tokens,
           "speculative decoding: --fixed-acceptance-length {} is not in 0..{} (at most the "
           "--num-draft-tokens)",
           o.fixed_acceptance_length, o.num_draft_tokens);
  MD_CHECK(o.prefill_chunk >= 1 && o.prefill_chunk <= plan::kMaxRows,
           "speculative decoding: prefill chunk {} is not in 1..{}", o.prefill_chunk,
           plan::kMaxRows);
}

SpeculativeDecoder::SpeculativeDecoder(Executor& executor, Drafter& drafter,
                                       const SpeculativeOptions& o)
    : SpeculativeDecoder(executor, drafter.aux_layers(), o) {
  drafter_ = &drafter;
}

SpeculativeDecoder::SpeculativeDecoder(Executor& executor, std::span<const int> aux_layers,
                                       const SpeculativeOptions& o)
    : ex_(executor), o_(o), aux_layers_(aux_layers.begin(), aux_layers.end()) {
  validate(o_);
  const int commit_rows = ex_.states().options().commit_rows;
  MD_CHECK(o_.num_draft_tokens + 1 <= commit_rows,
           "speculative decoding: a verify step of {} rows needs a state pool whose row log holds "
           "that many rows (it holds {})",
           o_.num_draft_tokens + 1, commit_rows);
  aux_width_ = int64_t(aux_layers_.size()) * ex_.model().config().hidden_size;
}

void SpeculativeDecoder::prefill(SequenceState& seq, std::span<const int32_t> ids, float* logits) {
  MD_CHECK(!ids.empty(), "speculative prefill: no tokens given");
  MD_CHECK(drafter_, "speculative prefill: this decoder has no drafter of its own");
  if (aux_width_ == 0) {
    const int64_t pos = seq.pos;
    ex_.prefill(seq, ids, logits, o_.prefill_chunk);
    drafter_->observe(ids, pos, {});
    return;
  }
  // The executor's own prefill has no aux capture: the same chunks, each step capturing the
  // drafter's rows.
  const size_t chunk = size_t(o_.prefill_chunk);
  for (size_t i = 0; i < ids.size(); i += chunk) {
    const size_t n = std::min(ids.size() - i, chunk);
    const bool last = i + n == ids.size();
    const StepSeq q{&seq, ids.subspan(i, n), last && logits ? LogitRows::kLast : LogitRows::kNone};
    aux_.assign(n * size_t(aux_width_), 0.0f);
    StepOptions so;
    so.aux = AuxCapture{drafter_->aux_layers(), aux_.data()};
    const int64_t pos = seq.pos;
    ex_.step(std::span(&q, 1), last ? logits : nullptr, nullptr, {}, so);
    drafter_->observe(ids.subspan(i, n), pos, aux_);
  }
}

bool SpeculativeDecoder::step(SequenceState& seq, std::vector<int32_t>& history, Sampler* sampler,
                              const std::function<bool(int32_t)>& emit) {
  MD_CHECK(drafter_, "speculative step: this decoder has no drafter of its own (step_batch)");
  bool go = true;
  SpecSeq q;
  q.seq = &seq;
  q.history = &history;
  q.sampler = sampler;
  q.drafter = drafter_;
  q.emit = [&](int32_t t, std::span<const float>) { return go = emit(t); };
  step_batch(std::span(&q, 1));
  return go;
}

namespace {
// Greedy without penalties is decided inside the step (the plan's argmax of every row: no logits
// leave the executor); anything else needs each row's distribution on the host.
bool decided_in_step(const Sampler* sampler) {
  if (!sampler) return true;
  const SamplingParams& p = sampler->params();
  return p.greedy() && p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f &&
         p.frequency_penalty == 0.0f;
}
}  // namespace

void SpeculativeDecoder::step_batch(std::span<SpecSeq> seqs, const SpecExtra& extra) {
  const int K = o_.num_draft_tokens;
  const size_t R = size_t(K) + 1;
  const int64_t V = ex_.model().config().vocab_size;
  const size_t B = seqs.size();
  MD_CHECK(B >= 1, "speculative step: no sequences");
  rows_.assign(B * R, 0);
  const double t0 = now_seconds();
  bool host_rows = false;  // some sequence needs the logits on the host
  for (size_t b = 0; b < B; ++b) {
    SpecSeq& q = seqs[b];
    MD_CHECK(q.seq && q.history && q.drafter && q.emit,
             "speculative step: sequence {} lacks its state, history, drafter or emit", b);
    MD_CHECK(q.drafter->aux_layers().size() * size_t(ex_.model().config().hidden_size) ==
                 size_t(aux_width_),
             "speculative step: sequence {}'s drafter wants other aux rows than the decoder's", b);
    MD_CHECK(!q.history->empty() && q.seq->pos == int64_t(q.history->size()) - 1,
             "speculative step: the sequence has consumed {} tokens but the history holds {} (it "
             "must hold those and the anchor)",
             q.seq->pos, q.history->size());
    rows_[b * R] = q.history->back();
    host_rows = host_rows || q.logits || !decided_in_step(q.sampler);
  }
  // Proposals: drafters that share a batch key propose together (one draft plan step for all
  // of them), the others one by one.
  std::vector<char> proposed(B, 0);
  std::vector<Drafter*> group;
  std::vector<std::span<const int32_t>> contexts;
  std::vector<std::span<int32_t>> outs;
  for (size_t b = 0; b < B; ++b) {
    if (proposed[b]) continue;
    const void* key = seqs[b].drafter->batch_key();
    group.clear();
    contexts.clear();
    outs.clear();
    for (size_t c = b; c < B; ++c) {
      if (proposed[c] || (c != b && (key == nullptr || seqs[c].drafter->batch_key() != key)))
        continue;
      proposed[c] = 1;
      group.push_back(seqs[c].drafter);
      contexts.emplace_back(*seqs[c].history);
      outs.emplace_back(rows_.data() + c * R + 1, size_t(K));
    }
    group[0]->propose_together(group, contexts, outs);
  }
  for (size_t b = 0; b < B; ++b)
    for (size_t k = 1; k <= size_t(K); ++k)
      MD_CHECK(rows_[b * R + k] >= 0 && rows_[b * R + k] < V,
               "speculative step: the {} drafter proposed id {} outside [0, {})",
               seqs[b].drafter->name(), rows_[b * R + k], V);
  const double t1 = now_seconds();

  steps_.clear();
  pos0_.clear();
  for (size_t b = 0; b < B; ++b) {
    steps_.push_back({seqs[b].seq, std::span<const int32_t>(rows_.data() + b * R, R),
                      LogitRows::kAll});
    pos0_.push_back(seqs[b].seq->pos);
  }
  // The extra sequences' rows follow the verifies' (rows, logit rows and aux rows alike).
  size_t extra_rows = 0;
  for (const StepSeq& q : extra.seqs) {
    MD_CHECK(q.tokens.size() <= size_t(plan::kMaxChainedRows),
             "speculative step: an extra sequence feeds {} rows (at most {} beside verifies)",
             q.tokens.size(), plan::kMaxChainedRows);
    steps_.push_back(q);
    extra_rows += q.tokens.size();
  }
  const size_t extra_logits = size_t(logit_row_count(extra.seqs));
  MD_CHECK(extra.sampling.empty() || extra.sampling.size() == extra_logits,
           "speculative step: {} sampling rows for {} extra logit rows", extra.sampling.size(),
           extra_logits);
  MD_CHECK(extra_logits == 0 || extra.next_ids,
           "speculative step: the extra sequences' tokens need next_ids");
  MD_CHECK(aux_width_ == 0 || extra_rows == 0 || extra.aux.size() == extra_rows * size_t(aux_width_),
           "speculative step: {} aux values for {} extra rows", extra.aux.size(), extra_rows);
  host_rows = host_rows || extra.logits;
  StepOptions so;
  so.keep_for_commit = true;
  if (aux_width_ > 0) {
    aux_.assign((B * R + extra_rows) * size_t(aux_width_), 0.0f);
    so.aux = AuxCapture{aux_layers_, aux_.data()};
  }
  // The in-step choices (greedy) always come back; the logits only when a sequence needs them.
  // The verify rows draw greedily (SampleRow{}); the extra rows as asked.
  const size_t N = B * R + extra_logits;
  choices_.assign(N, -1);
  if (host_rows) logits_.resize(N * size_t(V));
  std::vector<SampleRow> sampling;
  if (!extra.sampling.empty()) {
    sampling.assign(B * R, SampleRow{});
    sampling.insert(sampling.end(), extra.sampling.begin(), extra.sampling.end());
  }
  ex_.step(steps_, host_rows ? logits_.data() : nullptr, choices_.data(), sampling, so);
  const double t2 = now_seconds();
  if (extra_logits > 0) {
    std::copy(choices_.begin() + std::ptrdiff_t(B * R), choices_.end(), extra.next_ids);
    if (extra.logits)
      std::copy(logits_.begin() + std::ptrdiff_t(B * R * size_t(V)),
                logits_.begin() + std::ptrdiff_t(N * size_t(V)), extra.logits);
  }
  if (aux_width_ > 0 && extra_rows > 0)
    std::copy(aux_.begin() + std::ptrdiff_t(B * R * size_t(aux_width_)), aux_.end(),
              extra.aux.begin());

  double accept_s = 0, commit_s = 0, observe_s = 0;
  for (size_t b = 0; b < B; ++b) {
    SpecSeq& q = seqs[b];
    const double ta = now_seconds();
    const std::span<const int32_t> drafts(rows_.data() + b * R + 1, size_t(K));
    const std::span<const float> logits =
        host_rows ? std::span<const float>(logits_).subspan(b * R * size_t(V), R * size_t(V))
                  : std::span<const float>();
    Acceptance a;
    if (decided_in_step(q.sampler)) {
      a = accept_greedy(drafts, std::span<const int32_t>(choices_).subspan(b * R, R),
                        o_.fixed_acceptance_length);
    } else {
      // Row i's penalties count the history and drafts[0, i). The sampler's counts follow a
      // history that only grows; rows are asked in order and the emitted tokens extend the
      // longest prefix asked, so hist_ stays a prefix of the history to come.
      hist_.assign(q.history->begin(), q.history->end());
      size_t have = 0;
      auto row = [&](int i) {
        while (have < size_t(i)) hist_.push_back(drafts[have++]);
        return q.sampler->prepare_without_draw(hist_);
      };
      a = accept_sampled(
          drafts, logits, row, [&] { return q.sampler->uniform(); }, scratch_,
          o_.fixed_acceptance_length);
    }
    const double tb = now_seconds();
    int emitted = 0;
    bool go = true;
    for (int j = 0; j <= a.accepted && go; ++j) {
      const int32_t t = j < a.accepted ? drafts[size_t(j)] : a.token;
      q.history->push_back(t);
      ++emitted;
      go = q.emit(t, q.logits ? logits.subspan(size_t(j) * size_t(V), size_t(V))
                              : std::span<const float>());
    }
    // The sequence consumes the anchor and every emitted token but the last (the next anchor):
    // `emitted` rows, a + 1 unless emit stopped early.
    const double tc = now_seconds();
    ex_.commit(*q.seq, emitted);
    const double td = now_seconds();
    q.drafter->observe(
        std::span<const int32_t>(rows_).subspan(b * R, size_t(emitted)), pos0_[b],
        aux_width_ > 0 ? std::span<const float>(aux_).subspan(b * R * size_t(aux_width_),
                                                              size_t(emitted) * size_t(aux_width_))
                       : std::span<const float>());
    const double te = now_seconds();
    ++stats_.steps;
    stats_.drafted += K;
    stats_.accepted += a.accepted;
    stats_.emitted += emitted;
    for (int k = 0; k < a.accepted; ++k) ++stats_.accepted_at[size_t(k)];
    accept_s += (tb - ta) + (tc - tb);
    commit_s += td - tc;
    observe_s += te - td;
  }
  ++stats_.batches;
  stats_.draft_seconds += (t1 - t0) + observe_s;  // proposing, and the drafters' context update
  stats_.verify_seconds += t2 - t1;
  stats_.accept_seconds += accept_s;
  stats_.commit_seconds += commit_s;
}

}  // namespace md
