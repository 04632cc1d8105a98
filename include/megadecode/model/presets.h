// Built-in model geometries and random-weight checkpoints with realistic scales (`make-model`).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "megadecode/model/config.h"

namespace md {

class ThreadPool;

// tiny, small: fast test models (the golden models share these geometries); kl48-e32: the
// Kimi-Linear-48B-A3B geometry with 32 experts per layer instead of 256 (same bytes per decode
// token at batch 1, files ~16 GB); kl48: the full released geometry.
ModelConfig preset_config(const std::string& name);
std::vector<std::string> preset_names();

// Writes config.json and safetensors (bf16; the tensors the reference keeps in fp32 as F32) into
// dir. The same (config, seed) always gives the same bytes. Scales are chosen so that activations
// stay O(1), KDA decays exp(g) are mostly in 0.2..0.95, and router scores are spread.
void make_random_checkpoint(const ModelConfig& cfg, const std::string& dir, uint64_t seed,
                            int shards, ThreadPool& pool, bool progress = false);

}  // namespace md
