// make-model's random weights as data: each tensor's recipe (RandomInit) and the generator that
// turns a recipe into bytes (fill_random_chunk). One code for every place the bytes are made:
// the safetensors files of make-model, the host tensors of a checkpoint generated in memory
// (Checkpoint::random), and the CUDA executors' device memory (random weights generated on the
// device, so that the benchmark of a ~100 GB geometry uploads nothing).
//
// A tensor of n elements is cut into chunks of kRandomChunk elements; chunk c is drawn from its
// own stream Xoshiro256(random_chunk_seed(tensor seed, c)), so chunks are generated in parallel
// and in any order with the same result.
#pragma once
#include <cstdint>
#include <cstring>

#include "megadecode/base/bf16.h"
#include "megadecode/base/host_device.h"
#include "megadecode/base/xoshiro.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace md {

inline constexpr uint64_t kRandomChunk = uint64_t(1) << 20;

struct RandomInit {
  enum class Kind : uint8_t {
    kUniform,      // mean + U(-half, half), rounded to bf16 (stored BF16, or F32 when f32)
    kLogUniform,   // log U(1, hi) (A_log), rounded to bf16; host only (the device has no std::log)
    kMxfp4Codes,   // uniformly random bytes (two e2m1 or int4 codes each, or one int8 code)
    kMxfp4Scales,  // E8M0 bytes uniform in scale_byte - 1 .. scale_byte + 1
  };
  Kind kind = Kind::kUniform;
  bool f32 = false;  // float elements stored as F32 (else BF16)
  int scale_byte = 127;
  double mean = 0, half = 0, hi = 4.0;
  uint64_t seed = 0;   // the tensor's seed (random_chunk_seed(seed, c) seeds chunk c)
  uint64_t numel = 0;  // elements (bytes for the MXFP4 kinds)

  MD_HOST_DEVICE uint64_t element_bytes() const {
    return kind == Kind::kMxfp4Codes || kind == Kind::kMxfp4Scales ? 1 : f32 ? 4 : 2;
  }
  MD_HOST_DEVICE uint64_t chunks() const { return (numel + kRandomChunk - 1) / kRandomChunk; }
};

// Mixes two words into a seed (a tensor's from the model seed and its index, a chunk's from the
// tensor's and the chunk index).
MD_HOST_DEVICE uint64_t random_chunk_seed(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull + (a << 6) + (a >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  return z ^ (z >> 31);
}

// Writes chunk c of the tensor into `tensor` (the whole tensor's bytes; the chunk's elements only).
MD_HOST_DEVICE void fill_random_chunk(const RandomInit& in, uint64_t c, void* tensor) {
  Xoshiro256 rng(random_chunk_seed(in.seed, c));
  const uint64_t i0 = c * kRandomChunk;
  const uint64_t i1 = i0 + kRandomChunk < in.numel ? i0 + kRandomChunk : in.numel;
  auto* out = static_cast<uint8_t*>(tensor);
  using K = RandomInit::Kind;
  for (uint64_t i = i0; i < i1; ++i) {
    if (in.kind == K::kMxfp4Codes || in.kind == K::kMxfp4Scales) {
      const uint64_t r = rng.next();
      out[i] = in.kind == K::kMxfp4Codes ? uint8_t(r >> 56)
                                         : uint8_t(in.scale_byte - 1 + int((r >> 32) % 3));
      continue;
    }
    double v;
    if (in.kind == K::kLogUniform) {
#if defined(__CUDA_ARCH__)
      v = 0;  // unreachable: the executors generate only the kinds without std::log
#else
      v = std::log(rng.uniform(1.0, in.hi));
#endif
    } else {
      v = add_rn(in.mean, rng.uniform(-in.half, in.half));
    }
    // Every value is bf16-representable, also in F32 tensors, so bf16 and fp32 runs of the
    // reference see identical weights.
    const float f = round_bf16(float(v));
    if (in.f32) {
      std::memcpy(out + 4 * i, &f, 4);
    } else {
      const bf16 b = f32_to_bf16(f);
      std::memcpy(out + 2 * i, &b, 2);
    }
  }
}

}  // namespace md
