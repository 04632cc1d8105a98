#include "step_layout.h"

#include <algorithm>
#include <cstring>

#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/expert_slots.h"

namespace md::exec {

namespace {

void check_inputs(const Model& model, const StatePool& pool, int max_batch,
                  std::span<const StepSeq> seqs, const float* logits, int R,
                  const StepOptions& so, bool tokens_out) {
  const ModelConfig& c = model.config();
  const int B = int(seqs.size());
  MD_CHECK(B >= 1 && B <= max_batch, "step: batch of {} sequences is outside 1..{}", B, max_batch);
  MD_CHECK(R <= plan::kMaxRows, "step: {} token rows of a sequence is outside 1..{}", R,
           plan::kMaxRows);
  MD_CHECK(!so.keep_for_commit || R <= plan::kMaxChainedRows,
           "step: a step that may be committed to a prefix takes at most {} rows, not {}",
           plan::kMaxChainedRows, R);
  MD_CHECK(!so.keep_for_commit || R <= pool.options().commit_rows,
           "step: a step that may be committed to a prefix of its {} rows needs a row log of "
           "{} rows, the state pool keeps {} (commit rows)",
           R, R, pool.options().commit_rows);
  int64_t pages = 0;
  for (int b = 0; b < B; ++b) {
    const SequenceState* s = seqs[size_t(b)].seq;
    MD_CHECK(s != nullptr, "step: sequence {} is null", b);
    MD_CHECK(!seqs[size_t(b)].tokens.empty(),
             "step: sequence {} feeds no tokens (token rows of a sequence are outside 1..{})", b,
             plan::kMaxRows);
    for (int a = 0; a < b; ++a)
      MD_CHECK(seqs[size_t(a)].seq != s, "step: sequences {} and {} are the same state", a, b);
    for (int32_t id : seqs[size_t(b)].tokens)
      MD_CHECK(id >= 0 && id < c.vocab_size,
               "token id {} (sequence {}) is outside the vocabulary [0, {})", id, b, c.vocab_size);
    MD_CHECK(s->pool() == &pool,
             "step: sequence {} is not a state of this executor's pool (make it with "
             "Executor::new_sequence, or import one with SequenceState::copy_from)",
             b);
    const int64_t rows = int64_t(seqs[size_t(b)].tokens.size());
    pages += std::max<int64_t>(0, pool.pages_for(s->pos + rows) - int64_t(s->pages().size()));
  }
  MD_CHECK(pages <= pool.free_pages(),
           "state pool is out of latent-cache pages: this step needs {} more pages of {} "
           "tokens, {} of {} are free (--cache-tokens {})",
           pages, pool.options().page_rows, pool.free_pages(), pool.total_pages(),
           pool.options().cache_tokens);
  MD_CHECK(logits != nullptr || tokens_out || logit_row_count(seqs) == 0,
           "step: no logits buffer (and no next_ids: the step would return nothing)");
  check_aux(c, so.aux);
}

}  // namespace

StepLayout layout_step(const Model& model, const StatePool& pool, int max_batch,
                       std::span<const StepSeq> seqs, const float* logits,
                       std::span<const SampleRow> sampling, const StepOptions& so,
                       bool tokens_out) {
  StepLayout L;
  for (const StepSeq& q : seqs) L.R = std::max(L.R, int(q.tokens.size()));
  check_inputs(model, pool, max_batch, seqs, logits, L.R, so, tokens_out);
  const ModelConfig& c = model.config();
  const int B = L.B = int(seqs.size());
  L.row0.assign(size_t(B) + 1, 0);
  for (int b = 0; b < B; ++b)
    L.row0[size_t(b) + 1] = L.row0[size_t(b)] + int(seqs[size_t(b)].tokens.size());
  const int N = L.N = L.row0[size_t(B)];
  L.logit_of_row.assign(size_t(N), -1);
  L.seq_of_row.assign(size_t(N), 0);
  L.tokens.resize(size_t(N));
  L.pos.resize(size_t(B));
  L.rows.resize(size_t(B));
  for (int b = 0; b < B; ++b) {
    const StepSeq& q = seqs[size_t(b)];
    const int Rb = int(q.tokens.size());
    L.rows[size_t(b)] = Rb;
    L.pos[size_t(b)] = q.seq->pos;
    std::copy(q.tokens.begin(), q.tokens.end(), L.tokens.begin() + L.row0[size_t(b)]);
    for (int i = 0; i < Rb; ++i) {
      const int t = L.row0[size_t(b)] + i;
      L.seq_of_row[size_t(t)] = b;
      if (q.logits == LogitRows::kAll || (q.logits == LogitRows::kLast && i == Rb - 1))
        L.logit_of_row[size_t(t)] = L.n_logits++;
    }
  }
  MD_CHECK(sampling.empty() || int(sampling.size()) == L.n_logits,
           "step: {} sampling specs for {} logit rows", sampling.size(), L.n_logits);
  // Sampling rows are plain data: checked here, read by the sample tiles as they are.
  for (size_t j = 0; j < sampling.size(); ++j) {
    const SampleRow& r = sampling[j];
    MD_CHECK(r.temperature >= 0 && r.top_p > 0 && r.top_p <= 1 && r.min_p >= 0 && r.min_p <= 1 &&
                 r.top_k >= 0 && r.repetition_penalty > 0 && r.uniform >= 0 && r.uniform < 1,
             "step: sampling row {} has parameters out of range", j);
    MD_CHECK(r.num_penalties == 0 || r.penalties != nullptr,
             "step: sampling row {} has {} penalty ids but no array", j, r.num_penalties);
    for (uint32_t i = 0; i < r.num_penalties; ++i)
      MD_CHECK(r.penalties[i].id >= 0 && r.penalties[i].id < c.vocab_size,
               "step: sampling row {} penalises id {}, outside the vocabulary [0, {})", j,
               r.penalties[i].id, c.vocab_size);
  }
  return L;
}

void check_aux(const ModelConfig& c, const AuxCapture& aux) {
  MD_CHECK(aux.out || aux.layers.empty(), "step: aux capture of {} layers without an output buffer",
           aux.layers.size());
  for (int L : aux.layers)
    MD_CHECK(L >= 1 && L <= c.num_layers - 1,
             "step: aux layer id {} is out of range 1 .. {} (id L captures the residual stream "
             "entering layer L)",
             L, c.num_layers - 1);
}

void copy_aux_rows(const plan::Plan& p, const AuxCapture& aux, int n,
                   const std::function<const uint8_t*(uint32_t)>& rows_of) {
  const size_t D = size_t(p.cfg.hidden_size), width = aux.layers.size() * D;
  for (size_t a = 0; a < aux.layers.size(); ++a) {
    const uint32_t bi = p.residual_buffer[size_t(aux.layers[a])];
    const uint8_t* src = rows_of(bi);
    const uint64_t stride = p.buffers[bi].stride;
    for (int t = 0; t < n; ++t)
      std::memcpy(aux.out + size_t(t) * width + a * D, src + stride * uint64_t(t),
                  D * sizeof(float));
  }
}

int distinct_experts_of_step(const ModelConfig& c, int n, const std::vector<RouterIds>& per_layer,
                             std::pair<int, int> held) {
  std::vector<int> mark(2 * static_cast<size_t>(std::max(c.num_experts, 1)));
  if (held.second < 0) held = {0, c.num_experts};
  int distinct = 0;
  for (const RouterIds& r : per_layer) {
    if (!r.ids) continue;
    const int nd = cpu::distinct_experts(r.ids, r.stride, n, c.num_experts_per_token,
                                         c.num_experts, mark.data(), mark.data() + c.num_experts);
    for (int i = 0; i < nd; ++i) {
      const int e = mark[size_t(c.num_experts + i)];
      distinct += e >= held.first && e < held.second;
    }
  }
  return distinct;
}

}  // namespace md::exec
