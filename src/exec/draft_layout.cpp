#include "draft_layout.h"

#include <algorithm>
#include <cstring>

#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/ops.h"

namespace md::exec {

void check_draft_fits(const ModelConfig& target, const DraftConfig& c, const DraftWeights& w) {
  MD_CHECK(c.hidden_size == target.hidden_size && c.vocab_size == target.vocab_size,
           "attach_draft: the draft (hidden {}, vocabulary {}) does not fit the target (hidden {}, "
           "vocabulary {})",
           c.hidden_size, c.vocab_size, target.hidden_size, target.vocab_size);
  MD_CHECK(w.layers.size() == size_t(c.num_layers),
           "attach_draft: {} weight layers for a draft of {} layers", w.layers.size(),
           c.num_layers);
}

DraftLayout layout_draft_step(const DraftConfig& d, int max_batch,
                              std::span<const DraftStepSeq> seqs) {
  DraftLayout lay;
  const int B = int(seqs.size());
  MD_CHECK(B >= 1 && B <= max_batch, "draft step: {} sequences (1..{})", B, max_batch);
  const int G = int(seqs[0].tokens.size());
  const int64_t CW = d.context_width(), V = d.vocab_size;
  int C = 0;
  for (int b = 0; b < B; ++b) {
    const DraftStepSeq& q = seqs[size_t(b)];
    MD_CHECK(int(q.tokens.size()) == G,
             "draft step: sequence {} drafts {} tokens, sequence 0 {} (a step's blocks are "
             "equal)",
             b, q.tokens.size(), G);
    MD_CHECK(G <= kDraftMaxBlockRows, "draft step: {} tokens asked (0 .. {})", G,
             kDraftMaxBlockRows);
    MD_CHECK(q.ring.keys && q.ring.values && q.ring.positions,
             "draft step: sequence {} has no ring", b);
    const size_t n = q.ctx_positions.size();
    MD_CHECK(n <= size_t(plan::kMaxRows) && n <= size_t(d.window),
             "draft step: sequence {} appends {} context rows (at most {} a step)", b, n,
             std::min(plan::kMaxRows, d.window));
    MD_CHECK(q.ctx_aux.size() == n * size_t(CW),
             "draft step: sequence {} has {} aux values for {} context rows of {}", b,
             q.ctx_aux.size(), n, CW);
    for (int32_t p : q.ctx_positions)
      MD_CHECK(p >= 0, "draft step: sequence {} has context position {}", b, p);
    if (G > 0) {
      MD_CHECK(q.anchor >= 0 && q.anchor < V,
               "draft step: sequence {}'s anchor {} is outside the vocabulary [0, {})", b,
               q.anchor, V);
      MD_CHECK(q.anchor_position >= 0 && q.anchor_position < (int64_t(1) << 31) - 64,
               "draft step: sequence {}'s anchor position {} is out of range", b,
               q.anchor_position);
    }
    for (int c = 0; c < b; ++c)
      MD_CHECK(seqs[size_t(c)].ring.keys != q.ring.keys,
               "draft step: sequences {} and {} share a ring", c, b);
    C = std::max(C, int(n));
  }
  // Context rows per sequence in the plan: the next power of two (few plan shapes).
  if (C > 0) {
    int c2 = 1;
    while (c2 < C) c2 *= 2;
    C = std::min(c2, std::min(plan::kMaxRows, d.window));
  }
  lay.B = B;
  lay.G = G;
  lay.C = C;
  lay.N = B * G;
  const size_t N = size_t(lay.N);
  lay.tokens.assign(N, int32_t(d.mask_token_id));
  lay.row0.resize(size_t(B) + 1);
  lay.seq_of_row.resize(N);
  lay.logit_of_row.resize(N);
  lay.pos.resize(size_t(B));
  for (int b = 0; b < B; ++b) {
    const DraftStepSeq& q = seqs[size_t(b)];
    lay.row0[size_t(b)] = b * G;
    for (int r = 0; r < G; ++r) {
      lay.seq_of_row[size_t(b * G + r)] = b;
      lay.logit_of_row[size_t(b * G + r)] = b * G + r;
    }
    if (G > 0) lay.tokens[size_t(b * G)] = q.anchor;
    lay.pos[size_t(b)] = q.anchor_position;
  }
  lay.row0[size_t(B)] = lay.N;
  return lay;
}

void fill_draft_context(const plan::Plan& p, const DraftLayout& lay,
                        std::span<const DraftStepSeq> seqs, bool round_bf16, uint8_t* aux_rows,
                        uint8_t* pos_rows) {
  const int64_t CW = p.draft.cfg.context_width();
  const plan::BufferDesc& ab = p.buffers[p.draft.aux];
  const plan::BufferDesc& pb = p.buffers[p.draft.ctx_pos];
  for (int b = 0; b < lay.B; ++b) {
    const DraftStepSeq& q = seqs[size_t(b)];
    for (int j = 0; j < lay.C; ++j) {
      const int t = b * lay.C + j;
      float* row = reinterpret_cast<float*>(aux_rows + ab.stride * uint64_t(t));
      int32_t pos = -1;
      if (size_t(j) < q.ctx_positions.size()) {
        std::memcpy(row, q.ctx_aux.data() + int64_t(j) * CW, size_t(CW) * 4);
        if (round_bf16) cpu::round_bf16_inplace(row, CW);
        pos = q.ctx_positions[size_t(j)];
      } else {
        std::memset(row, 0, size_t(CW) * 4);
      }
      std::memcpy(pos_rows + pb.stride * uint64_t(t), &pos, 4);
    }
  }
}

void copy_draft_outputs(const plan::Plan& p, const DraftLayout& lay,
                        std::span<const DraftStepSeq> seqs,
                        const std::function<const uint8_t*(uint32_t)>& rows_of) {
  const int G = lay.G;
  if (G == 0) return;
  const DraftConfig& d = p.draft.cfg;
  auto rows_out = [&](uint32_t bi, int64_t width, int b, float* out) {
    if (!out) return;
    const plan::BufferDesc& bd = p.buffers[bi];
    const uint8_t* base = rows_of(bi);
    for (int r = 0; r < G; ++r)
      std::memcpy(out + int64_t(r) * width, base + bd.stride * uint64_t(b * G + r),
                  size_t(width) * 4);
  };
  const plan::BufferDesc& db = p.buffers[p.draft.drafts];
  const uint8_t* drafts = rows_of(p.draft.drafts);
  for (int b = 0; b < lay.B; ++b) {
    const DraftStepSeq& q = seqs[size_t(b)];
    std::memcpy(q.tokens.data(), drafts + db.stride * uint64_t(b), size_t(G) * 4);
    rows_out(p.draft.hidden, d.hidden_size, b, q.hidden);
    rows_out(p.draft.base, d.vocab_size, b, q.base_logits);
    rows_out(p.draft.biased, d.vocab_size, b, q.biased_logits);
  }
}

Numerics draft_numerics(const Numerics& target, const DraftConfig& d) {
  Numerics num = target;
  num.eps = float(d.rms_norm_eps);
  num.activation = Activation::kSilu;
  num.residual = ResidualKind::kPlain;
  return num;
}

}  // namespace md::exec
