#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace md {

// Element types a checkpoint may hold. Others are rejected by name when a file is opened.
enum class DType : uint8_t { BF16, F16, F32, U8, I32, I64, F8E4M3 };

// How a matrix's elements are encoded beyond its storage type: plain values of its DType, or codes
// with group scales (kernels/cpu/mxfp4.h, int4.h, int8.h; storage U8: two 4-bit codes a byte, or
// one 8-bit code; F8E4M3 for FP8).
enum class WeightQuant : uint8_t {
  kNone,
  kMxfp4,  // e2m1 codes, E8M0 scale per 32 columns
  kInt4,   // int4 codes (c - 8), bf16 scale per group of columns
  kInt8,   // int8 codes (c - 128), bf16 scale per group of columns
  kFp8,    // FP8 e4m3 values, fp32 scale per group of columns (block scales expanded per row)
};

std::string_view dtype_name(DType t);
size_t dtype_size(DType t);
std::optional<DType> dtype_from_name(std::string_view name);

}  // namespace md
