// xoshiro256** seeded through splitmix64: the project's deterministic random stream (md::Rng,
// make-model's weights), shared with the CUDA kernels so that a device replays make-model's
// generator bit for bit (model/random_init.h).
#pragma once
#include <cstdint>

#include "megadecode/base/host_device.h"

namespace md {

// a * b and a + b rounded once each: the device must not fuse them into an FMA (nvcc does by
// default), or its uniforms would differ from the host's in the last bit.
MD_HOST_DEVICE double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
MD_HOST_DEVICE double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

struct Xoshiro256 {
  uint64_t s[4];

  MD_HOST_DEVICE explicit Xoshiro256(uint64_t seed) {
    for (auto& v : s) {
      seed += 0x9e3779b97f4a7c15ull;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      v = z ^ (z >> 31);
    }
  }
  MD_HOST_DEVICE static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  MD_HOST_DEVICE uint64_t next() {
    const uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
  }
  // Uniform in [0, 1) (53 bits; exact in double).
  MD_HOST_DEVICE double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  MD_HOST_DEVICE double uniform(double lo, double hi) {
    return add_rn(lo, mul_rn(hi - lo, uniform()));
  }
};

}  // namespace md
