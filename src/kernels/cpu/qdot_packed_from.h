// Which activations a qdot kernel's packed scratch holds (qdot_avx2.cpp, qdot_avx512bf16.cpp).
// The tiles of one op that a worker runs one after another, and an expert's gate and up
// projections, take the same vectors. A call whose vectors are bit-identical to the ones the
// scratch was packed from uses the packing as it is: the same bytes, so results do not change.
// Checking is a comparison of B x K floats, a fraction of quantizing them again (~1 us a
// 2304-column vector on Zen 2, as long as a 16-row tile's dot products; ~0.5-1 us a call on
// Zen 4's AVX-512 kernel, 5-7% of a W4A8 decode tile).
//
// Internal linkage, as isa_scratch.h: each ISA file compiles its own copy with its own flags.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#include "qdot_kernels.h"

namespace md::cpu::detail {
namespace {

// Only decode-sized batches are kept: a prefill chunk's rows (16-64 vectors) are work enough that
// packing them is cheap beside it, while copying and comparing them would not be.
constexpr int kReuseVecs = 8;

// The packing's format: the weights' code kind (its layout of the activations) and the
// activations' integer format.
struct PackKey {
  QdotCodes kind;
  QdotActs acts;
  bool operator==(const PackKey&) const = default;
};

struct PackedFrom {
  std::vector<float> x;  // [nb][K]
  int64_t K = 0;
  int nb = 0;
  PackKey kind{QdotCodes::kInt4, QdotActs::kInt8};
  bool valid = false;
  bool same(const float* X, int nb_, int64_t ldx, int64_t K_, PackKey kind_) const {
    if (!valid || nb != nb_ || K != K_ || !(kind == kind_)) return false;
    for (int j = 0; j < nb_; ++j)
      if (std::memcmp(x.data() + j * K_, X + j * ldx, static_cast<size_t>(K_) * sizeof(float)))
        return false;
    return true;
  }
  void record(const float* X, int nb_, int64_t ldx, int64_t K_, PackKey kind_) {
    x.resize(static_cast<size_t>(nb_ * K_));
    for (int j = 0; j < nb_; ++j)
      std::memcpy(x.data() + j * K_, X + j * ldx, static_cast<size_t>(K_) * sizeof(float));
    nb = nb_, K = K_, kind = kind_, valid = true;
  }
};

// Packs nb vectors of X into scratch with pack(x, out) unless scratch already holds them, and
// returns the packed bytes (stride bytes a vector).
template <class Scratch, class Pack>
uint8_t* packed_activations(PackedFrom& from, Scratch& scratch, const float* X, int nb, int B,
                            int64_t ldx, int64_t K, PackKey kind, int64_t stride, Pack&& pack) {
  const bool keep = B <= kReuseVecs;
  if (keep && from.same(X, nb, ldx, K, kind))
    return static_cast<uint8_t*>(scratch.get(static_cast<size_t>(nb * stride)));
  from.valid = false;  // while the scratch changes (get may reallocate)
  auto* xb = static_cast<uint8_t*>(scratch.get(static_cast<size_t>(nb * stride)));
  for (int j = 0; j < nb; ++j) pack(X + j * ldx, xb + j * stride);
  if (keep) from.record(X, nb, ldx, K, kind);
  return xb;
}

}  // namespace
}  // namespace md::cpu::detail
