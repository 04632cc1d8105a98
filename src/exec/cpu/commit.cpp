// Cutting a multi-row step back to a prefix of its rows on the CPU (what a speculative verify
// needs): the KDA layers' state and conv cache are restored from the row log and the prefix's
// recurrence replayed; the MLA caches are truncated (pages past the prefix go back to the pool).
#include <algorithm>

#include "megadecode/base/error.h"
#include "tiles.h"

namespace md::exec {

void commit_rows(const ModelConfig& c, SequenceState& seq, int k, ThreadPool& pool) {
  SequenceState::RowLog& lg = seq.rowlog;
  MD_CHECK(lg.rows > 0,
           "commit: the sequence's last step kept no row log (StepOptions::"
           "keep_for_commit), or it was already committed");
  MD_CHECK(k >= 0 && k <= lg.rows, "commit: {} rows of a step of {}", k, lg.rows);
  MD_CHECK(seq.pos == lg.pos0 + lg.rows,
           "commit: the sequence moved on since the step (position {}, expected {})", seq.pos,
           lg.pos0 + lg.rows);
  const int L = c.num_layers;
  if (k < lg.rows) {
    // The KDA layers: restore and replay k rows, one (layer, head) unit per task.
    std::vector<SeqView> views(static_cast<size_t>(L));
    std::vector<int> kda_layers;
    for (int l = 0; l < L; ++l) {
      if (c.attn_kind[size_t(l)] != AttnKind::KDA) continue;
      SeqView& v = views[size_t(l)];
      v.kda_state = seq.kda_state(l);
      v.conv_cache = seq.conv_cache(l);
      v.kda_state0 = seq.kda_state0(l);
      v.conv0 = seq.conv0(l);
      v.rowlog = seq.row_inputs(l);
      kda_layers.push_back(l);
    }
    const int H = c.kda_num_heads;
    std::vector<std::vector<float>> scratch(size_t(pool.size()),
                                            std::vector<float>(size_t(c.kda_head_dim) + 16));
    pool.run([&](int w, int nw) {
      const size_t units = kda_layers.size() * size_t(H);
      for (size_t u = size_t(w); u < units; u += size_t(nw)) {
        const int l = kda_layers[u / size_t(H)], h = int(u % size_t(H));
        replay_kda_rows(c, views[size_t(l)], k, h, h + 1, scratch[size_t(w)].data());
      }
    });
    // The MLA layers: the rows past the prefix are dropped with the pages they alone used
    // (rows in a kept page are overwritten by the next step before anything reads them).
    seq.truncate(lg.pos0 + k);
  }
  seq.pos = lg.pos0 + k;
  lg.rows = 0;
}

}  // namespace md::exec
