// The regex element of constrained decoding (engine/token_constraint.h, kRegex): on the tiny
// checkpoint's BPE vocabulary (multi-byte tokens, tokens that end mid-character), every mask
// agrees with the one-by-one check, the stop token is allowed exactly when the text so far
// matches, a match that cannot go on allows only the stop token, and random walks through the
// masks end in text the whole pattern matches (std::regex_match as the reference).
#include <gtest/gtest.h>

#include <random>
#include <regex>

#include "constraint_walk.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/token_constraint.h"
#include "megadecode/tokenizer/tokenizer.h"
#include "test_util.h"

namespace md {
namespace {

using Kind = ConstraintElement::Kind;

// [regex, then `text` if any, then the stop token].
std::shared_ptr<const ConstraintProgram> regex_program(const std::string& pattern, int32_t stop,
                                                       const std::string& text = "") {
  std::vector<ConstraintElement> el(1);
  el[0].kind = Kind::kRegex;
  el[0].regex = RegexDfa::compile(pattern);
  if (!text.empty()) {
    el.emplace_back();
    el.back().kind = Kind::kText;
    el.back().text = text;
  }
  return test::then_stop(std::move(el), stop);
}

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = uint8_t(s[i]);
    const size_t n = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 0;
    if (n == 0 || i + n > s.size()) return false;
    i += n;
  }
  return true;
}

TEST(RegexConstraint, RandomWalksThroughTheMasksEndInAFullMatch) {
  const Tokenizer& tok = test::bpe_test_tokenizer();
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  const int32_t stop = *tok.special_id("<|im_end|>");
  // ASCII patterns (std::regex reads bytes), each with the bytes that walks lean towards so that
  // they end.
  const std::pair<const char*, const char*> patterns[] = {
      {"(yes|no|maybe)", ""},
      {"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?", ""},
      {"\\d{3}-\\d{4}", ""},
      {"-?(0|[1-9]\\d{0,5})(\\.\\d{1,3})?", ""},
      {"[a-z]+@[a-z]+\\.(com|org)", "@."},
      {"(the|a) (cat|dog) (sat|ran)\\.", ""},
      {"[ -~]{0,12}", ""},
      {"(ab)*c?", "c"},
  };
  std::mt19937_64 rng(5);
  for (const auto& [pattern, lean] : patterns) {
    SCOPED_TRACE(pattern);
    const std::regex ref(pattern, std::regex::ECMAScript);
    const auto program = regex_program(pattern, stop);
    int completed = 0;
    for (int walk = 0; walk < 10; ++walk) {
      const test::Walk w = test::walk_masks(
          tok, program, vocab, stop, lean, rng, 100,
          // (and whole characters: a token may end inside one)
          [&](const std::string& t) { return std::regex_match(t, ref) && valid_utf8(t); });
      if (!w.finished) continue;
      ++completed;
      EXPECT_TRUE(std::regex_match(w.text, ref)) << w.text;
    }
    EXPECT_GE(completed, 5);
  }
}

TEST(RegexConstraint, AFinishedMatchAllowsOnlyTheStopTokenAndTheElementAfterIt) {
  const Tokenizer& tok = test::bpe_test_tokenizer();
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  const int32_t stop = *tok.special_id("<|im_end|>");
  std::vector<uint8_t> m(static_cast<size_t>(v));
  {
    TokenConstraint c(regex_program("(yes|no)", stop), vocab);
    for (int32_t id : tok.encode("yes", false)) c.accept(id);
    ASSERT_FALSE(c.broken());
    EXPECT_EQ(c.allowed(m), 1);
    EXPECT_EQ(m[size_t(stop)], 1);
    c.accept(stop);
    EXPECT_TRUE(c.finished());
  }
  {
    // A match followed by text: the tokens that finish the match and begin the text pass (the
    // match ends inside them), the stop token does not until the text is written.
    TokenConstraint c(regex_program("[0-9]+", stop, ", ok"), vocab);
    for (int32_t id : tok.encode("12", false)) c.accept(id);
    c.allowed(m);
    EXPECT_EQ(m[size_t(stop)], 0);
    for (int32_t id = 0; id < v; ++id) {
      if (tok.is_special(id) || !m[size_t(id)]) continue;
      const std::string b(tok.token_bytes(id));
      const size_t digits = b.find_first_not_of("0123456789");
      const std::string rest = digits == std::string::npos ? "" : b.substr(digits);
      EXPECT_TRUE(std::string(", ok").starts_with(rest)) << b;
    }
    for (int32_t id : tok.encode("3, ok", false)) {
      ASSERT_TRUE(c.allows(id));
      c.accept(id);
    }
    EXPECT_EQ(c.allowed(m), 1);
    EXPECT_EQ(m[size_t(stop)], 1);
  }
  {
    TokenConstraint c(regex_program("(yes|no)", stop), vocab);
    for (int32_t id : tok.encode("maybe", false)) c.accept(id);
    EXPECT_TRUE(c.broken());  // a refused id breaks the constraint (the engine never feeds one)
  }
  std::vector<ConstraintElement> el(1);
  el[0].kind = Kind::kRegex;
  EXPECT_THROW(ConstraintProgram{el}, Error);  // no automaton
}

}  // namespace
}  // namespace md
