// The 4-bit weight kernels' shared contract (private to src/kernels/cpu). MXFP4 (mxfp4.h) and int4
// (int4.h) are one kernel family: both store a row as K/2 bytes of 4-bit codes, low nibble first
// (the byte order of compressed-tensors' int32 packing on a little-endian machine), and both decode
// a code through a 16-entry table and multiply by a per-group scale. They differ only in the table
// (e2m1 values; or c - 8) and in the scales (one E8M0 byte per 32 columns; or one bf16 per group
// of `group` columns, a multiple of 32). Every path reduces each 32-column sub-group of a row in
// short runs of products of unscaled code values and activations, then applies the sub-group's
// scale once per run (mxfp4.h, "Numerics"), so the two formats share the tiling and its
// bit-identity across row splits, batches and threads.
#pragma once
#include <cstdint>

namespace md::cpu::detail {

enum class Q4Codes : uint8_t {
  kE2m1,  // MXFP4: e2m1 values, E8M0 scale bytes, group 32
  kInt4,  // int4: code c is c - 8, bf16 scales, group a multiple of 32
};

struct Q4Matrix {
  const uint8_t* packed = nullptr;  // row 0: [N, K/2]
  const uint8_t* scales = nullptr;  // row 0: E8M0 [N, K/32], or bf16 [N, K/group] as bytes
  int64_t K = 0;                    // a positive multiple of 32 (and of group)
  int group = 32;
  Q4Codes codes = Q4Codes::kE2m1;
  int64_t scale_row_bytes() const { return codes == Q4Codes::kE2m1 ? K / 32 : K / group * 2; }
};

// The run-time dispatch (mxfp4.cpp): the active level's kernel, and its name ("avx512" at the
// avx512 and avx512bf16 levels, "avx2" or "portable").
void matmul_q4(const Q4Matrix& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
               float* Y, int64_t ldy);
const char* matmul_q4_isa();

// ISA entry points; only matmul_q4 calls them, after checking the level
// (cpu_features.h). q4_avx512.cpp (AVX-512 F/BW/VL/DQ; the avx512 and avx512bf16 levels):
void matmul_q4_avx512(const Q4Matrix& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
                      float* Y, int64_t ldy);
// q4_avx2.cpp (AVX2 + FMA):
void matmul_q4_avx2(const Q4Matrix& w, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
                    float* Y, int64_t ldy);
// q4_portable.cpp (the x86-64 baseline):
void matmul_q4_portable(const Q4Matrix& w, int64_t r0, int64_t r1, const float* X, int B,
                        int64_t ldx, float* Y, int64_t ldy);

// Asymmetric int4's zero-point terms (int4.h, int4_zero_point_terms): the group sums of the
// vectors (xs [B][K/group]), then per row and vector the subtracted term. int4_zero_points.cpp
// holds the portable path and the dispatch; int4_zero_points_avx512.cpp and _avx2.cpp the
// vector ones.
void int4_zero_point_terms_avx512(const uint8_t* scales, const int8_t* z, int64_t G, int64_t r0,
                                  int64_t r1, const float* xs, int B, float* Y, int64_t ldy);
void int4_group_sums_avx512(const float* X, int B, int64_t ldx, int64_t K, int group, float* xs);
void int4_zero_point_terms_avx2(const uint8_t* scales, const int8_t* z, int64_t G, int64_t r0,
                                int64_t r1, const float* xs, int B, float* Y, int64_t ldy);
void int4_group_sums_avx2(const float* X, int B, int64_t ldx, int64_t K, int group, float* xs);

// The code tables, shared by every path and by the reference decoders.
extern const float kE2m1Values[16];  // e2m1: bit 3 the sign, -0 for code 8
extern const float kInt4Values[16];  // c - 8
// The fp32 value of each E8M0 scale byte (2^(s-127), NaN for 255).
extern const float kMxfp4ScaleTable[256];

// The fp32 scale of 32-column sub-group j of one row (the scalar paths' decode).
float q4_subgroup_scale(const Q4Matrix& w, const uint8_t* row_scales, int64_t j);

}  // namespace md::cpu::detail
