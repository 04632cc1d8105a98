// A loaded model and the per-sequence state it runs on: the reference forward path (prefill of a
// prompt in one call, then decode token by token), on CPU worker threads.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "megadecode/base/threads.h"
#include "megadecode/engine/numerics.h"
#include "megadecode/model/config.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/model/weights.h"

namespace md {

// Everything one sequence carries between steps.
struct SequenceState {
  int64_t pos = 0;                             // tokens consumed so far
  std::vector<std::vector<float>> kda_state;   // per layer (KDA layers): [H][K][V] fp32
  std::vector<std::vector<float>> conv_cache;  // per layer (KDA): [3 (q,k,v)][W-1][C]
  std::vector<std::vector<float>> mla_cache;   // per layer (MLA): [pos][R+P] (c then k_pe)
  // Kept by a multi-row plan step that may be cut back to a prefix of its rows
  // (Executor::commit): the position before the step, its row count, and per KDA layer the
  // state and conv cache before it and every row's recurrence inputs. rows == 0: nothing kept.
  struct RowLog {
    int64_t pos0 = 0;
    int rows = 0;
    std::vector<std::vector<float>> kda_state0, conv0, inputs;  // per layer
  } rowlog;
  size_t bytes() const;
};

class Model {
 public:
  Model(const std::string& dir, const ModelOptions& opt = {});
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  const ModelWeights& weights() const { return w_; }
  const ModelOptions& options() const { return opt_; }
  // The numeric policy of this model and options (engine/numerics.h).
  const Numerics& numerics() const { return num_; }
  const Checkpoint& checkpoint() const { return *ckpt_; }
  ThreadPool& pool() { return *pool_; }

  SequenceState new_sequence() const;

  // Reads every page of the mapped weights once (so the first steps do not page-fault),
  // reporting progress in bytes.
  void touch_weights(const std::function<void(double done, double total)>& progress) const;

  // Feeds ids to the sequence (T = ids.size() >= 1 tokens: T > 1 is a prefill, T == 1 a decode
  // step) and advances it. logits, when not null, receives [T][vocab] (all_positions) or the last
  // position's [vocab]. Ids outside the vocabulary are an md::Error (the state is unchanged).
  void forward(SequenceState& seq, std::span<const int32_t> ids, float* logits, bool all_positions);

 private:
  struct Impl;
  ModelConfig cfg_;
  ModelOptions opt_;
  Numerics num_;
  std::unique_ptr<Checkpoint> ckpt_;
  ModelWeights w_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace md
