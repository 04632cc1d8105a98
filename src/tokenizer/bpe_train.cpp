// BPE training on a pre-tokenised corpus and writing Kimi-format tokenizer files.
#include "megadecode/tokenizer/bpe_train.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>

#include "internal.h"
#include "megadecode/base/error.h"
#include "megadecode/tokenizer/chat_template.h"

namespace md {
namespace {

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

struct Word {
  std::vector<int32_t> syms;
  int64_t freq = 0;
};

// Pair statistics kept up to date as words are rewritten, so each merge only touches the words
// that contain the merged pair.
class PairStats {
 public:
  void add_word(const Word& w, int32_t index, int64_t sign) {
    for (size_t i = 0; i + 1 < w.syms.size(); ++i) {
      uint64_t k = pair_key(w.syms[i], w.syms[i + 1]);
      count_[k] += sign * w.freq;
      if (sign > 0) {
        auto& where = where_[k];
        if (where.empty() || where.back() != index) where.push_back(index);
      }
    }
  }
  // Most frequent pair; ties go to the smallest key, i.e. (left rank, right rank).
  bool best(uint64_t& key) const {
    int64_t best_count = 0;
    for (const auto& [k, c] : count_) {
      if (c > best_count || (c == best_count && c > 0 && k < key)) {
        best_count = c;
        key = k;
      }
    }
    return best_count > 0;
  }
  std::vector<int32_t> take_words(uint64_t key) {
    std::vector<int32_t> w = std::move(where_[key]);
    where_.erase(key);
    std::sort(w.begin(), w.end());
    w.erase(std::unique(w.begin(), w.end()), w.end());
    return w;
  }
  void forget(uint64_t key) { count_.erase(key); }

