// Helpers shared by the tokenizer's source files (not part of the public API).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace md::tokenizer_detail {

// Length of the valid UTF-8 character at s[i]; otherwise -(length of the maximal invalid subpart
// there). A valid but truncated prefix at the end of the input also gives -(its length).
int utf8_step(const unsigned char* s, size_t n, size_t i);

std::string base64_encode(std::string_view bytes);

}  // namespace md::tokenizer_detail
