#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace md {

// Element types a checkpoint may hold. Others are rejected by name when a file is opened.
enum class DType : uint8_t { BF16, F16, F32, U8, I64 };

std::string_view dtype_name(DType t);
size_t dtype_size(DType t);
std::optional<DType> dtype_from_name(std::string_view name);

}  // namespace md
