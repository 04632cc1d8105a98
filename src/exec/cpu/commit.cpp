// Multi-row steps on the plan executors: cutting a step back to a prefix of its rows (what a
// speculative verify needs) and prefill in chunks of rows.
#include <algorithm>

#include "megadecode/base/error.h"
#include "megadecode/exec/executor.h"
#include "tiles.h"

namespace md {

int logit_row_count(std::span<const StepSeq> seqs) {
  int n = 0;
  for (const StepSeq& s : seqs)
    n += s.logits == LogitRows::kAll                         ? int(s.tokens.size())
         : s.logits == LogitRows::kLast && !s.tokens.empty() ? 1
                                                             : 0;
  return n;
}

void DecodeExecutor::commit(SequenceState& seq, int k) {
  SequenceState::RowLog& lg = seq.rowlog;
  MD_CHECK(lg.rows > 0,
           "commit: the sequence's last step kept no row log (StepOptions::"
           "keep_for_commit), or it was already committed");
  MD_CHECK(k >= 0 && k <= lg.rows, "commit: {} rows of a step of {}", k, lg.rows);
  MD_CHECK(seq.pos == lg.pos0 + lg.rows,
           "commit: the sequence moved on since the step (position {}, expected {})", seq.pos,
           lg.pos0 + lg.rows);
  const ModelConfig& c = model().config();
  const int L = c.num_layers;
  if (k < lg.rows) {
    // The KDA layers: restore and replay k rows, one (layer, head) unit per task.
    std::vector<exec::SeqView> views(static_cast<size_t>(L));
    std::vector<int> kda_layers;
    for (int l = 0; l < L; ++l) {
      if (c.attn_kind[size_t(l)] != AttnKind::KDA) continue;
      exec::SeqView& v = views[size_t(l)];
      v.kda_state = seq.kda_state[size_t(l)].data();
      v.conv_cache = seq.conv_cache[size_t(l)].data();
      v.kda_state0 = lg.kda_state0[size_t(l)].data();
      v.conv0 = lg.conv0[size_t(l)].data();
      v.rowlog = lg.inputs[size_t(l)].data();
      kda_layers.push_back(l);
    }
    const int H = c.kda_num_heads;
    ThreadPool& pool = pool_for_commit();
    std::vector<std::vector<float>> scratch(size_t(pool.size()),
                                            std::vector<float>(size_t(c.kda_head_dim) + 16));
    pool.run([&](int w, int nw) {
      const size_t units = kda_layers.size() * size_t(H);
      for (size_t u = size_t(w); u < units; u += size_t(nw)) {
        const int l = kda_layers[u / size_t(H)], h = int(u % size_t(H));
        exec::replay_kda_rows(c, views[size_t(l)], k, h, h + 1, scratch[size_t(w)].data());
      }
    });
    // The MLA layers: drop the cache rows past the prefix.
    for (int l = 0; l < L; ++l)
      if (c.attn_kind[size_t(l)] == AttnKind::MLA)
        seq.mla_cache[size_t(l)].resize(size_t(lg.pos0 + k) * size_t(c.mla_cache_width()));
  }
  seq.pos = lg.pos0 + k;
  lg.rows = 0;
}

void DecodeExecutor::prefill(SequenceState& seq, std::span<const int32_t> ids, float* logits,
                             int chunk) {
  MD_CHECK(!ids.empty(), "prefill: no tokens given");
  MD_CHECK(chunk >= 1 && chunk <= plan::kMaxRows, "prefill: chunk {} is outside 1..{}", chunk,
           plan::kMaxRows);
  for (size_t i = 0; i < ids.size(); i += size_t(chunk)) {
    const size_t n = std::min(ids.size() - i, size_t(chunk));
    const bool last = i + n == ids.size();
    const StepSeq s{&seq, ids.subspan(i, n), last && logits ? LogitRows::kLast : LogitRows::kNone};
    step(std::span(&s, 1), logits, nullptr, {}, {});
  }
}

}  // namespace md
