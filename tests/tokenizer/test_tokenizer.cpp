// Tokenizer tests: ids identical to the tiktoken reference (made by make_tiktoken_golden.py into
// tests/data/tokenizer/tiktoken_golden.json), decoding, streaming, special tokens, file
// validation, the invalid UTF-8 policy and the BPE trainer.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <gtest/gtest.h>
#include <pcre2.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "megadecode/base/error.h"
#include "megadecode/tokenizer/bpe_train.h"
#include "megadecode/tokenizer/chat_template.h"
#include "megadecode/tokenizer/tokenizer.h"
#include "test_util.h"

namespace md {
namespace {

using nlohmann::json;

std::string tok_dir() { return test::data_dir() + "/data/tokenizer"; }

const Tokenizer& test_tokenizer() {
  static const Tokenizer tok = Tokenizer::load(tok_dir());
  return tok;
}

std::string b64decode(const std::string& s) {
  static const std::string kAlpha =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t buf = 0;
  int bits = 0;
  for (char c : s) {
    if (c == '=') break;
    buf = (buf << 6) | static_cast<uint32_t>(kAlpha.find(c));
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((buf >> bits) & 0xFF));
    }
  }
  return out;
}

struct GoldenCase {
  std::string name, text;  // text: the raw input bytes (may be invalid UTF-8)
  std::vector<int32_t> ids, ids_ordinary;
};

const std::vector<GoldenCase>& golden_cases() {
  static const std::vector<GoldenCase> cases = [] {
    std::ifstream f(tok_dir() + "/tiktoken_golden.json");
    EXPECT_TRUE(f.good()) << "missing golden file";
    json j = json::parse(f);
    std::vector<GoldenCase> out;
    for (const auto& c : j["cases"]) {
      GoldenCase g;
      g.name = c["name"].get<std::string>();
      g.text = c.contains("bytes_b64") ? b64decode(c["bytes_b64"].get<std::string>())
                                       : c["text"].get<std::string>();
      g.ids = c["ids"].get<std::vector<int32_t>>();
      g.ids_ordinary = c["ids_ordinary"].get<std::vector<int32_t>>();
      out.push_back(std::move(g));
    }
    return out;
  }();
  return cases;
}

// Code points of valid UTF-8 text.
std::vector<char32_t> code_points(std::string_view s) {
  std::vector<char32_t> out;
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += static_cast<size_t>(n);
  }
  return out;
}

// True when PCRE2's Unicode tables (10.42: Unicode 15.0.0) have no character at `cp` (\p{Cn}).
bool unassigned_in_pcre2(char32_t cp) {
  static pcre2_code* re = [] {
    int err;
    PCRE2_SIZE off;
    return pcre2_compile(reinterpret_cast<PCRE2_SPTR>("^\\p{Cn}$"), PCRE2_ZERO_TERMINATED,
                         PCRE2_UTF, &err, &off, nullptr);
  }();
  std::string utf8;
  if (cp < 0x80) {
    utf8 = {static_cast<char>(cp)};
  } else if (cp < 0x800) {
    utf8 = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
  } else if (cp < 0x10000) {
    utf8 = {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
            static_cast<char>(0x80 | (cp & 0x3F))};
  } else {
    utf8 = {static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
            static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
  }
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  int rc = pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(utf8.data()), utf8.size(), 0, 0, md,
                       nullptr);
  pcre2_match_data_free(md);
  return rc > 0;
}

// The only accepted difference from the reference. tiktoken's Rust regex tables are newer
// (Unicode 16) than PCRE2 10.42's (Unicode 15.0.0): a code point assigned after 15.0 — e.g. CJK
// Unified Ideographs Extension I (U+2EBF0..U+2EE5D, Unicode 15.1, sc=Han) or the Unicode 16
// scripts — is a letter/Han there but unassigned (Cn) here, so the pieces around it differ.
// Such cases are counted and printed, never silently skipped; any other mismatch fails.
bool has_code_point_newer_than_pcre2_tables(const std::string& text) {
  for (char32_t cp : code_points(sanitize_utf8(text))) {
    if (unassigned_in_pcre2(cp)) return true;
  }
  return false;
}

