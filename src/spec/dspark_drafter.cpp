#include "megadecode/spec/dspark_drafter.h"

#include "megadecode/base/error.h"

namespace md {

DSparkDrafter::DSparkDrafter(const DraftModel& model, Executor* executor) : model_(model) {
  if (executor && executor->runs_drafts()) {
    executor->attach_draft(model.config(), model.weights());
    ex_ = executor;
    ring_ = executor->new_draft_ring(model.config());
  } else {
    state_ = model.new_state();
  }
}

const DraftState& DSparkDrafter::state() const {
  if (ring_) ring_->read(state_.keys, state_.values, state_.positions);
  return state_;
}

void DSparkDrafter::reset() {
  if (ring_) {
    ring_->clear();
    state_.rows_written = 0;
  } else {
    state_.reset();
  }
  positions_.clear();
  aux_.clear();
}

void DSparkDrafter::observe(std::span<const int32_t> tokens, int64_t pos,
                            std::span<const float> aux) {
  if (tokens.empty()) return;
  const size_t width = size_t(model_.config().context_width());
  MD_CHECK(aux.size() == tokens.size() * width,
           "DSpark drafter: {} aux values for {} tokens of {} (the target's rows at the aux "
           "layers)",
           aux.size(), tokens.size(), width);
  MD_CHECK(pos >= 0 && pos + int64_t(tokens.size()) < (int64_t(1) << 31),
           "DSpark drafter: position {} is out of range", pos);
  if (!ex_) {
    positions_.resize(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) positions_[i] = int32_t(pos + int64_t(i));
    model_.update_context(state_, aux, positions_);
    return;
  }
  // Staged for the next draft step; a draft step appends at most kMaxRows (and a window of)
  // rows, so longer runs (a prompt) are applied in context-only steps as they come.
  const size_t cap = size_t(std::min(plan::kMaxRows, model_.config().window));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (positions_.size() == cap) flush();
    positions_.push_back(int32_t(pos + int64_t(i)));
    aux_.insert(aux_.end(), aux.begin() + int64_t(i * width), aux.begin() + int64_t((i + 1) * width));
  }
}

DraftStepSeq DSparkDrafter::step_seq(std::span<const int32_t> context, std::span<int32_t> out) {
  DraftStepSeq q;
  q.ring = ring_->ring();
  q.ctx_aux = aux_;
  q.ctx_positions = positions_;
  if (!out.empty()) {
    MD_CHECK(!context.empty(), "DSpark drafter: empty context");
    q.anchor = context.back();
    q.anchor_position = int64_t(context.size()) - 1;
    q.tokens = out;
  }
  return q;
}

void DSparkDrafter::staged_done() {
  state_.rows_written += int64_t(positions_.size());
  positions_.clear();
  aux_.clear();
}

void DSparkDrafter::flush() {
  if (!ex_ || positions_.empty()) return;
  const DraftStepSeq q = step_seq({}, {});
  ex_->draft_step(std::span(&q, 1));
  staged_done();
}

void DSparkDrafter::propose(std::span<const int32_t> context, std::span<int32_t> out) {
  MD_CHECK(!context.empty(), "DSpark drafter: empty context");
  if (!ex_) {
    // One block of out.size() rows: the anchor and out.size() - 1 mask rows. The block is
    // causal, so its first rows draft what the first rows of a longer block would.
    model_.draft(state_, context.back(), int64_t(context.size()) - 1, out);
    return;
  }
  const DraftStepSeq q = step_seq(context, out);
  ex_->draft_step(std::span(&q, 1));
  staged_done();
}

void DSparkDrafter::propose_together(std::span<Drafter* const> group,
                                     std::span<const std::span<const int32_t>> contexts,
                                     std::span<const std::span<int32_t>> outs) {
  MD_CHECK(group.size() == contexts.size() && group.size() == outs.size(),
           "DSpark drafter: {} drafters, {} contexts, {} outputs", group.size(), contexts.size(),
           outs.size());
  if (!ex_) return Drafter::propose_together(group, contexts, outs);
  std::vector<DSparkDrafter*> ds;
  std::vector<DraftStepSeq> qs;
  for (size_t i = 0; i < group.size(); ++i) {
    auto* d = static_cast<DSparkDrafter*>(group[i]);
    MD_CHECK(d->batch_key() == batch_key(),
             "DSpark drafter: drafter {} of the group runs elsewhere", i);
    ds.push_back(d);
    qs.push_back(d->step_seq(contexts[i], outs[i]));
  }
  ex_->draft_step(qs);
  for (DSparkDrafter* d : ds) d->staged_done();
}

}  // namespace md
