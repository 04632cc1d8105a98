// Load-time quantization of a bf16 checkpoint's matrices (--quantize int4|int4-asym|int8|mxfp4):
// done once, after the weights are bound (and, on a distributed rank, sliced), into memory the
// weights own; the quantized matrices then run through their format's kernels
// (kernels/cpu/int4.h, int8.h, mxfp4.h) on every CPU path.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/model/weights.h"

namespace md {

class Checkpoint;
class ThreadPool;
struct ModelConfig;

// kInt4Asym: int4 with a zero point per group (compressed-tensors `symmetric: false`, the AWQ
// layout; kernels/cpu/int4.h), the same codes and scales plus one signed byte a row and group.
enum class QuantScheme : uint8_t { kNone, kInt4, kInt4Asym, kInt8, kMxfp4 };

struct QuantizeOptions {
  QuantScheme scheme = QuantScheme::kNone;
  // int4 / int8: columns per scale, a multiple of 32 dividing every quantized matrix's columns;
  // 0 = one scale per row (compressed-tensors' "channel" strategy); -1 = the default, 128.
  // MXFP4's group is the format's 32 (-1 or 32; anything else is an error).
  int group = -1;
  bool lm_head = false;   // quantize the output head too (off by default, as llm-compressor's
                          // recipes leave lm_head out)
  bool progress = false;  // a progress line on stderr while it runs
  // --act-quant int8 / int16 (8 / 16; 0: off): the int4 / int8 / MXFP4 linears (quantized here
  // or loaded so) take their activations quantized to int8 or int16 per 32 columns and run as
  // integer dot products (W4A8 / W8A8, or the same kernels with 16-bit activations:
  // kernels/cpu/qdot.h). Not FP8.
  uint8_t int_act_bits = 0;
};

// "none" / "int4" / "int4-asym" / "int8" / "mxfp4"; nullopt for anything else.
std::optional<QuantScheme> parse_quant_scheme(std::string_view name);
std::string_view quant_scheme_name(QuantScheme s);

// The columns per scale a scheme uses for `requested` (QuantizeOptions::group): an md::Error when
// the scheme cannot use it.
int effective_quant_group(QuantScheme s, int requested);
// What the format stores per group: WeightQuant of the scheme (kNone for kNone).
WeightQuant quant_format(QuantScheme s);

struct QuantizeReport {
  int matrices = 0;         // matrices quantized
  int group = 0;            // the columns per scale used (0: per row)
  double bytes_before = 0;  // their bytes as loaded
  double bytes_after = 0;   // codes + scales
  double seconds = 0;
  int kept = 0;            // eligible matrices left as loaded: columns not divisible by the group
  std::string first_kept;  // the first of them, with its columns
  // Each quantized matrix with the bf16 data it was made from (a checkpoint tensor's mapping),
  // for `megadecode quantize` to write it under that tensor's name. The Mat's codes and scales
  // live in the weights' memory.
  struct Done {
    const void* source = nullptr;
    Mat quantized;
  };
  std::vector<Done> done;
  int int_activation_matrices = 0;  // use_int_activations's count (--act-quant int8 / int16)
  // Matrices of random weights generated on a CUDA device (no values in host memory): drawn in
  // the format instead of quantized (random_quantized_init), as device recipes of `ck`.
  int drawn = 0;
};

// Which matrices: every bf16 projection of attention (KDA q/k/v/f/b/g/o, MLA q/q_a/q_b/g/kv_a/o),
// dense MLPs, routed and shared experts, K3's latent MoE projections, and lm_head when asked. Not:
// the embedding (a row lookup), norms and biases (vectors), the router gate (kept as loaded, its
// top-k decides the routing), MLA's kv_b (the absorbed attention reads it as bf16 rows), and
// matrices already quantized (K3's MXFP4 experts). A matrix whose columns the group does not divide
// stays as loaded (QuantizeReport::kept); a group that divides none, or a weight that is not
// finite, is an md::Error naming it. A matrix that is one of `ck`'s device-only tensors (random
// weights generated on a CUDA device: nothing to read) gets random codes and scales in the format,
// with the rms of its recipe, as device-only tensors of ck (QuantizeReport::drawn); ck may be
// null (no such matrices).
QuantizeReport quantize_weights(const ModelConfig& cfg, ModelWeights& w, const QuantizeOptions& opt,
                                ThreadPool& pool, Checkpoint* ck = nullptr);

// Marks every int4 / int8 / MXFP4 linear of those matrices (Mat::int_act_bits = bits, 8 or 16) to
// run with integer activations, K3's MXFP4 routed experts included; returns how many. An
// md::Error when there is none (the flag would do nothing).
int use_int_activations(ModelWeights& w, int bits);

}  // namespace md