TEST(TokenizerGolden, IdsMatchTiktoken) {
  const Tokenizer& tok = test_tokenizer();
  ASSERT_EQ(tok.num_ranks(), 2000);
  ASSERT_GE(golden_cases().size(), 400u);
  std::vector<std::string> newer_unicode;
  for (const GoldenCase& g : golden_cases()) {
    std::vector<int32_t> ids = tok.encode(g.text, true);
    std::vector<int32_t> ordinary = tok.encode_ordinary(g.text);
    if (ids == g.ids && ordinary == g.ids_ordinary) continue;
    if (has_code_point_newer_than_pcre2_tables(g.text)) {
      newer_unicode.push_back(g.name);
      continue;
    }
    ADD_FAILURE() << "case " << g.name << ": ids differ from tiktoken"
                  << (ids == g.ids ? " (encode_ordinary only)" : "");
  }
  std::string names;
  for (const auto& n : newer_unicode) names += " " + n;
  std::cout << "[ info ] " << newer_unicode.size() << " of " << golden_cases().size()
            << " cases differ only through code points newer than Unicode 15.0:" << names << "\n";
  EXPECT_LE(newer_unicode.size(), golden_cases().size() / 20);
}

TEST(TokenizerGolden, DecodeRoundTrips) {
  const Tokenizer& tok = test_tokenizer();
  for (const GoldenCase& g : golden_cases()) {
    std::string expect = sanitize_utf8(g.text);
    EXPECT_EQ(tok.decode(tok.encode(g.text, true)), expect) << g.name;
    EXPECT_EQ(tok.decode(tok.encode_ordinary(g.text)), expect) << g.name;
  }
}

TEST(TokenizerGolden, StreamingEqualsWholeDecode) {
  const Tokenizer& tok = test_tokenizer();
  int held_back = 0;
  for (const GoldenCase& g : golden_cases()) {
    std::vector<int32_t> ids = tok.encode(g.text, true);
    StreamDecoder sd(tok);
    std::string out;
    for (int32_t id : ids) {
      std::string part = sd.push(id);
      EXPECT_TRUE(is_valid_utf8(part)) << g.name;
      if (part.empty() && !tok.token_bytes(id).empty()) ++held_back;
      out += part;
    }
    out += sd.flush();
    EXPECT_EQ(out, sanitize_utf8(g.text)) << g.name;
  }
  EXPECT_GT(held_back, 0) << "no case split a character across tokens";
}

TEST(TokenizerStream, MultiByteCharacterSplitAcrossTokens) {
  const Tokenizer& tok = test_tokenizer();
  // U+1D11E (4 bytes) is not in the small vocabulary: it takes several tokens, and nothing may
  // come out before its last byte arrives.
  const std::string clef = "\xF0\x9D\x84\x9E";
  std::vector<int32_t> ids = tok.encode(clef);
  ASSERT_GE(ids.size(), 2u);
  StreamDecoder sd(tok);
  for (size_t i = 0; i + 1 < ids.size(); ++i) EXPECT_EQ(sd.push(ids[i]), "") << i;
  EXPECT_EQ(sd.push(ids.back()), clef);
  EXPECT_EQ(sd.push(tok.encode("!")[0]), "!");
  EXPECT_EQ(sd.flush(), "");
  ids.clear();  // single-byte tokens (rank = byte value) from here on
  for (unsigned char c : clef) ids.push_back(c);
  // An incomplete character at the end becomes one U+FFFD on flush.
  EXPECT_EQ(sd.push(ids[0]), "");
  EXPECT_EQ(sd.push(ids[1]), "");
  EXPECT_EQ(sd.flush(), "\xEF\xBF\xBD");
  // A byte that cannot continue the character settles it at once.
  EXPECT_EQ(sd.push(ids[0]), "");
  EXPECT_EQ(sd.push(tok.encode("a")[0]), "\xEF\xBF\xBD" "a");
  // A special token in the middle of a character: U+FFFD, then the token's text.
  EXPECT_EQ(sd.push(ids[0]), "");
  EXPECT_EQ(sd.push(*tok.special_id("<|im_end|>")), "\xEF\xBF\xBD<|im_end|>");
  StreamDecoder skipping(tok, /*skip_special=*/true);
  EXPECT_EQ(skipping.push(*tok.special_id("<|im_end|>")), "");
  EXPECT_EQ(skipping.push(*tok.special_id("<|tool_call_begin|>")), "<|tool_call_begin|>");
  EXPECT_THROW(skipping.push(tok.vocab_size()), Error);
}

