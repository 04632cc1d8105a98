// A vectorisable exp for the CPU kernels' elementwise loops (kda.cpp, ops.cpp). Internal linkage
// on purpose, as isa_scratch.h: kda.cpp inlines it into bodies compiled for several ISAs.
#pragma once
#include <bit>
#include <cstdint>

namespace md::cpu {
namespace {

// exp(x) for x <= 88, used for the KDA decays (the chunked prefill evaluates tens of thousands
// per chunk) and the SiLU of the gated MLPs: a branch-free Cody-Waite reduction with a degree-7
// Taylor polynomial (truncation error < 1e-8 relative on |r| <= ln2/2, so the result is within
// ~2 ulp of expf) that the compiler can vectorise, unlike a call to expf. Arguments below -87 are
// raised to -87 so that 2^n stays a normal number (the result, ~1.6e-38 instead of something
// smaller, is added to O(1) terms). The clamp is a bitwise select: GCC does not if-convert a
// float comparison under the default -ftrapping-math, and a branch would keep the whole loop
// scalar.
[[gnu::always_inline]] inline float fast_exp(float x) {
  const uint32_t low = 0u - static_cast<uint32_t>(x < -87.0f);  // all ones where x < -87
  x = std::bit_cast<float>((std::bit_cast<uint32_t>(x) & ~low) |
                           (std::bit_cast<uint32_t>(-87.0f) & low));
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRound = 12582912.0f;         // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kLn2Hi = 0.693145751953125f;  // few mantissa bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  const float n = (x * kLog2e + kRound) - kRound;
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

// exp(x) for any x: fast_exp, and +inf above 88 (where expf overflows at 88.72), so that
// 1 / (1 + exp(-g)) is an exact 0 for very negative g, as with expf. Bitwise selects, as fast_exp's
// clamp.
[[gnu::always_inline]] inline float fast_exp_inf(float x) {
  const uint32_t high = 0u - static_cast<uint32_t>(x > 88.0f);  // all ones where x > 88
  x = std::bit_cast<float>((std::bit_cast<uint32_t>(x) & ~high) |
                           (std::bit_cast<uint32_t>(88.0f) & high));
  return std::bit_cast<float>((std::bit_cast<uint32_t>(fast_exp(x)) & ~high) |
                              (0x7f800000u & high));
}

}  // namespace
}  // namespace md::cpu
