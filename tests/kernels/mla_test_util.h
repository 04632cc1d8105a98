// Helpers shared by the MLA kernel tests (test_mla.cpp: against a float64 reference;
// test_mla_paged.cpp: paged caches against the contiguous one): problem geometry, random caches
// and queries with the real model's magnitudes, and forcing an ISA copy of the kernels.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/kernels/cpu/cpu_features.h"
#include "megadecode/kernels/cpu/mla.h"

namespace md::cpu {
namespace {

const MlaDims kReal{32, 128, 64, 128, 512};  // Kimi Linear's MLA
// Odd sizes so that every vector loop runs its remainder path.
const MlaDims kSmall{4, 12, 6, 10, 43};

inline double default_scale(const MlaDims& d) {
  return 1.0 / std::sqrt(static_cast<double>(d.N + d.P));
}

// A layer's latent cache and kv_b_proj with the magnitudes of the real model: the latent is
// RMS-normalised (entries ~1), k_pe ~1, kv_b ~ N(0, 1/R) so that k_nope and v are ~1, and queries
// (see random_queries) ~2, which makes scores ~N(0, 2^2): softmax over tens to hundreds of tokens
// is then neither uniform nor one-hot (checked by SoftmaxShape).
struct Problem {
  MlaDims d;
  int T;        // cache rows
  int64_t ldc;  // padded row stride, to catch R + P assumed as stride
  std::vector<float> cache;
  std::vector<bf16> kv_b;
  // The cache as the kernels take it: one contiguous fp32 page.
  LatentCache view() const {
    return LatentCache::contiguous(const_cast<float*>(cache.data()), ldc, T);
  }
};

inline Problem make_problem(const MlaDims& d, int T, uint64_t seed) {
  Problem pb{d, T, d.R + d.P + 3, {}, {}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> unit(0.0, 1.0);
  pb.cache.assign(static_cast<size_t>(T) * pb.ldc, std::numeric_limits<float>::quiet_NaN());
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < d.R + d.P; ++j) pb.cache[t * pb.ldc + j] = static_cast<float>(unit(rng));
  }
  pb.kv_b.resize(static_cast<size_t>(d.H) * (d.N + d.V) * d.R);
  const double ws = 1.0 / std::sqrt(static_cast<double>(d.R));
  for (auto& w : pb.kv_b) w = f32_to_bf16(static_cast<float>(ws * unit(rng)));
  return pb;
}

// n_tokens query rows of H * (N + P) values with row stride ld (padding filled with NaN).
inline std::vector<float> random_queries(int n_tokens, int64_t ld, const MlaDims& d, uint64_t seed,
                                         double sigma = 2.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> g(0.0, sigma);
  std::vector<float> q(static_cast<size_t>(n_tokens) * ld, std::numeric_limits<float>::quiet_NaN());
  for (int i = 0; i < n_tokens; ++i) {
    for (int j = 0; j < d.H * (d.N + d.P); ++j) q[i * ld + j] = static_cast<float>(g(rng));
  }
  return q;
}

// The kernels carry an AVX2 copy chosen at run time and a baseline copy (see mla.cpp). Tests run
// both: at the start-up ISA level (nullptr) and forced to the portable level.
class ScopedIsa {
 public:
  explicit ScopedIsa(const char* isa) : scoped_(level(isa)) {}

 private:
  static Isa level(const char* isa) {
    Isa l = active_isa();
    if (isa != nullptr) parse_isa(isa, &l);
    return l;
  }
  md::cpu::ScopedIsa scoped_;
};
constexpr const char* kIsas[] = {nullptr, "portable"};
inline const char* isa_name(const char* isa) {
  return isa == nullptr ? "default" : isa;
}

// Runs decode for one token (query row q) against the first T rows of pb; returns [H][V] with NaN
// outside [h0, h1).
inline std::vector<float> run_decode(const Problem& pb, const float* q, int T, int h0, int h1) {
  std::vector<float> out(static_cast<size_t>(pb.d.H) * pb.d.V,
                         std::numeric_limits<float>::quiet_NaN());
  std::vector<float> scratch(static_cast<size_t>(T) + 2 * pb.d.R);  // exactly the contract's size
  mla_decode_absorbed(q, pb.view(), T, pb.kv_b.data(), pb.d, h0, h1, out.data(), scratch.data());
  return out;
}

}  // namespace
}  // namespace md::cpu