TEST(TokenizerSpecial, KimiTableAndFlags) {
  const Tokenizer& tok = test_tokenizer();
  const int32_t base = tok.num_ranks();
  EXPECT_EQ(tok.vocab_size(), base + kKimiNumSpecialTokens);
  const std::pair<int, const char*> table[] = {
      {0, "[BOS]"}, {1, "[EOS]"}, {2, "<|im_end|>"}, {3, "<|im_user|>"}, {4, "<|im_assistant|>"},
      {6, "<|start_header_id|>"}, {7, "<|end_header_id|>"}, {9, "[EOT]"}, {10, "<|im_system|>"},
      {11, "<|tool_calls_section_begin|>"}, {12, "<|tool_calls_section_end|>"},
      {13, "<|tool_call_begin|>"}, {14, "<|tool_call_argument_begin|>"}, {15, "<|tool_call_end|>"},
      {17, "<|im_middle|>"}, {254, "[UNK]"}, {255, "[PAD]"}};
  for (auto [off, name] : table) {
    EXPECT_EQ(tok.special_id(name), base + off) << name;
    EXPECT_EQ(tok.token_bytes(base + off), name);
    EXPECT_TRUE(tok.is_special(base + off));
  }
  EXPECT_EQ(tok.token_bytes(base + 5), "<|reserved_token_" + std::to_string(base + 5) + "|>");
  EXPECT_EQ(tok.bos_id(), base);
  EXPECT_EQ(tok.eos_id(), base + 1);
  EXPECT_FALSE(tok.is_special(base - 1));
  EXPECT_FALSE(tok.special_id("<|nope|>").has_value());
  EXPECT_FALSE(tok.chat_template().empty());

  EXPECT_EQ(tok.encode("<|im_end|>"), std::vector<int32_t>{base + 2});
  EXPECT_GT(tok.encode("<|im_end|>", false).size(), 1u);
  EXPECT_EQ(tok.decode(tok.encode("<|im_end|>", false)), "<|im_end|>");
  std::vector<int32_t> ids = {base + 10, tok.encode("x")[0], base + 11, base + 2};
  EXPECT_EQ(tok.decode(ids), "<|im_system|>x<|tool_calls_section_begin|><|im_end|>");
  // skip_special drops tokens flagged special, keeps Kimi's tool-call markers (special=false).
  EXPECT_EQ(tok.decode(ids, true), "x<|tool_calls_section_begin|>");
}

TEST(TokenizerEdge, EmptyInputAndOutOfRangeIds) {
  const Tokenizer& tok = test_tokenizer();
  EXPECT_TRUE(tok.encode("").empty());
  EXPECT_TRUE(tok.encode_ordinary("").empty());
  EXPECT_EQ(tok.decode({}), "");
  for (int32_t bad : {-1, tok.vocab_size(), 1 << 30}) {
    try {
      tok.decode({1, bad});
      ADD_FAILURE() << "no error for id " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
    }
    EXPECT_THROW(tok.token_bytes(bad), Error);
  }
}

TEST(TokenizerEdge, InvalidUtf8IsReplacedLikePython) {
  // Expected strings follow bytes.decode("utf-8", "replace"): one U+FFFD per maximal subpart.
  const std::string R = "\xEF\xBF\xBD";
  EXPECT_EQ(sanitize_utf8("ab\x80" "cd"), "ab" + R + "cd");
  EXPECT_EQ(sanitize_utf8("\xE4\xB8 y"), R + " y");             // truncated 3-byte: one U+FFFD
  EXPECT_EQ(sanitize_utf8("\xED\xA0\x80"), R + R + R);          // surrogate: three
  EXPECT_EQ(sanitize_utf8("\xC0\xAF"), R + R);                  // overlong lead bytes
  EXPECT_EQ(sanitize_utf8("\xF0\x9F\x98"), R);                  // truncated at end
  EXPECT_EQ(sanitize_utf8("\xF4\x90\x80\x80"), R + R + R + R);  // > U+10FFFF
  EXPECT_EQ(sanitize_utf8("ok \xE4\xB8\xAD"), "ok \xE4\xB8\xAD");
  EXPECT_FALSE(is_valid_utf8("a\xFF"));
  EXPECT_TRUE(is_valid_utf8("plain ascii text, long enough for the 8-byte fast path \xC3\xA9"));
  const Tokenizer& tok = test_tokenizer();
  std::string bad = "x\xFF\xE4\xB8<|im_end|>\x80";
  EXPECT_EQ(tok.encode(bad), tok.encode(sanitize_utf8(bad)));
  EXPECT_EQ(tok.decode(tok.encode(bad)), sanitize_utf8(bad));
}

