#pragma once
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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

// Zero-filled memory for weights the kernels stream that are not the checkpoint's mapping (a
// load-time quantization, a column-sorted copy): an anonymous mapping aligned to 2 MiB and
// advised onto 2 MiB pages before its first touch, as the mapping is (model/mapped_file.cpp), so
// that streaming it does not take a TLB miss every 4 KiB (the column-sorted codes of an
// activation-ordered checkpoint in std::vector memory decoded 12-15% slower: bench/RESULTS.md,
// session 26). Freed with its last owner (ModelWeights::owned).
class WeightBuffer {
 public:
  explicit WeightBuffer(size_t n);
  ~WeightBuffer();
  WeightBuffer(const WeightBuffer&) = delete;
  WeightBuffer& operator=(const WeightBuffer&) = delete;
  uint8_t* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0, mapped_ = 0;
};
std::shared_ptr<WeightBuffer> weight_buffer(size_t n);

}  // namespace md
