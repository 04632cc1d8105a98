// The backend-independent half of a step (every executor: exec/cpu, exec/cuda): the checks of a
// step's input, which name the problem before anything changes, and the step's row tables (rows
// compact in sequence order, the logit rows compacted in row order).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "megadecode/exec/executor.h"

namespace md::exec {

struct StepLayout {
  int B = 0;  // sequences
  int R = 0;  // rows of the longest sequence (the plan's rows)
  int N = 0;  // token rows of the step
  int n_logits = 0;
  std::vector<int32_t> row0;          // [B + 1]: sequence b's rows are [row0[b], row0[b + 1])
  std::vector<int32_t> seq_of_row;    // [N]
  std::vector<int32_t> logit_of_row;  // [N]: its logit row, or -1
  std::vector<int32_t> tokens;        // [N]
  std::vector<int64_t> pos;           // [B]: the sequences' positions before the step
  std::vector<int> rows;              // [B]
};

// Checks the step (batch within 1..max_batch, rows, token ids, sequences of `pool` and distinct,
// the pool's free pages, the commit row log, a logits buffer unless the step only draws tokens
// (tokens_out), the sampling rows) and lays it out.
StepLayout layout_step(const Model& model, const StatePool& pool, int max_batch,
                       std::span<const StepSeq> seqs, const float* logits,
                       std::span<const SampleRow> sampling, const StepOptions& so,
                       bool tokens_out = false);

// StepOptions::aux against the model: layer ids in 1 .. num_layers - 1 and an output buffer
// when layers are listed (an md::Error naming the problem).
void check_aux(const ModelConfig& c, const AuxCapture& aux);

// StepOptions::aux out of a finished step: row t of the capture is, per listed layer, row t of
// that layer's residual-stream buffer (plan::Plan::residual_buffer). rows_of(buffer index)
// returns the host address of the buffer's row 0 (the arena itself on the CPU, a staging copy
// of the buffer for a device); rows are the buffer's stride apart.
void copy_aux_rows(const plan::Plan& p, const AuxCapture& aux, int n,
                   const std::function<const uint8_t*(uint32_t)>& rows_of);

// Distinct experts a step's rows chose, summed over the MoE layers (the step's bytes): ids(l)
// returns layer l's router ids [N][k] (row stride in ints) or null where the layer has no router.
struct RouterIds {
  const int32_t* ids = nullptr;
  size_t stride = 0;
};
// Only the experts in `held` = [first, last) count (a distributed rank's group; the default
// {0, -1}: all).
int distinct_experts_of_step(const ModelConfig& c, int n,
                             const std::vector<RouterIds>& per_layer,
                             std::pair<int, int> held = {0, -1});

}  // namespace md::exec