TEST(TokenizerPattern, TranslationKeepsReferenceSemantics) {
  auto pieces = [](std::string_view s) {
    std::vector<std::string> out;
    for (auto p : split_pieces(s)) out.emplace_back(p);
    return out;
  };
  using V = std::vector<std::string>;
  // Script=Han, not Script_Extensions: U+3001 is not Han, so it is a piece of its own.
  EXPECT_EQ(pieces("中文、。x"), (V{"中文", "、。", "x"}));
  // Letters stop at Han (the intersected classes); the contraction is case-insensitive.
  EXPECT_EQ(pieces("abc中DON'T"), (V{"abc", "中", "DON'T"}));
  EXPECT_EQ(pieces("it'\xC5\xBF"), (V{"it'\xC5\xBF"}));  // 'ſ folds to 's
  // U+180E is not White_Space (PCRE2's \s would say it is).
  EXPECT_EQ(pieces("\xE1\xA0\x8E!"), (V{"\xE1\xA0\x8E!"}));
  EXPECT_EQ(pieces("a  b\n\n c"), (V{"a", " ", " b", "\n\n", " c"}));
  EXPECT_EQ(pieces("12345"), (V{"123", "45"}));
  EXPECT_NE(kimi_pattern_original().find("&&"), std::string_view::npos);
  // Known divergence (the mismatch class of IdsMatchTiktoken): U+2EBF0 (CJK Extension I, Unicode
  // 15.1) is Han for tiktoken, which keeps "中\U0002EBF0" as one piece, but unassigned for PCRE2
  // 10.42 (Unicode 15.0), which splits it off. The small test vocabulary happens to give the same
  // ids either way; a full vocabulary may not.
  EXPECT_EQ(pieces("中\xF0\xAE\xAF\xB0"), (V{"中", "\xF0\xAE\xAF\xB0"}));
  EXPECT_EQ(kimi_pattern_pcre2().find("&&"), std::string_view::npos);
}

