// How a model is split over the ranks of a distributed run (docs/distributed.md "Layouts"):
// tensor parallelism over attention heads, dense and shared-expert channels and the vocabulary,
// expert parallelism over the routed experts, and each rank's slice of the weights, read from the
// checkpoint's mapping in place where the slice is contiguous.
//
// The rule (the seed's layout is --tp 4 --ep 8 on 32 ranks): the world has tp x ep ranks.
//  * Attention heads (KDA and MLA), dense-FFN and shared-expert channels, and the lm_head's
//    vocabulary are split over all tp x ep ranks.
//  * Routed experts are split ep ways by expert (contiguous blocks of ids) and, inside each
//    expert, tp ways by channel. Rank r is expert group r / tp and channel slice r % tp.
// Every split must divide evenly (heads, channels, experts); anything else is an md::Error at
// start naming the count and the layout.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "megadecode/model/config.h"
#include "megadecode/model/weights.h"

namespace md::dist {

class Communicator;

// Rank r's block of a vocabulary of V rows over W ranks: [first, last), blocks of ceil(V / W)
// (the last may be shorter, or empty).
inline std::pair<int64_t, int64_t> vocab_block(int64_t V, int W, int r) {
  const int64_t per = (V + W - 1) / W;
  return {std::min<int64_t>(V, r * per), std::min<int64_t>(V, (r + 1) * per)};
}

struct ShardLayout {
  int tp = 1, ep = 1;
  int world() const { return tp * ep; }
};

// One rank's place in a layout.
struct Shard {
  ShardLayout layout;
  int rank = 0;
  bool sharded() const { return layout.world() > 1; }
  int world() const { return layout.world(); }
  int expert_group() const { return rank / layout.tp; }  // of ep
  int expert_slice() const { return rank % layout.tp; }  // of tp, inside each expert
  // The routed experts this rank holds: [first, last).
  std::pair<int, int> experts(const ModelConfig& full) const;
  // The lm_head's vocabulary rows this rank computes: [first, last) (blocks of
  // ceil(vocab / world); the last block may be shorter).
  std::pair<int64_t, int64_t> vocab(int64_t vocab_size) const {
    return vocab_block(vocab_size, world(), rank);
  }
};

// An md::Error naming the first split that does not divide, or a rank outside the world.
void check_layout(const ModelConfig& full, const Shard& s);

// The rank's model in a ModelConfig's terms: heads, dense/shared channels and the routed
// experts' channels divided (the routed experts' count, the router and the vocabulary are
// those of the full model; the plan computes the rank's vocabulary block).
ModelConfig shard_config(const ModelConfig& full, const Shard& s);

// What a rank holds, for `inspect`-style reports: bytes mapped in place from the checkpoint
// (row slices and replicated tensors), bytes copied into the rank's own memory (column slices),
// and of those the weights a decode step reads (the embedding's one row per token aside).
struct ShardBytes {
  double mapped = 0, copied = 0;
  double held() const { return mapped + copied; }
};

// The rank's weights from the full model's (`full` bound to the checkpoint): row slices point
// into the mapping, column slices (o_proj, the down projections' inputs) and per-channel vectors
// are copied into `storage`, experts of other groups are left empty (null), the embedding and
// lm_head stay whole mappings (a rank reads only its tokens' embedding rows and its vocabulary
// block of lm_head, so only those pages become resident). `bytes` (optional) receives the
// accounting. release_sources (for weights in a read-only file mapping only): after copying a
// column slice, its source pages are dropped from the process (madvise), since the copy read
// them all; they stay in the page cache.
ModelWeights shard_weights(const ModelConfig& full_cfg, const ModelWeights& full, const Shard& s,
                           ShardBytes* bytes = nullptr, bool release_sources = false);

// "tp 2 x ep 1, rank 0 of 2"
std::string describe_shard(const Shard& s);

}  // namespace md::dist
