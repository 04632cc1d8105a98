// A loaded model and the reference forward path (prefill of a prompt in one call, then decode
// token by token) on CPU worker threads, over sequences of a state pool (engine/state_pool.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "megadecode/base/threads.h"
#include "megadecode/dist/shard.h"
#include "megadecode/engine/numerics.h"
#include "megadecode/engine/state_pool.h"
#include "megadecode/model/config.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/model/weights.h"

namespace md {

// What Model::forward can capture besides the logits: the residual stream entering each listed
// layer, for every fed token (a speculative draft's context; spec/draft_model.h). Layer id L
// (1 .. num_layers - 1) names the stream after layer L - 1: Kimi Linear's hidden state x, Kimi
// K3's current block partial sum (the "prefix" of block attention residuals), as the seed's
// aux_hidden_layers capture it. out receives [T][layers.size() * hidden], the layers of one token
// concatenated in the order given.
struct AuxCapture {
  std::span<const int> layers;
  float* out = nullptr;
};

class Model {
 public:
  Model(const std::string& dir, const ModelOptions& opt = {});
  // make-model's random weights for (cfg, seed) without files (Checkpoint::random): only the
  // CUDA executors can run it (they generate the matrices in device memory); the reference path
  // and the CPU executors refuse it with an md::Error.
  Model(const ModelConfig& cfg, uint64_t seed, const ModelOptions& opt = {});
  // One rank's slice of the model in dir (dist/shard.h): config() and weights() are the rank's
  // (heads, channels and experts divided, row slices mapped in place, column slices copied);
  // full_config() is the checkpoint's. comm (size = the layout's world, rank = shard.rank)
  // carries the plan's collectives and outlives the model. Only the plan executors on the CPU
  // run a sharded model (the reference path and the CUDA executors refuse it).
  Model(const std::string& dir, const ModelOptions& opt, const dist::Shard& shard,
        dist::Communicator* comm);
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  const ModelWeights& weights() const { return w_; }
  // For tests and tools that transform the bound weights after load (a reference built from
  // dequantized copies): the forward path and executors made afterwards read them.
  ModelWeights& mutable_weights() { return w_; }
  const ModelOptions& options() const { return opt_; }
  const dist::Shard& shard() const { return shard_; }
  dist::Communicator* communicator() const { return comm_; }
  const ModelConfig& full_config() const { return shard_.sharded() ? full_cfg_ : cfg_; }
  // What this rank holds (sharded models; zeros otherwise).
  const dist::ShardBytes& shard_bytes() const { return shard_bytes_; }
  // What load-time quantization did (ModelOptions::quantize; zeros when it was off).
  const QuantizeReport& quantize_report() const { return quant_; }
  // The numeric policy of this model and options (engine/numerics.h).
  const Numerics& numerics() const { return num_; }
  const Checkpoint& checkpoint() const { return *ckpt_; }
  // Every weight is in host memory (false for a Model of random weights generated on a device).
  bool weights_on_host() const { return ckpt_->host_complete(); }
  // An md::Error naming `who` unless weights_on_host().
  void require_host_weights(const char* who) const;
  ThreadPool& pool() { return *pool_; }

  // A sequence of the reference path's state pool (ModelOptions::states; an md::Error when the
  // pool is full). Model::forward accepts a sequence of any pool of this model's layout.
  SequenceState new_sequence() const;
  StatePool& states() const { return *states_; }

  // Reads every page of the mapped weights once (so the first steps do not page-fault),
  // reporting progress in bytes.
  void touch_weights(const std::function<void(double done, double total)>& progress) const;

  // Feeds ids to the sequence (T = ids.size() >= 1 tokens: T > 1 is a prefill, T == 1 a decode
  // step) and advances it. logits, when not null, receives [T][vocab] (all_positions) or the last
  // position's [vocab]. Ids outside the vocabulary are an md::Error (the state is unchanged), and
  // so are aux layer ids out of range. aux, when not null, captures hidden states (AuxCapture).
  void forward(SequenceState& seq, std::span<const int32_t> ids, float* logits, bool all_positions,
               const AuxCapture* aux = nullptr);

 private:
  struct Impl;
  ModelConfig cfg_;
  ModelOptions opt_;
  dist::Shard shard_;
  dist::Communicator* comm_ = nullptr;
  ModelConfig full_cfg_;
  dist::ShardBytes shard_bytes_;
  QuantizeReport quant_;
  Numerics num_;
  std::unique_ptr<Checkpoint> ckpt_;
  ModelWeights w_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<StatePool> states_;
  std::unique_ptr<Impl> impl_;
  void init();  // after cfg_ and ckpt_
};

}  // namespace md
