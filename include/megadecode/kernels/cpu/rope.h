// Rotary position embedding, neox layout (rotate_half: the first half of a head pairs with the
// second), as Qwen3 applies it to queries and keys. Kimi's own attention is NoPE; the speculative
// draft (spec/) is the user.
#pragma once
#include <cstdint>

namespace md::cpu {

// x [heads][head_dim] at `position`: x = x * cos + rotate_half(x) * sin with angle
// position * theta^(-2i / head_dim) for frequency i (shared by lanes i and i + head_dim / 2).
// The angles and their cos/sin are computed in double and rounded once to fp32. With rnd
// the tables are rounded to bf16 and both products and their sum are rounded to bf16, as a bf16
// tensor expression computes it (the seed's reference: cos/sin cast to the activation dtype).
// head_dim must be even.
void rope_neox(float* x, int heads, int head_dim, int64_t position, double theta, bool rnd);

}  // namespace md::cpu
