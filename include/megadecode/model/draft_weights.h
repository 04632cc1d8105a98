// The DSpark speculative draft's weights (a checkpoint in the layout of
// RedHatAI/Kimi-K3-speculator.dspark; docs/speculative.md): what the draft's forward on the host
// (spec/draft_model.h) and the draft plan's executors (plan::compile_draft_plan) read.
#pragma once
#include <string>
#include <vector>

#include "megadecode/model/draft_config.h"
#include "megadecode/model/weights.h"

namespace md {

class Checkpoint;
class ThreadPool;
struct TensorSpec;

struct DraftLayerWeights {
  std::vector<float> input_norm, post_attn_norm;  // [D]
  Mat q, k, v, o;                                 // [Hq*d, D], [Hkv*d, D] x2, [D, Hq*d]
  std::vector<float> q_norm, k_norm;              // [d]
  FfnWeights mlp;                                 // gate/up [I, D], down [D, I]
};

struct DraftWeights {
  Mat embed;                                   // [V, D]
  Mat lm_head;                                 // [V, D]
  Mat fc;                                      // [D, n_aux * D]
  std::vector<float> hidden_norm, final_norm;  // [D]
  Mat markov_w1, markov_w2;                    // [V, r] each
  std::vector<DraftLayerWeights> layers;
};

// Binds the checkpoint's tensors (names of the seed's weight_shapes: embed_tokens.weight,
// layers.{i}.self_attn.q_proj.weight, markov_head.markov_w1.weight, ...). A missing tensor, a
// wrong shape or dtype, or a tensor the draft does not use is an md::Error naming it.
DraftWeights bind_draft_weights(const DraftConfig& c, const Checkpoint& ckpt);
// The tensors bind_draft_weights expects, in order (what make-model writes).
std::vector<TensorSpec> expected_draft_tensors(const DraftConfig& c);

// Writes a random draft checkpoint (config.json + model.safetensors) with make-model's generator
// and realistic scales: the Markov factors are scaled so that the bias is about a third of the
// logits' spread, so that tests see it change drafts.
void make_random_draft(const DraftConfig& c, const std::string& dir, uint64_t seed,
                       ThreadPool& pool);

}  // namespace md
