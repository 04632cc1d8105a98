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
    : ex_(executor), drafter_(drafter), o_(o) {
  validate(o_);
  const int commit_rows = ex_.states().options().commit_rows;
  MD_CHECK(o_.num_draft_tokens + 1 <= commit_rows,
           "speculative decoding: a verify step of {} rows needs a state pool whose row log holds "
           "that many rows (it holds {})",
           o_.num_draft_tokens + 1, commit_rows);
  aux_width_ = int64_t(drafter_.aux_layers().size()) * ex_.model().config().hidden_size;
}

void SpeculativeDecoder::prefill(SequenceState& seq, std::span<const int32_t> ids, float* logits) {
  MD_CHECK(!ids.empty(), "speculative prefill: no tokens given");
  if (aux_width_ == 0) {
    const int64_t pos = seq.pos;
    ex_.prefill(seq, ids, logits, o_.prefill_chunk);
    drafter_.observe(ids, pos, {});
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
    so.aux = AuxCapture{drafter_.aux_layers(), aux_.data()};
    const int64_t pos = seq.pos;
    ex_.step(std::span(&q, 1), last ? logits : nullptr, nullptr, {}, so);
    drafter_.observe(ids.subspan(i, n), pos, aux_);
  }
}

bool SpeculativeDecoder::step(SequenceState& seq, std::vector<int32_t>& history, Sampler* sampler,
                              const std::function<bool(int32_t)>& emit) {
  const int K = o_.num_draft_tokens;
  const int64_t V = ex_.model().config().vocab_size;
  MD_CHECK(!history.empty() && seq.pos == int64_t(history.size()) - 1,
           "speculative step: the sequence has consumed {} tokens but the history holds {} (it "
           "must hold those and the anchor)",
           seq.pos, history.size());
  rows_.assign(size_t(K) + 1, 0);
  rows_[0] = history.back();
  const std::span<int32_t> drafts(rows_.data() + 1, size_t(K));

  const double t0 = now_seconds();
  drafter_.propose(history, drafts);
  for (int32_t d : drafts)
    MD_CHECK(d >= 0 && d < V, "speculative step: the {} drafter proposed id {} outside [0, {})",
             drafter_.name(), d, V);
  const double t1 = now_seconds();

  // Greedy without penalties is decided inside the step (the plan's argmax of every row: no
  // logits leave the executor); anything else needs each row's distribution on the host.
  const bool in_step =
      !sampler ||
      (sampler->params().greedy() && sampler->params().repetition_penalty == 1.0f &&
       sampler->params().presence_penalty == 0.0f && sampler->params().frequency_penalty == 0.0f);
  const StepSeq q{&seq, rows_, LogitRows::kAll};
  StepOptions so;
  so.keep_for_commit = true;
  if (aux_width_ > 0) {
    aux_.assign(size_t(K + 1) * size_t(aux_width_), 0.0f);
    so.aux = AuxCapture{drafter_.aux_layers(), aux_.data()};
  }
  const int64_t pos0 = seq.pos;
  if (in_step) {
    choices_.assign(size_t(K) + 1, -1);
    ex_.step(std::span(&q, 1), nullptr, choices_.data(), {}, so);
  } else {
    logits_.resize(size_t(K + 1) * size_t(V));
    ex_.step(std::span(&q, 1), logits_.data(), nullptr, {}, so);
  }
  const double t2 = now_seconds();

  Acceptance a;
  if (in_step) {
    a = accept_greedy(drafts, choices_, o_.fixed_acceptance_length);
  } else {
    // Row i's penalties count the history and drafts[0, i). The sampler's counts follow a history
    // that only grows; rows are asked in order and the emitted tokens extend the longest prefix
    // asked, so hist_ stays a prefix of the history to come.
    hist_.assign(history.begin(), history.end());
    size_t have = 0;
    auto row = [&](int i) {
      while (have < size_t(i)) hist_.push_back(drafts[have++]);
      return sampler->prepare_without_draw(hist_);
    };
    a = accept_sampled(
        drafts, logits_, row, [&] { return sampler->uniform(); }, scratch_,
        o_.fixed_acceptance_length);
  }
  const double t3 = now_seconds();

  int emitted = 0;
  bool go = true;
  for (int j = 0; j <= a.accepted && go; ++j) {
    const int32_t t = j < a.accepted ? drafts[size_t(j)] : a.token;
    history.push_back(t);
    ++emitted;
    go = emit(t);
  }
  // The sequence consumes the anchor and every emitted token but the last (the next anchor):
  // `emitted` rows, a + 1 unless emit stopped early.
  const double t4 = now_seconds();
  ex_.commit(seq, emitted);
  const double t5 = now_seconds();
  drafter_.observe(std::span<const int32_t>(rows_).first(size_t(emitted)), pos0,
                   aux_width_ > 0
                       ? std::span<const float>(aux_).first(size_t(emitted) * size_t(aux_width_))
                       : std::span<const float>());
  const double t6 = now_seconds();

  ++stats_.steps;
  stats_.drafted += K;
  stats_.accepted += a.accepted;
  stats_.emitted += emitted;
  stats_.draft_seconds += (t1 - t0) + (t6 - t5);  // proposing, and the drafter's context update
  stats_.verify_seconds += t2 - t1;
  stats_.accept_seconds += t3 - t2;
  stats_.commit_seconds += t5 - t4;
  return go;
}

}  // namespace md
