// The Kimi tokenizer: tiktoken-style byte-level BPE (ranks from `tiktoken.model`, special tokens
// from `tokenizer_config.json`) with Kimi's pre-tokenisation pattern. Ids are bit-identical to the
// tiktoken Python package driven the way Kimi's tokenization_kimi.py drives it; see
// docs/tokenizer.md for the formats, the pattern translation and the known mismatch classes.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace md {

// Kimi models reserve this many ids after the BPE ranks for special tokens (named or reserved).
inline constexpr int32_t kKimiNumSpecialTokens = 256;

struct SpecialToken {
  int32_t id = 0;
  std::string content;
  // The `special` flag of tokenizer_config.json: tokens with special=false (Kimi's tool-call
  // markers) are still matched as single ids when encoding, but are kept by skip_special decoding.
  bool special = true;
};

class Tokenizer {
 public:
  // Reads `<model_dir>/tiktoken.model` and `<model_dir>/tokenizer_config.json`. Ids from the last
  // rank up to the vocabulary size that have no name become `<|reserved_token_{id}|>`. The
  // vocabulary size is `vocab_size` when given (> 0), else `vocab_size` of
  // `<model_dir>/config.json` (or its text_config) when that file exists, else
  // num_ranks + kKimiNumSpecialTokens.
  // Throws md::Error naming the file (and line) for a missing or malformed file.
  static Tokenizer load(const std::string& model_dir, int64_t vocab_size = -1);

  // What load() does once the files are read: `tiktoken_model` and `tokenizer_config` are their
  // texts, `ranks_path` / `config_path` head the error messages. vocab_size <= 0 means
  // num_ranks + kKimiNumSpecialTokens (or up to the last special id, when that is larger).
  static Tokenizer from_texts(std::string_view tiktoken_model, std::string_view tokenizer_config,
                              int64_t vocab_size = -1,
                              const std::string& ranks_path = "tiktoken.model",
                              const std::string& config_path = "tokenizer_config.json");

  // `ranks[r]` holds the bytes of rank r; specials must have ids >= ranks.size(). Unnamed ids up to
  // vocab_size (default: max(ranks + kKimiNumSpecialTokens, last special + 1)) become reserved.
  static Tokenizer from_parts(std::vector<std::string> ranks, std::vector<SpecialToken> specials,
                              int64_t vocab_size = -1);

  // Text -> ids. With allow_special, occurrences of special-token strings become their ids;
  // without, they are ordinary text. Invalid UTF-8 is first replaced as by sanitize_utf8().
  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const;
  std::vector<int32_t> encode_ordinary(std::string_view text) const { return encode(text, false); }

  // Ids -> bytes (the concatenation of token_bytes; not necessarily valid UTF-8). Special tokens
  // give their content; with skip_special, those flagged special are left out. An id outside
  // [0, vocab_size()) is an md::Error naming it.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  std::string_view token_bytes(int32_t id) const;  // md::Error when out of range
  bool is_special(int32_t id) const;               // any id past the ranks (named or reserved)
  bool skipped_when_decoding(int32_t id) const;    // special and flagged special
  std::optional<int32_t> special_id(std::string_view content) const;

  int32_t vocab_size() const;  // ranks + specials
  int32_t num_ranks() const;
  // From tokenizer_config.json (bos_token / eos_token); nullopt when absent or unknown.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  const std::string& chat_template() const;  // empty when the config has none

 private:
  struct Impl;
  // Validates and indexes the parts; `ranks_src` / `specials_src` name where they came from.
  static Tokenizer build(std::vector<std::string> ranks, std::vector<SpecialToken> specials,
                         int64_t vocab_size, const std::string& ranks_src,
                         const std::string& specials_src);
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;  // immutable after construction, so copies share it
};

// Incremental detokenisation for streaming output: push() returns only complete UTF-8 characters,
// holding back the bytes of a character split across tokens until it completes. Byte sequences
// that can never become valid UTF-8 are emitted as U+FFFD (one per maximal invalid subpart, as
// Python's errors="replace"), so everything returned is valid UTF-8.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false);
  std::string push(int32_t id);
  // Emits whatever is held back (an incomplete character becomes U+FFFD) and resets.
  std::string flush();

 private:
  std::string drain(bool final);
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;
};

// Replaces every maximal invalid UTF-8 subpart by U+FFFD (the Unicode "best practice" that Python's
// bytes.decode("utf-8", "replace") follows). Surrogate code points and overlong forms are invalid.
std::string sanitize_utf8(std::string_view bytes);
bool is_valid_utf8(std::string_view bytes);

// Kimi's pre-tokenisation: the pieces (substrings of `text`, in order) that BPE encodes one by
// one. `text` must be valid UTF-8 (see sanitize_utf8).
std::vector<std::string_view> split_pieces(std::string_view text);

// The pattern as published (Rust fancy-regex syntax, used by tiktoken) and as given to PCRE2.
std::string_view kimi_pattern_original();
std::string_view kimi_pattern_pcre2();

}  // namespace md
