// Kimi's pre-tokenisation pattern on PCRE2 (JIT), and the UTF-8 validation that guards it.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "megadecode/base/error.h"
#include "megadecode/tokenizer/tokenizer.h"
#include "internal.h"

namespace md {
namespace {

// The pattern exactly as Kimi's tokenization_kimi.py passes it to tiktoken (the eight alternatives
// joined by '|'). tiktoken compiles it with Rust fancy-regex, whose semantics are the reference.
constexpr std::string_view kOriginal =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*)"
    R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
    R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

// The same language in PCRE2 10.42 syntax. Three translations, each checked against tiktoken by
// the golden tests (tests/tokenizer, docs/tokenizer.md):
//  1. `[X&&[^\p{Han}]]` (class intersection, Rust syntax): PCRE2 has no intersection and silently
//     reads `&&` as two literal '&' characters inside the class. Each such class becomes
//     `(?:(?!\p{sc=Han})[X])`: one character of X that is not Han.
//  2. `\p{Han}`: Rust reads a bare script name as Script; PCRE2 >= 10.40 reads it as
//     Script_Extensions, which also covers shared CJK punctuation such as U+3001 '、' (tiktoken
//     splits "中、" into two pieces). Written `\p{sc=Han}`.
//  3. `\s` / `\S`: Rust uses the Unicode White_Space property; PCRE2's UCP `\s` is \p{Z} plus \h
//     and \v, which adds U+180E MONGOLIAN VOWEL SEPARATOR (not White_Space since Unicode 6.3). The
//     White_Space set is spelled out (MD_KIMI_WS) so both engines agree.
#define MD_KIMI_WS \
  R"(\t\n\x{0B}\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})"
#define MD_KIMI_UPPER R"((?:(?!\p{sc=Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]))"
#define MD_KIMI_LOWER R"((?:(?!\p{sc=Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}]))"
#define MD_KIMI_SUFFIX R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
constexpr std::string_view kPcre2 =
    R"([\p{sc=Han}]+)"
    "|[^\\r\\n\\p{L}\\p{N}]?" MD_KIMI_UPPER "*" MD_KIMI_LOWER "+" MD_KIMI_SUFFIX
    "|[^\\r\\n\\p{L}\\p{N}]?" MD_KIMI_UPPER "+" MD_KIMI_LOWER "*" MD_KIMI_SUFFIX
    R"(|\p{N}{1,3})"
    "| ?[^" MD_KIMI_WS "\\p{L}\\p{N}]+[\\r\\n]*"
    "|[" MD_KIMI_WS "]*[\\r\\n]+"
    "|[" MD_KIMI_WS "]+(?![^" MD_KIMI_WS "])"
    "|[" MD_KIMI_WS "]+";
#undef MD_KIMI_WS
#undef MD_KIMI_UPPER
#undef MD_KIMI_LOWER
#undef MD_KIMI_SUFFIX

struct CompiledPattern {
  pcre2_code* code = nullptr;
  bool jit = false;
};

const CompiledPattern& pattern() {
  static const CompiledPattern compiled = [] {
    CompiledPattern c;
    int err = 0;
    PCRE2_SIZE err_off = 0;
    c.code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPcre2.data()), kPcre2.size(), PCRE2_UTF,
                           &err, &err_off, nullptr);
    if (!c.code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      fail("tokenizer: PCRE2 rejects the Kimi pattern at offset {}: {}", err_off,
           reinterpret_cast<const char*>(msg));
    }
    // Without JIT (e.g. no executable memory) the interpreter gives the same pieces, only slower.
    c.jit = pcre2_jit_compile(c.code, PCRE2_JIT_COMPLETE) == 0;
    return c;
  }();
  return compiled;
}

// Match data and a JIT stack per thread: both are mutable state that PCRE2 cannot share between
// concurrent matches, and creating them per call would cost a few syscalls per encode.
struct ThreadMatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    // Repeated groups (the non-Han letter runs) keep one backtrack frame per character on the JIT
    // stack, so a very long word needs a large stack; it is reserved, not committed, up front.
    stack = pcre2_jit_stack_create(64 << 10, 256 << 20, nullptr);
    if (!data || !context || !stack) fail("tokenizer: out of memory creating PCRE2 match state");
    pcre2_jit_stack_assign(context, nullptr, stack);
    // The default limits (10M backtracking steps, 20 MB interpreter heap) reject runs of a few
    // million letters; the pattern has no exponential backtracking, so lift them.
    pcre2_set_match_limit(context, UINT32_MAX);
    pcre2_set_depth_limit(context, UINT32_MAX);
    pcre2_set_heap_limit(context, UINT32_MAX);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  ThreadMatchState(const ThreadMatchState&) = delete;
  ThreadMatchState& operator=(const ThreadMatchState&) = delete;
};

inline bool is_cont(unsigned char c) { return (c & 0xC0) == 0x80; }

}  // namespace

int tokenizer_detail::utf8_step(const unsigned char* s, size_t n, size_t i) {
  unsigned char c = s[i];
  if (c < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // > U+10FFFF
  } else {
    return -1;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= n) return -k;
    unsigned char b = s[i + k];
    bool ok = k == 1 ? (b >= lo && b <= hi) : is_cont(b);
    if (!ok) return -k;
  }
  return need + 1;
}

using tokenizer_detail::utf8_step;

std::string_view kimi_pattern_original() { return kOriginal; }
std::string_view kimi_pattern_pcre2() { return kPcre2; }

bool is_valid_utf8(std::string_view bytes) {
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t n = bytes.size(), i = 0;
  while (i < n) {
    // ASCII runs dominate typical input; skip them eight bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, s + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    int step = utf8_step(s, n, i);
    if (step < 0) return false;
    i += static_cast<size_t>(step);
  }
  return true;
}

std::string sanitize_utf8(std::string_view bytes) {
  static constexpr char kReplacement[] = "\xEF\xBF\xBD";
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t n = bytes.size(), i = 0;
  std::string out;
  out.reserve(n + 8);
  while (i < n) {
    int step = utf8_step(s, n, i);
    if (step > 0) {
      out.append(bytes.data() + i, static_cast<size_t>(step));
      i += static_cast<size_t>(step);
    } else {
      out.append(kReplacement, 3);
      i += static_cast<size_t>(-step);
    }
  }
  return out;
}

std::vector<std::string_view> split_pieces(std::string_view text) {
  std::vector<std::string_view> pieces;
  if (text.empty()) return pieces;
  const CompiledPattern& p = pattern();
  thread_local ThreadMatchState state;
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data);
  size_t offset = 0;
  pieces.reserve(text.size() / 4 + 1);
  while (offset < text.size()) {
    // Unanchored search from `offset`, like the reference's find_iter: a character no alternative
    // matches would be skipped by both (none exists: the alternatives cover every code point).
    int rc = p.jit ? pcre2_jit_match(p.code, subject, text.size(), offset, PCRE2_NO_UTF_CHECK,
                                     state.data, state.context)
                   : pcre2_match(p.code, subject, text.size(), offset, PCRE2_NO_UTF_CHECK,
                                 state.data, state.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      fail("tokenizer: PCRE2 match failed at byte {} of {}: {}", offset, text.size(),
           reinterpret_cast<const char*>(msg));
    }
    size_t b = ov[0], e = ov[1];
    if (e <= b) break;  // the pattern cannot match empty; guard against looping forever anyway
    pieces.emplace_back(text.data() + b, e - b);
    offset = e;
  }
  return pieces;
}

}  // namespace md
