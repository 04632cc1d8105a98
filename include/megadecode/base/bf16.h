// bfloat16 and float16 scalar conversions (the bf16 ones shared with the CUDA kernels). bf16 is
// stored as raw uint16 bits so that tensors can be used straight from a memory-mapped checkpoint.
#pragma once
#include <cstdint>
#include <cstring>

#include "megadecode/base/host_device.h"

namespace md {

using bf16 = uint16_t;  // raw bfloat16 bits

MD_HOST_DEVICE float bf16_to_f32(bf16 h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as PyTorch's float->bfloat16 conversion does; NaN stays NaN.
MD_HOST_DEVICE bf16 f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

// The value a float takes after a round trip through bf16 (the reference's rounding points).
MD_HOST_DEVICE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace md
