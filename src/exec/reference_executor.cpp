#include "megadecode/exec/reference_executor.h"

#include <algorithm>

#include "megadecode/base/error.h"
#include "step_layout.h"

namespace md {

ReferenceExecutor::ReferenceExecutor(Model& model, int max_batch, const PoolOptions& states)
    : model_(model), max_batch_(max_batch) {
  MD_CHECK(max_batch >= 1 && max_batch <= 1024, "executor: max_batch {} is outside 1..1024",
           max_batch);
  MD_CHECK(!model.shard().sharded(),
           "the reference executor runs whole models only; this is {} (use a plan executor: "
           "--executor megakernel or opbyop)",
           dist::describe_shard(model.shard()));
  PoolOptions po = states;
  po.max_sequences = std::max(po.max_sequences, max_batch);
  pool_ = std::make_unique<StatePool>(model.config(), model.numerics().round_bf16, po);
}

ReferenceExecutor::~ReferenceExecutor() = default;

void ReferenceExecutor::commit(SequenceState&, int) {
  MD_CHECK(false, "the reference executor keeps no row log: commit is not supported");
}

const plan::Plan& ReferenceExecutor::plan(int, int) {
  MD_CHECK(false, "the reference executor runs Model::forward: it has no decode plan");
  std::abort();  // unreachable: MD_CHECK threw
}

void ReferenceExecutor::run_step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids,
                                 std::span<const SampleRow> sampling, const StepOptions& options) {
  MD_CHECK(!options.keep_for_commit,
           "the reference executor keeps no row log: keep_for_commit is not supported");
  MD_CHECK(!seqs.empty() && int(seqs.size()) <= max_batch_, "step: batch {} is outside 1..{}",
           seqs.size(), max_batch_);
  const int rows_out = logit_row_count(seqs);
  MD_CHECK(sampling.empty() || int(sampling.size()) == rows_out,
           "step: {} sampling rows for {} logit rows", sampling.size(), rows_out);
  MD_CHECK(rows_out == 0 || logits != nullptr || next_ids != nullptr,
           "step: no logits buffer (and no next_ids: the step would return nothing)");
  const int64_t V = model_.config().vocab_size;
  // Everything is checked before any sequence moves, as the plan executors do.
  for (size_t i = 0; i < seqs.size(); ++i) {
    const StepSeq& s = seqs[i];
    MD_CHECK(s.seq && s.seq->pool() == pool_.get(),
             "step: sequence {} is not a state of this executor's pool", i);
    MD_CHECK(!s.tokens.empty() && s.tokens.size() <= size_t(plan::kMaxRows),
             "step: sequence {} feeds {} rows (1..{})", i, s.tokens.size(), plan::kMaxRows);
    for (size_t j = 0; j < i; ++j)
      MD_CHECK(seqs[j].seq != s.seq, "step: sequence {} appears twice", i);
    for (int32_t id : s.tokens)
      MD_CHECK(id >= 0 && id < V, "step: token id {} is outside the vocabulary [0, {})", id, V);
  }
  exec::check_aux(model_.config(), options.aux);
  if (!logits && rows_out > 0) {  // only the drawn tokens are wanted
    all_logits_.resize(size_t(rows_out) * size_t(V));
    logits = all_logits_.data();
  }
  stats_ = StepStats();
  stats_.batch = int(seqs.size());
  float* out = logits;
  // The aux rows of each sequence follow those of the sequences before it (step order), as
  // Model::forward lays out its T rows.
  const size_t aux_width = options.aux.layers.size() * size_t(model_.config().hidden_size);
  size_t aux_row = 0;
  for (const StepSeq& s : seqs) {
    const int R = int(s.tokens.size());
    stats_.rows = std::max(stats_.rows, R);
    stats_.token_rows += R;
    const AuxCapture aux{options.aux.layers,
                         aux_width ? options.aux.out + aux_row * aux_width : nullptr};
    const AuxCapture* ap = aux_width ? &aux : nullptr;
    aux_row += size_t(R);
    if (s.logits == LogitRows::kNone) {
      scratch_logits_.resize(size_t(V));
      model_.forward(*s.seq, s.tokens, scratch_logits_.data(), false, ap);
    } else {
      const bool all = s.logits == LogitRows::kAll;
      model_.forward(*s.seq, s.tokens, out, all, ap);
      out += size_t(all ? R : 1) * size_t(V);
    }
  }
  if (next_ids)
    for (int j = 0; j < rows_out; ++j)
      next_ids[j] = sample_row(sampling.empty() ? SampleRow{} : sampling[size_t(j)],
                               std::span<const float>(logits + size_t(j) * size_t(V), size_t(V)),
                               sample_scratch_);
}

}  // namespace md
