// Typed per-layer weights bound to checkpoint tensors by their official names. Matrices point into
// the memory-mapped files (never copied); small vectors (norm weights, gate biases, conv taps) are
// converted to fp32 once at load.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/dtype.h"
#include "megadecode/model/config.h"

namespace md {

class Checkpoint;

// A [rows, cols] row-major matrix in the mapping (Hugging Face Linear layout [out, in]).
struct Mat {
  const void* data = nullptr;
  DType dtype = DType::BF16;
  int64_t rows = 0, cols = 0;
  const bf16* bf16_data() const { return static_cast<const bf16*>(data); }
  const float* f32_data() const { return static_cast<const float*>(data); }
  size_t bytes() const { return size_t(rows) * size_t(cols) * dtype_size(dtype); }
  const void* row(int64_t r) const {
    return static_cast<const uint8_t*>(data) + size_t(r) * size_t(cols) * dtype_size(dtype);
  }
};

struct FfnWeights {  // SwiGLU MLP: down(silu(gate x) * up x)
  Mat gate, up, down;
  size_t bytes() const { return gate.bytes() + up.bytes() + down.bytes(); }
};

struct KdaWeights {
  Mat q, k, v;                                 // [C, D]
  std::vector<float> q_conv, k_conv, v_conv;   // [C][W]
  Mat f_a, f_b;                                // [K, D], [C, K]
  std::vector<float> dt_bias;                  // [C]
  std::vector<float> A_log;                    // [H]
  Mat b;                                       // [H, D]
  Mat g_a, g_b;                                // [K, D], [C, K]
  std::vector<float> o_norm;                   // [K]
  Mat o;                                       // [D, C]
};

struct MlaWeights {
  Mat q;                        // [H*(N+P), D]
  Mat kv_a;                     // [R+P, D]
  std::vector<float> kv_a_norm; // [R]
  Mat kv_b;                     // [H*(N+V), R]
  Mat o;                        // [D, H*V]
};

struct MoeWeights {
  Mat router;                          // [E, D], BF16 or F32
  std::vector<float> router_bias;      // [E] e_score_correction_bias
  std::vector<FfnWeights> experts;     // w1 = gate, w3 = up, w2 = down
  FfnWeights shared;                   // intermediate = moe_intermediate_size * num_shared
  bool has_shared = false;
};

struct LayerWeights {
  std::vector<float> input_norm, post_attn_norm;  // [D]
  KdaWeights kda;  // when the layer is KDA
  MlaWeights mla;  // when the layer is MLA
  FfnWeights dense;  // when the FFN is dense
  MoeWeights moe;    // when the FFN is MoE
};

struct ModelWeights {
  Mat embed;                      // [vocab, D]
  std::vector<float> final_norm;  // [D]
  Mat lm_head;                    // [vocab, D]
  std::vector<LayerWeights> layers;
};

// Binds every tensor the architecture needs; a missing tensor, a wrong shape or dtype, or a tensor
// the architecture does not use is an md::Error naming it.
ModelWeights bind_weights(const ModelConfig& cfg, const Checkpoint& ckpt);

// The list of official tensor names, shapes and dtypes for a config (what make-model writes and
// bind_weights expects).
struct TensorSpec;
std::vector<TensorSpec> expected_tensors(const ModelConfig& cfg);

// Parameter and byte counts for `inspect` and the bandwidth floor.
struct ModelSizes {
  int64_t total_params = 0;
  int64_t active_params = 0;    // per token: non-expert + top-k routed experts
  double total_bytes = 0;
  double active_bytes = 0;      // weights read per decode token at batch 1
  double expert_bytes = 0;      // one routed expert (all layers have the same shape)
  double kda_state_bytes = 0;   // per sequence
  double mla_cache_bytes_per_token = 0;  // all MLA layers, at the storage width of the cache
};
ModelSizes model_sizes(const ModelConfig& cfg);

}  // namespace md
