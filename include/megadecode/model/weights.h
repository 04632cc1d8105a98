// Typed per-layer weights bound to checkpoint tensors by their official names. Matrices point into
// the memory-mapped files (never copied); small vectors (norm weights, gate biases, conv taps) are
// converted to fp32 once at load.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/dtype.h"
#include "megadecode/model/config.h"

namespace md {

class Checkpoint;

// A [rows, cols] row-major matrix in the mapping (Hugging Face Linear layout [out, in]), or in
// memory the weights own (ModelWeights::owned: a load-time quantized or sliced copy).
// dtype BF16 or F32 (quant kNone); or U8 codes, `data` [rows, cols * bits / 8] (4-bit: two codes a
// byte, low nibble first; 8-bit: one a byte) and `scales` per group of `group` columns of a row:
//  * kMxfp4 (compressed-tensors mxfp4-pack-quantized, or --quantize mxfp4): E8M0 bytes
//    [rows, cols/32], group 32;
//  * kInt4 / kInt8 (pack-quantized int4 / int8, symmetric, or --quantize int4 / int8): bf16
//    [rows, cols/group];
//  * kFp8 (dtype F8E4M3: e4m3 values as stored, DeepSeek-style fp8 or compressed-tensors
//    float-quantized checkpoints): fp32 [rows, cols/group], the checkpoint's block, channel or
//    tensor scales expanded per row at load.
struct Mat {
  const void* data = nullptr;
  DType dtype = DType::BF16;
  int64_t rows = 0, cols = 0;
  const uint8_t* scales = nullptr;  // quantized formats only
  WeightQuant quant = WeightQuant::kNone;
  int32_t group = 0;  // quantized formats: columns per scale
  // int4 / int8 / MXFP4: multiply by activations quantized to this many bits, 8 or 16
  // (kernels/cpu/qdot.h; --act-quant int8 / int16); 0: the format's fp32 kernels.
  uint8_t int_act_bits = 0;
  // int4 with zero points (compressed-tensors `symmetric: false`, the AWQ layout): row 0 of
  // z = zc - 8, int8 [rows, cols / group] (kernels/cpu/int4.h); null when symmetric.
  const int8_t* zero_points = nullptr;
  // int4 / int8 with activation-ordered groups (compressed-tensors `actorder: "group"`): the
  // columns are stored sorted by group, and stored column j multiplies the input's column
  // col_perm[j] (int32 [cols]); null in the plain layout.
  const int32_t* col_perm = nullptr;
  bool mxfp4() const { return quant == WeightQuant::kMxfp4; }
  bool int4() const { return quant == WeightQuant::kInt4; }
  bool int8() const { return quant == WeightQuant::kInt8; }
  bool quantized() const { return quant != WeightQuant::kNone; }
  int code_bits() const {  // quantized formats
    return quant == WeightQuant::kInt8 || quant == WeightQuant::kFp8 ? 8 : 4;
  }
  const bf16* bf16_data() const { return static_cast<const bf16*>(data); }
  const float* f32_data() const { return static_cast<const float*>(data); }
  const uint8_t* packed_data() const { return static_cast<const uint8_t*>(data); }
  // Bytes of `n` columns of codes or values, and of one row's scales (for `cols` columns).
  size_t code_bytes(int64_t n) const {
    return quantized() ? size_t(n) * size_t(code_bits()) / 8 : size_t(n) * dtype_size(dtype);
  }
  size_t code_row_bytes() const { return code_bytes(cols); }
  // Bytes of the scales of `n` columns (whole groups).
  size_t scale_bytes(int64_t n) const {
    if (!quantized()) return 0;
    if (quant == WeightQuant::kFp8) return size_t(n) / size_t(group) * 4;
    return mxfp4() ? size_t(n) / 32 : size_t(n) / size_t(group) * 2;
  }
  size_t scale_row_bytes() const { return scale_bytes(cols); }
  size_t zero_point_row_bytes() const { return zero_points ? size_t(cols / group) : 0; }
  size_t bytes() const {
    return size_t(rows) * (code_row_bytes() + scale_row_bytes() + zero_point_row_bytes()) +
           (col_perm ? size_t(cols) * 4 : 0);
  }
  const void* row(int64_t r) const {
    return static_cast<const uint8_t*>(data) + size_t(r) * code_row_bytes();
  }
};

struct FfnWeights {  // gated MLP: down(act(gate x, up x)), act SiLU-GLU or SiTU (K3)
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
  Mat g_a, g_b;                                // [K, D], [C, K] (low-rank output gate)
  Mat g;                                       // [C, D] full-rank output gate (K3)
  std::vector<float> o_norm;                   // [K]
  Mat o;                                       // [D, C]
};

struct MlaWeights {
  Mat q;                        // [H*(N+P), D] (no q LoRA)
  Mat q_a;                      // [Q, D] q LoRA (K3): q = q_b(RMSNorm(q_a x, q_a_norm))
  std::vector<float> q_a_norm;  // [Q]
  Mat q_b;                      // [H*(N+P), Q]
  Mat g;                        // [H*V, D] output gate (K3)
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
  // Latent MoE (K3): experts read latent_down x [L] and their sum goes back through
  // latent_up(RMSNorm(sum, latent_norm)).
  Mat latent_down;                     // [L, D]
  Mat latent_up;                       // [D, L]
  std::vector<float> latent_norm;      // [L] (when latent_moe_use_norm)
};

struct LayerWeights {
  std::vector<float> input_norm, post_attn_norm;  // [D]
  KdaWeights kda;  // when the layer is KDA
  MlaWeights mla;  // when the layer is MLA
  FfnWeights dense;  // when the FFN is dense
  MoeWeights moe;    // when the FFN is MoE
  // Block attention residuals (K3): score weights w = *_res_norm.weight * *_res_proj.weight
  // (fp32; the product of two bf16 values is exact in fp32), before attention and the FFN.
  std::vector<float> attn_res_w, mlp_res_w;  // [D]
};

struct ModelWeights {
  Mat embed;                      // [vocab, D]
  std::vector<float> final_norm;  // [D]
  Mat lm_head;                    // [vocab, D]
  std::vector<LayerWeights> layers;
  std::vector<float> output_res_w;  // [D] block attention residuals before the final norm (K3)
  // Tensors outside the language model (a K3 file's vision_tower, mm_projector) are not errors:
  // they are skipped and counted here, with a one-line note for the user (empty when none).
  int ignored_tensors = 0;
  std::string note;
  // Memory some matrices point into instead of the mapping (a distributed rank's column slices,
  // dist/shard.h): shared, so that copies of these weights stay valid.
  std::vector<std::shared_ptr<const void>> owned;
};

// Whether any matrix other than the routed experts' is quantized (a pack-quantized checkpoint, an
// MXFP4 one beyond K3's experts, or --quantize): what the CUDA executors and distributed loading
// cannot run yet.
bool quantized_outside_experts(const ModelWeights& w);

// Drops the whole pages of [p, p + n) from this process (madvise DONTNEED, best effort): for the
// read-only file mapping, after a matrix was copied (sliced, quantized) and its source is no
// longer read; the pages stay in the page cache and fault back in if read again.
void release_mapped(const void* p, size_t n);

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
  double expert_bytes = 0;      // one routed expert (all layers have the same shape); MXFP4
                                // experts count 4.25 bits per weight (codes + E8M0 scales)
  double kda_state_bytes = 0;   // per sequence
  double mla_cache_bytes_per_token = 0;  // all MLA layers, bf16 pages (FP32 precision: twice)
};
ModelSizes model_sizes(const ModelConfig& cfg);

}  // namespace md