 private:
  std::unordered_map<uint64_t, int64_t> count_;
  std::unordered_map<uint64_t, std::vector<int32_t>> where_;
};

}  // namespace

std::vector<std::string> train_bpe(std::string_view corpus, int num_ranks) {
  if (num_ranks < 256) fail("train_bpe: num_ranks {} < 256 (the single bytes)", num_ranks);
  std::vector<std::string> ranks;
  ranks.reserve(static_cast<size_t>(num_ranks));
  std::unordered_map<std::string, int32_t> id_of;
  for (int b = 0; b < 256; ++b) {
    ranks.emplace_back(1, static_cast<char>(b));
    id_of.emplace(ranks.back(), b);
  }

  // Unique pieces in byte order, so the result does not depend on hash-map iteration order.
  const std::string text = sanitize_utf8(corpus);
  std::map<std::string_view, int64_t> piece_freq;
  for (std::string_view piece : split_pieces(text)) ++piece_freq[piece];
  std::vector<Word> words;
  words.reserve(piece_freq.size());
  for (const auto& [piece, freq] : piece_freq) {
    Word w;
    w.freq = freq;
    for (unsigned char c : piece) w.syms.push_back(c);
    words.push_back(std::move(w));
  }
  PairStats stats;
  for (size_t i = 0; i < words.size(); ++i) stats.add_word(words[i], static_cast<int32_t>(i), +1);

  uint64_t key = 0;
  while (static_cast<int>(ranks.size()) < num_ranks && stats.best(key)) {
    const int32_t a = static_cast<int32_t>(key >> 32), b = static_cast<int32_t>(key & 0xFFFFFFFF);
    std::string merged = ranks[a] + ranks[b];
    // Two different pairs can spell the same bytes (e.g. "a"+"bc" and "ab"+"c"): reuse the id.
    int32_t id;
    if (auto it = id_of.find(merged); it != id_of.end()) {
      id = it->second;
    } else {
      id = static_cast<int32_t>(ranks.size());
      id_of.emplace(merged, id);
      ranks.push_back(std::move(merged));
    }
    for (int32_t wi : stats.take_words(key)) {
      Word& w = words[wi];
      stats.add_word(w, wi, -1);
      std::vector<int32_t> out;
      out.reserve(w.syms.size());
      for (size_t i = 0; i < w.syms.size(); ++i) {
        if (i + 1 < w.syms.size() && w.syms[i] == a && w.syms[i + 1] == b) {
          out.push_back(id);
          ++i;
        } else {
          out.push_back(w.syms[i]);
        }
      }
      w.syms = std::move(out);
      stats.add_word(w, wi, +1);
    }
    stats.forget(key);
    key = 0;
  }

  // The corpus is exhausted: extend existing tokens by one byte, in rank then byte order.
  for (size_t i = 0; static_cast<int>(ranks.size()) < num_ranks; ++i) {
    for (int c = 0; c < 256 && static_cast<int>(ranks.size()) < num_ranks; ++c) {
      std::string candidate = ranks[i] + static_cast<char>(c);
      if (id_of.emplace(candidate, static_cast<int32_t>(ranks.size())).second) {
        ranks.push_back(std::move(candidate));
      }
    }
  }
  return ranks;
}

std::vector<SpecialToken> kimi_special_tokens(int32_t num_ranks, int64_t vocab_size) {
  const int64_t count = vocab_size - num_ranks;
  if (count < 20) {
    fail("tokenizer: {} special ids (vocab {} - ranks {}) cannot hold Kimi's special tokens "
         "(need >= 20)", count, vocab_size, num_ranks);
  }
  // moonshotai Kimi-K2 / Kimi-Linear tokenizer_config.json added_tokens_decoder, as offsets from
  // the first special id (163584). Offsets 5, 8, 16 and 18..253 are unnamed (reserved). The
  // tool-call markers have special=false there.
  struct Named {
    int64_t offset;
    const char* content;
    bool special;
  };
  static constexpr Named kNamed[] = {
      {0, "[BOS]", true},
      {1, "[EOS]", true},
      {2, "<|im_end|>", true},
      {3, "<|im_user|>", true},
      {4, "<|im_assistant|>", true},
      {6, "<|start_header_id|>", true},
      {7, "<|end_header_id|>", true},
      {9, "[EOT]", true},
      {10, "<|im_system|>", true},
      {11, "<|tool_calls_section_begin|>", false},
      {12, "<|tool_calls_section_end|>", false},
      {13, "<|tool_call_begin|>", false},
      {14, "<|tool_call_argument_begin|>", false},
      {15, "<|tool_call_end|>", false},
      {17, "<|im_middle|>", true},
  };
  std::vector<SpecialToken> out;
  for (const Named& n : kNamed) {
    out.push_back(SpecialToken{static_cast<int32_t>(num_ranks + n.offset), n.content, n.special});
  }
  out.push_back(SpecialToken{static_cast<int32_t>(vocab_size - 2), "[UNK]", true});
  out.push_back(SpecialToken{static_cast<int32_t>(vocab_size - 1), "[PAD]", true});
  return out;
}

std::vector<SpecialToken> kimi_k3_tokenizer_specials(int32_t num_ranks, int64_t vocab_size) {
  const int64_t count = vocab_size - num_ranks;
  if (count < 256) {
    fail("tokenizer: {} special ids (vocab {} - ranks {}) cannot hold Kimi K3's special tokens "
         "(need 256)", count, vocab_size, num_ranks);
  }
  std::vector<SpecialToken> out;
  for (const NamedSpecialToken& t : kimi_k3_special_tokens())
    out.push_back(SpecialToken{num_ranks + t.offset, std::string(t.content), true});
  return out;
}

void write_tokenizer_files(const std::string& dir, const std::vector<std::string>& ranks,
                           int64_t vocab_size, const std::string& chat_template) {
  if (ranks.empty()) fail("write_tokenizer_files: no ranks");
  write_tokenizer_files(dir, ranks, vocab_size, chat_template,
                        kimi_special_tokens(static_cast<int32_t>(ranks.size()), vocab_size));
}

void write_tokenizer_files(const std::string& dir, const std::vector<std::string>& ranks,
                           int64_t vocab_size, const std::string& chat_template,
                           const std::vector<SpecialToken>& specials) {
  namespace fs = std::filesystem;
  if (ranks.empty()) fail("write_tokenizer_files: no ranks");
  const int32_t num_ranks = static_cast<int32_t>(ranks.size());
  // Building the tokenizer validates the parts (unique tokens, every byte present, ids in range)
  // before anything is written.
  (void)Tokenizer::from_parts(ranks, specials, vocab_size);

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("{}: cannot create directory: {}", dir, ec.message());

  const std::string model_path = (fs::path(dir) / "tiktoken.model").string();
  {
    std::ofstream f(model_path, std::ios::binary | std::ios::trunc);
    if (!f) fail("{}: cannot open for writing", model_path);
    std::string buf;
    for (int32_t r = 0; r < num_ranks; ++r) {
      buf += tokenizer_detail::base64_encode(ranks[r]);
      buf += ' ';
      buf += std::to_string(r);
      buf += '\n';
    }
    f.write(buf.data(), static_cast<std::streamsize>(buf.size()));
    if (!f) fail("{}: write failed", model_path);
  }

  nlohmann::ordered_json decoder = nlohmann::ordered_json::object();
  std::vector<SpecialToken> sorted = specials;
  std::sort(sorted.begin(), sorted.end(),
            [](const SpecialToken& x, const SpecialToken& y) { return x.id < y.id; });
  nlohmann::ordered_json additional = nlohmann::ordered_json::array();
  for (const SpecialToken& t : sorted) {
    decoder[std::to_string(t.id)] = {{"content", t.content},  {"lstrip", false},
                                     {"normalized", false},   {"rstrip", false},
                                     {"single_word", false},  {"special", t.special}};
    if (t.content != "[BOS]" && t.content != "[EOS]" && t.content != "[UNK]" &&
        t.content != "[PAD]") {
      additional.push_back(t.content);
    }
  }
  nlohmann::ordered_json cfg;
  cfg["added_tokens_decoder"] = decoder;
  cfg["additional_special_tokens"] = additional;
  cfg["bos_token"] = "[BOS]";
  if (!chat_template.empty()) cfg["chat_template"] = chat_template;
  cfg["clean_up_tokenization_spaces"] = false;
  cfg["eos_token"] = "[EOS]";
  cfg["model_max_length"] = 1048576;
  cfg["pad_token"] = "[PAD]";
  cfg["tokenizer_class"] = "TikTokenTokenizer";
  cfg["unk_token"] = "[UNK]";
  const std::string config_path = (fs::path(dir) / "tokenizer_config.json").string();
  std::ofstream f(config_path, std::ios::binary | std::ios::trunc);
  if (!f) fail("{}: cannot open for writing", config_path);
  f << cfg.dump(2) << '\n';
  if (!f) fail("{}: write failed", config_path);
}


}  // namespace md
