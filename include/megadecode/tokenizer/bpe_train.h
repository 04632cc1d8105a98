// A small byte-level BPE trainer and the writer of Kimi-format tokenizer files, so that every
// random checkpoint made by `make-model` ships a real, loadable tokenizer.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/tokenizer/tokenizer.h"

namespace md {

// Returns num_ranks token byte strings, index = rank. Ranks 0..255 are the single bytes (rank =
// byte value); then merges learned on the corpus after Kimi pre-tokenisation (split_pieces), the
// most frequent adjacent pair first, ties broken by the smaller (left rank, right rank). When the
// corpus has no pair left to merge, the remaining ranks are filled deterministically with new
// byte strings (an existing token followed by one byte) so that any vocabulary size can be made.
// Deterministic: the same corpus and num_ranks give the same ranks on every platform.
std::vector<std::string> train_bpe(std::string_view corpus, int num_ranks);

// Writes `<dir>/tiktoken.model` and `<dir>/tokenizer_config.json` (creating dir). Ids
// ranks.size() .. vocab_size-1 are special: the named `specials` and reserved ones without names;
// bos/eos/unk/pad fields ([BOS], [EOS], [UNK], [PAD]: both tables have them) and chat_template
// (omitted when empty) are set as in Kimi's tokenizer_config.json.
void write_tokenizer_files(const std::string& dir, const std::vector<std::string>& ranks,
                           int64_t vocab_size, const std::string& chat_template,
                           const std::vector<SpecialToken>& specials);
// The same with Kimi Linear's table, kimi_special_tokens(ranks.size(), vocab_size) (>= 20
// special ids).
void write_tokenizer_files(const std::string& dir, const std::vector<std::string>& ranks,
                           int64_t vocab_size, const std::string& chat_template);

// Kimi's named special tokens for a vocabulary with `num_ranks` ranks and `vocab_size` ids: the
// table of moonshotai Kimi-K2 / Kimi-Linear tokenizer_config.json (offsets from the first special
// id; [UNK] and [PAD] take the last two ids, +254 and +255 in Kimi's 256-id special range).
std::vector<SpecialToken> kimi_special_tokens(int32_t num_ranks, int64_t vocab_size);

// Kimi K3's named special tokens (chat_template.h kimi_k3_special_tokens(): offsets from the first
// special id, [UNK]/[PAD] at +254/+255), all special=true, at ids num_ranks + offset. Needs the
// full 256 special ids (vocab_size - num_ranks >= 256).
std::vector<SpecialToken> kimi_k3_tokenizer_specials(int32_t num_ranks, int64_t vocab_size);

// A few KB of varied text (English, code, numbers, CJK, Japanese, Korean, emoji, ...) written for
// this project, so make-model needs no external data.
std::string_view builtin_training_corpus();


}  // namespace md