class TokenizerFiles : public ::testing::Test {
 protected:
  void write(const std::string& model, const std::string& config = "{}") {
    std::ofstream(dir_ / "tiktoken.model") << model;
    std::ofstream(dir_ / "tokenizer_config.json") << config;
  }
  std::string all_bytes() {
    std::string s;
    for (int b = 0; b < 256; ++b) {
      static const char* kA = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
      s += std::string{kA[b >> 2], kA[(b & 3) << 4], '=', '='} + " " + std::to_string(b) + "\n";
    }
    return s;
  }
  std::string error_of() {
    try {
      Tokenizer::load(dir_.path());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  test::TempDir dir_{"tok"};
};

TEST_F(TokenizerFiles, ValidMinimalFileLoads) {
  write(all_bytes() + "YWI= 256\n", R"({"added_tokens_decoder": {"258": {"content": "<|x|>"}}})");
  Tokenizer t = Tokenizer::load(dir_.path());
  EXPECT_EQ(t.num_ranks(), 257);
  EXPECT_EQ(t.vocab_size(), 257 + kKimiNumSpecialTokens);
  EXPECT_EQ(t.encode("ab<|x|>"), (std::vector<int32_t>{256, 258}));
  EXPECT_EQ(Tokenizer::load(dir_.path(), 300).vocab_size(), 300);
  std::ofstream(dir_ / "config.json") << R"({"text_config": {"vocab_size": 280}})";
  EXPECT_EQ(Tokenizer::load(dir_.path()).vocab_size(), 280);
}

TEST_F(TokenizerFiles, FromTextsIsLoadWithoutFiles) {
  const std::string model = all_bytes() + "YWI= 256\n";
  const std::string config = R"({"added_tokens_decoder": {"258": {"content": "<|x|>"}}})";
  Tokenizer t = Tokenizer::from_texts(model, config);
  EXPECT_EQ(t.vocab_size(), 257 + kKimiNumSpecialTokens);
  EXPECT_EQ(t.encode("ab<|x|>"), (std::vector<int32_t>{256, 258}));
  try {
    Tokenizer::from_texts(model, "{bad", -1, "m.model", "c.json");
    ADD_FAILURE() << "accepted bad JSON";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("c.json: invalid JSON"), std::string::npos) << e.what();
  }
}

// A corrupt special id or vocabulary size used to allocate a name per id up to it (GBs for an id
// like 1e9; tests/fuzz/corpus/tokenizer/regress-huge-special-id); now it is a named error.
TEST_F(TokenizerFiles, SpecialIdRangeIsBounded) {
  write(all_bytes(), R"({"added_tokens_decoder": {"1000000000": {"content": "<x>"}}})");
  EXPECT_NE(error_of().find("at most 65536 are supported"), std::string::npos) << error_of();
  write(all_bytes());
  EXPECT_THROW(Tokenizer::load(dir_.path(), int64_t{1} << 28), Error);
  EXPECT_EQ(Tokenizer::load(dir_.path(), 256 + 65536).vocab_size(), 256 + 65536);
}

TEST_F(TokenizerFiles, BadFilesNameFileAndLine) {
  const std::string model = dir_ / "tiktoken.model";
  struct Bad {
    std::string content, expect;
  } cases[] = {
      {all_bytes() + "YWI=\n", model + ":257: expected '<base64 token> <rank>', found no rank"},
      {all_bytes() + "YW*= 256\n", model + ":257: bad base64"},
      {all_bytes() + "YWI 256\n", model + ":257: bad base64"},
      {all_bytes() + "YWI= 255\n", model + ":257: duplicate rank 255"},
      {all_bytes() + "YWI= x1\n", model + ":257: bad rank"},
      {all_bytes() + "YWI= 300\n", model + ": ranks are not contiguous: rank 256 is missing"},
      {all_bytes() + "AA== 256\n", "rank 256 repeats the bytes of rank 0"},
      {"", model + ": no ranks"},
      {"YWI= 0\n", "byte 0x00 has no rank"},
  };
  for (const Bad& b : cases) {
    write(b.content);
    std::string err = error_of();
    EXPECT_NE(err.find(b.expect), std::string::npos) << "got: " << err << "\nwant: " << b.expect;
  }
  write(all_bytes(), "{not json");
  EXPECT_NE(error_of().find(dir_ / "tokenizer_config.json"), std::string::npos);
  write(all_bytes(), R"({"added_tokens_decoder": {"5": {"content": "<x>"}}})");
  EXPECT_NE(error_of().find("outside the special range"), std::string::npos);
  write(all_bytes(), R"({"added_tokens_decoder": {"zz": {"content": "<x>"}}})");
  EXPECT_NE(error_of().find("is not a token id"), std::string::npos);
  write(all_bytes(), R"({"eos_token": "<|missing|>"})");
  EXPECT_NE(error_of().find("eos_token"), std::string::npos);
  std::filesystem::remove(dir_ / "tiktoken.model");
  EXPECT_NE(error_of().find(model + ": cannot open"), std::string::npos);
}

TEST(BpeTrainer, DeterministicAndLoadable) {
  std::vector<std::string> a = train_bpe(builtin_training_corpus(), 1000);
  std::vector<std::string> b = train_bpe(builtin_training_corpus(), 1000);
  ASSERT_EQ(a.size(), 1000u);
  EXPECT_EQ(a, b);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(a[i], std::string(1, static_cast<char>(i)));
  std::set<std::string> unique(a.begin(), a.end());
  EXPECT_EQ(unique.size(), a.size());
  // The first merge is the corpus's most frequent pair; the test data was made from this corpus.
  EXPECT_EQ(a[256], test_tokenizer().token_bytes(256));

  // More ranks than the corpus can merge: filled up deterministically, still loadable.
  std::vector<std::string> big = train_bpe("tiny corpus", 3000);
  EXPECT_EQ(big.size(), 3000u);
  test::TempDir dir("bpe");
  write_tokenizer_files(dir.path(), big, 3000 + 256, std::string(kimi_linear_chat_template()));
  Tokenizer t = Tokenizer::load(dir.path());
  EXPECT_EQ(t.vocab_size(), 3256);
  EXPECT_EQ(t.special_id("<|im_middle|>"), 3017);
  EXPECT_EQ(t.special_id("[PAD]"), 3255);
  EXPECT_EQ(t.chat_template(), kimi_linear_chat_template());
  std::string text = "tiny corpus, tinier text <|im_end|> 人工";
  EXPECT_EQ(t.decode(t.encode(text)), text);
  EXPECT_THROW(train_bpe("x", 100), Error);
  EXPECT_THROW(write_tokenizer_files(dir.path(), big, 3010, ""), Error);
}

TEST(TokenizerParts, FromParts) {
  std::vector<std::string> ranks;
  for (int i = 0; i < 256; ++i) ranks.emplace_back(1, static_cast<char>(i));
  ranks.push_back("ab");
  ranks.push_back("abab");
  Tokenizer t = Tokenizer::from_parts(ranks, {{258, "<s>", true}});
  EXPECT_EQ(t.encode("ababab<s>"), (std::vector<int32_t>{257, 256, 258}));
  EXPECT_EQ(t.encode("ababab<s>", false).size(), 5u);
  EXPECT_THROW(Tokenizer::from_parts(ranks, {{3, "<s>", true}}), Error);
  ranks.push_back("ab");
  EXPECT_THROW(Tokenizer::from_parts(ranks, {}), Error);
}

}  // namespace
}  // namespace md
