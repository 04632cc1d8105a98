// The backend-independent half of a draft step (Executor::draft_step on every backend that runs
// draft plans: exec/cpu, exec/cuda): the checks of its input, which name the problem before
// anything changes, and its tables: the block rows (anchor + mask tokens per sequence), the
// sequences' anchor positions, and the context rows' aux values and positions as the plan's
// aux / ctx_pos buffers hold them.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "megadecode/exec/executor.h"
#include "megadecode/plan/plan.h"

namespace md::exec {

struct DraftLayout {
  int B = 0;  // sequences
  int G = 0;  // block rows per sequence (0: a context-only step)
  int C = 0;  // context rows per sequence in the plan (the next power of two of the most any
              // sequence appends, capped at kMaxRows and the window; 0: none)
  int N = 0;  // block rows of the step (B * G)
  std::vector<int32_t> tokens;        // [N]: the anchor, then mask tokens
  std::vector<int32_t> row0;          // [B + 1]
  std::vector<int32_t> seq_of_row;    // [N]
  std::vector<int32_t> logit_of_row;  // [N]: every block row is a logit row
  std::vector<int64_t> pos;           // [B]: the anchor positions
};

// Executor::attach_draft's checks: the draft's hidden size and vocabulary are the target's, and
// its weights have its layers.
void check_draft_fits(const ModelConfig& target, const DraftConfig& d, const DraftWeights& w);

// Checks a draft step for a draft `d` on an executor of max_batch sequences and lays it out
// (the plan shape is (B, C, G)).
DraftLayout layout_draft_step(const DraftConfig& d, int max_batch,
                              std::span<const DraftStepSeq> seqs);

// Writes context row j of sequence b into the plan's aux and ctx_pos rows t = b * C + j: the
// sequence's aux values (rounded to bf16 in BF16 precision, as the seed casts them) and position,
// or zeros and position -1 (no row) past the sequence's own rows. aux_rows: the aux buffer's row
// 0, pos_rows: the ctx_pos buffer's (host memory, row strides of the plan's buffer table).
void fill_draft_context(const plan::Plan& p, const DraftLayout& lay,
                        std::span<const DraftStepSeq> seqs, bool round_bf16, uint8_t* aux_rows,
                        uint8_t* pos_rows);

// The drafts and optional outputs of a finished step: rows_of(buffer index) returns the host
// address of the buffer's row 0 (the arena on the CPU, a staging copy on a device).
void copy_draft_outputs(const plan::Plan& p, const DraftLayout& lay,
                        std::span<const DraftStepSeq> seqs,
                        const std::function<const uint8_t*(uint32_t)>& rows_of);

// Numerics of the draft's tiles: the target's precision with the draft's eps, SiLU MLP and
// plain residuals.
Numerics draft_numerics(const Numerics& target, const DraftConfig& d);

}  // namespace md::exec
