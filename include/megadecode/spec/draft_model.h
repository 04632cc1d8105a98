// The DSpark speculative draft (the seed's kimi/dspark.py; docs/speculative.md): its
// per-sequence state (the ring of context keys and values) and its forward on the CPU:
//   update_context: target hidden states of run tokens -> context K/V rows in the ring;
//   draft: the block (anchor + mask tokens) over the ring, then Markov-biased greedy drafting.
// The arithmetic follows the target's numeric policy (Precision::BF16: bf16 operands and
// activations at the seed reference's rounding points, fp32 accumulation; FP32: no rounding).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "megadecode/engine/numerics.h"
#include "megadecode/model/draft_weights.h"

namespace md {

class Checkpoint;
class ThreadPool;
struct TensorSpec;

// One sequence's draft context: per layer a ring of `window` K and V rows (normed, rotated keys;
// values), slot p % window holding position p, and the position each slot holds (-1: empty).
// Values are stored as fp32 (bf16-valued in BF16 precision). Owned by whoever owns the sequence;
// a fresh state (DraftModel::new_state) is empty, reset() empties it again.
struct DraftState {
  std::vector<float> keys, values;  // [layers][window][kv_width]
  std::vector<int32_t> positions;   // [window]
  int64_t rows_written = 0;         // context rows appended since the last reset
  void reset();
};

// Optional outputs of DraftModel::draft (each [block][...], null: not wanted).
struct DraftOutputs {
  float* hidden = nullptr;         // [block][D]: final-normed rows (what lm_head reads)
  float* base_logits = nullptr;    // [block][V]: lm_head(hidden)
  float* biased_logits = nullptr;  // [block][V]: base + the Markov bias of the previous token
};

class DraftModel {
 public:
  // Loads dir/config.json and the safetensors of dir, validated against the target's config.
  // pool: the threads to run on (e.g. the target Model's); null: the draft makes its own from
  // opt.threads / opt.pin_threads. The precision is opt.precision (the target's).
  DraftModel(const std::string& dir, const ModelConfig& target, const ModelOptions& opt = {},
             ThreadPool* pool = nullptr);
  ~DraftModel();

  const DraftConfig& config() const { return cfg_; }
  const DraftWeights& weights() const { return w_; }
  bool round_bf16() const { return round_; }

  DraftState new_state() const;

  // Appends context rows: aux [rows][context_width()] holds, per row, the target's hidden states
  // at aux_layer_ids concatenated in that order (Model::forward's aux capture gives this layout),
  // for the token at positions[row]. Each row becomes, per layer, the key and value of
  // RMSNorm(fc(aux), hidden_norm) at its position (keys: k_norm and RoPE; the context is not run
  // through the layers), written to slot position % window. Rows for positions that turn out
  // rejected may be written: draft() sees only positions below its anchor, and the real token's
  // row later overwrites the slot. Positions must be >= 0. In BF16 precision aux is rounded to
  // bf16 first (the seed casts it).
  void update_context(DraftState& s, std::span<const float> aux,
                      std::span<const int32_t> positions) const;

  // Drafts tokens.size() tokens (1 .. kDraftMaxBlockRows; the seed: 8) after the anchor token at
  // anchor_position (the latest committed token, whose context row is not in the ring yet): the
  // block rows are the anchor and tokens.size() - 1 mask tokens at anchor_position + k, attending
  // to ring positions in [anchor_position - window, anchor_position) and causally to the block;
  // row k's final hidden state gives base logits lm_head(h_k), and tokens[k] = argmax(base_k +
  // markov_w2 markov_w1[tokens[k-1]]) with tokens[-1] = the anchor (ties: lowest id). Row k
  // predicts position anchor_position + k + 1.
  void draft(const DraftState& s, int32_t anchor_token, int64_t anchor_position,
             std::span<int32_t> tokens, const DraftOutputs& out = {}) const;

 private:
  struct Impl;
  DraftConfig cfg_;
  bool round_ = true;
  std::unique_ptr<Checkpoint> ckpt_;
  DraftWeights w_;
  std::unique_ptr<ThreadPool> own_pool_;
  ThreadPool* pool_ = nullptr;
};

}  // namespace md
