#pragma once
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>

#include "megadecode/base/xoshiro.h"

namespace md {

inline double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// Deterministic, platform-independent random numbers (xoshiro256** seeded through splitmix64,
// base/xoshiro.h), so that `make-model --seed S` writes the same bytes everywhere.
class Rng : public Xoshiro256 {
 public:
  explicit Rng(uint64_t seed) : Xoshiro256(seed) {}
  // Standard normal (Box-Muller; one value per call keeps the stream simple to reproduce).
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

std::string human_bytes(double bytes);

}  // namespace md
