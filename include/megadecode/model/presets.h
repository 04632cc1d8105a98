// Built-in model geometries and random-weight checkpoints with realistic scales (`make-model`).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "megadecode/model/config.h"
#include "megadecode/model/random_init.h"

namespace md {

class ThreadPool;
struct TensorSpec;

// tiny, small: fast test models (the golden models share these geometries); kl48-e32: the
// Kimi-Linear-48B-A3B geometry with 32 experts per layer instead of 256 (same bytes per decode
// token at batch 1, files ~16 GB); kl48: the full released geometry; k3-tiny, k3-small: K3 test
// models; k3-slice: K3's first four layers at full width; k3-shard16: one GPU's share of Kimi K3
// served 16 ways (all 93 layers; the geometry and its approximations in docs/cuda.md).
ModelConfig preset_config(const std::string& name);
std::vector<std::string> preset_names();

// Writes config.json and safetensors (bf16; the tensors the reference keeps in fp32 as F32) into
// dir. The same (config, seed) always gives the same bytes. Scales are chosen so that activations
// stay O(1), KDA decays exp(g) are mostly in 0.2..0.95, and router scores are spread.
// The recipe make-model uses for tensor `index` of expected_tensors(cfg) (random_init.h).
RandomInit random_init(const TensorSpec& t, const ModelConfig& cfg, uint64_t seed, size_t index);

// A matrix of random weights drawn directly in a quantized format (what load-time quantization
// does with random weights generated on a CUDA device, which have no values to quantize):
// uniformly random codes, and group scales that give the dequantized weights an rms of `rms`.
// codes: the matrix's code bytes (kMxfp4Codes: random bytes); scales: one per group of a row,
// bf16 near rms / rms(q) for int4 / int8, E8M0 bytes for MXFP4 (as the MXFP4 experts' recipe).
struct QuantRecipes {
  RandomInit codes, scales;
};
QuantRecipes random_quantized_init(WeightQuant format, int64_t rows, int64_t cols, int group,
                                   double rms, uint64_t seed);
// The rms of the values a uniform recipe draws (sqrt(mean^2 + half^2 / 3)).
double random_init_rms(const RandomInit& r);

void make_random_checkpoint(const ModelConfig& cfg, const std::string& dir, uint64_t seed,
                            int shards, ThreadPool& pool, bool progress = false);

}  // namespace md
