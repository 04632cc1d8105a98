// The byte automaton of a regular expression (engine/regex_dfa.h) against the code point NFA it
// is built from (engine/json_regex.h, whole-string matching) and against std::regex_match:
// every UTF-8 string is accepted exactly when its code points match; invalid UTF-8 never is;
// a state that is not dead can always be completed into a match; the size bound is an error.
#include <gtest/gtest.h>

#include <random>
#include <regex>
#include <string>

#include "megadecode/base/error.h"
#include "megadecode/engine/json_regex.h"
#include "megadecode/engine/regex_dfa.h"

namespace md {
namespace {

std::string utf8(uint32_t c) {
  std::string s;
  if (c < 0x80) {
    s += char(c);
  } else if (c < 0x800) {
    s += char(0xC0 | c >> 6);
    s += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    s += char(0xE0 | c >> 12);
    s += char(0x80 | (c >> 6 & 0x3F));
    s += char(0x80 | (c & 0x3F));
  } else {
    s += char(0xF0 | c >> 18);
    s += char(0x80 | (c >> 12 & 0x3F));
    s += char(0x80 | (c >> 6 & 0x3F));
    s += char(0x80 | (c & 0x3F));
  }
  return s;
}

// The automaton's state after the bytes of s (kDead as soon as one leads nowhere).
int32_t run(const RegexDfa& d, const std::string& s) {
  int32_t st = d.start();
  for (char c : s) {
    st = d.step(st, uint8_t(c));
    if (st == RegexDfa::kDead) break;
  }
  return st;
}
bool dfa_matches(const RegexDfa& d, const std::string& s) {
  const int32_t st = run(d, s);
  return st != RegexDfa::kDead && d.accepts(st);
}
bool nfa_matches(const Regex& r, const std::vector<uint32_t>& cps) {
  Regex::States st = r.start();
  for (uint32_t c : cps) st = r.step(st, c);
  return r.accepts(st);
}

// Whether some string of at most `depth` more bytes completes a match from st (breadth-first).
bool completable(const RegexDfa& d, int32_t st, int depth) {
  std::vector<int32_t> level{st};
  std::vector<bool> seen(size_t(d.states()), false);
  for (int k = 0; k <= depth && !level.empty(); ++k) {
    std::vector<int32_t> next;
    for (int32_t s : level) {
      if (d.accepts(s)) return true;
      for (int b = 0; b < 256; ++b) {
        const int32_t t = d.step(s, uint8_t(b));
        if (t != RegexDfa::kDead && !seen[size_t(t)]) {
          seen[size_t(t)] = true;
          next.push_back(t);
        }
      }
    }
    level = std::move(next);
  }
  return false;
}

TEST(RegexDfa, AgreesWithTheNfaAndStdRegexOnRandomStrings) {
  // Each pattern with a string it matches and the code points of the random strings.
  struct Case {
    const char* pattern;
    const char* example;
    std::vector<uint32_t> alphabet;
  };
  const Case cases[] = {
      {"[A-Z]{2}-\\d{3}", "AB-123", {'A', 'B', '-', '1', '2', '3'}},
      {"(yes|no|maybe)", "maybe", {'y', 'e', 's', 'n', 'o', 'm', 'a', 'b'}},
      {"a.c", "a\u00e9c", {'a', 'c', ' ', 0xE9, 0x4E2D, 0x1F600, '\n'}},
      {"[^abc]+", "x\U0010FFFF", {'a', 'x', 0xE9, 0x10FFFF, 0xFFFF, 0x800, 0x7FF}},
      {"(?:ab|a)(?:bc|c)", "abc", {'a', 'b', 'c'}},
      {"\\w+@\\w+\\.(com|org)", "a_1@b.org", {'a', '_', '1', '@', '.', 'c', 'o', 'm', 'r', 'g'}},
      {"-?\\d+(\\.\\d{1,2})?", "-12.5", {'-', '1', '2', '.', '5'}},
      {"[\\u00e0-\\u00ff\\u4e00-\\u9fff]{1,3}x?",
       "\u00e0\u4e2dx",
       {0xE0, 0xFF, 0xDF, 0x4E00, 0x9FFF, 0xA000, 'x'}},
      {"\U0001F600|x", "\U0001F600", {0x1F600, 0x1F601, 'x'}},
      {"", "", {'a'}},
  };
  std::mt19937 rng(7);
  for (const auto& [pattern, example, alphabet] : cases) {
    SCOPED_TRACE(pattern);
    const auto r = Regex::compile(pattern, Regex::Match::kFull);
    const auto d = RegexDfa::build(*r);
    EXPECT_TRUE(dfa_matches(*d, example));
    const bool ascii = std::all_of(alphabet.begin(), alphabet.end(),
                                   [](uint32_t c) { return c < 0x80 && c != '\n'; });
    std::regex ref;
    if (ascii) ref = std::regex(pattern, std::regex::ECMAScript);
    for (int t = 0; t < 4000; ++t) {
      std::vector<uint32_t> cps;
      const int len = int(rng() % 8);
      for (int k = 0; k < len; ++k) cps.push_back(alphabet[rng() % alphabet.size()]);
      std::string s;
      for (uint32_t c : cps) s += utf8(c);
      const bool m = dfa_matches(*d, s);
      EXPECT_EQ(m, nfa_matches(*r, cps)) << s;
      if (ascii) {
        EXPECT_EQ(m, std::regex_match(s, ref)) << s;
      }
      // Every live state on the way can still be completed.
      int32_t st = d->start();
      for (char c : s) {
        st = d->step(st, uint8_t(c));
        if (st == RegexDfa::kDead) break;
        ASSERT_TRUE(completable(*d, st, 12)) << s;
      }
    }
  }
}

TEST(RegexDfa, EveryCodePointIsEncodedExactlyOnceAndInvalidUtf8NeverMatches) {
  // One code point other than 'a': every valid encoding but 'a', nothing else.
  const auto d = RegexDfa::build(*Regex::compile("[^a]", Regex::Match::kFull));
  for (uint32_t c = 0; c <= 0x10FFFF; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    ASSERT_EQ(dfa_matches(*d, utf8(c)), c != 'a') << c;
  }
  const char* invalid[] = {
      "\xC0\x80",          // overlong NUL
      "\xC1\xBF",          // overlong
      "\xE0\x80\x80",      // overlong
      "\xE0\x9F\xBF",      // overlong (U+07FF in 3 bytes)
      "\xED\xA0\x80",      // a surrogate (U+D800)
      "\xED\xBF\xBF",      // a surrogate (U+DFFF)
      "\xF0\x8F\xBF\xBF",  // overlong
      "\xF4\x90\x80\x80",  // past U+10FFFF
      "\xF5\x80\x80\x80",  // no such lead byte
      "\x80",              // a lone continuation byte
      "\xE4\xB8",          // cut short
  };
  for (const char* s : invalid) {
    EXPECT_FALSE(dfa_matches(*d, s)) << testing::PrintToString(std::string(s));
    EXPECT_EQ(run(*d, s) == RegexDfa::kDead, std::string(s) != "\xE4\xB8");
  }
}

TEST(RegexDfa, RandomCodePointRangesMatchExactlyTheirMembers) {
  std::mt19937 rng(11);
  for (int t = 0; t < 2000; ++t) {
    uint32_t lo = rng() % 0x110000, hi = rng() % 0x110000;
    if (t % 2 == 0) {  // short ranges from near a continuation byte's edge, crossing others
      lo = lo / 64 * 64 + rng() % 3;
      hi = lo + rng() % 300;
    }
    hi = std::min<uint32_t>(hi, 0x10FFFF);
    if (lo > hi) std::swap(lo, hi);
    if (lo >= 0xD800 && lo <= 0xDFFF) lo = 0xE000;  // (no literal surrogates in UTF-8)
    if (hi >= 0xD800 && hi <= 0xDFFF) hi = 0xD7FF;
    if (lo > hi) continue;
    auto literal = [](uint32_t c) {
      const bool plain = c >= 0x80 || std::isalnum(int(c));
      return plain ? utf8(c) : "\\" + utf8(c);
    };
    const std::string pattern = "[" + literal(lo) + "-" + literal(hi) + "]";
    SCOPED_TRACE(testing::PrintToString(pattern));
    const auto r = Regex::compile(pattern, Regex::Match::kFull);
    const auto d = RegexDfa::build(*r);
    std::vector<uint32_t> probes = {lo,    hi,    lo - 1, hi + 1,  0x7F,   0x80,
                                    0x7FF, 0x800, 0xFFFF, 0x10000, 0xD7FF, 0xE000};
    for (int k = 0; k < 100; ++k) probes.push_back(rng() % 0x110000);
    for (int k = 0; k < 100; ++k) probes.push_back(lo + rng() % (hi - lo + 1));
    for (uint32_t c : probes) {
      if (c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) continue;
      ASSERT_EQ(dfa_matches(*d, utf8(c)), c >= lo && c <= hi) << std::hex << c;
    }
  }
}

TEST(RegexDfa, AFinishedMatchCannotContinueAndLimitsAreErrors) {
  const auto d = RegexDfa::build(*Regex::compile("(yes|no)", Regex::Match::kFull));
  const int32_t yes = run(*d, "yes");
  ASSERT_NE(yes, RegexDfa::kDead);
  EXPECT_TRUE(d->accepts(yes));
  EXPECT_FALSE(d->can_continue(yes));
  const int32_t y = run(*d, "y");
  EXPECT_FALSE(d->accepts(y));
  EXPECT_TRUE(d->can_continue(y));
  EXPECT_EQ(run(*d, "yn"), RegexDfa::kDead);
  // A full match is anchored: a search would accept "xyes".
  EXPECT_FALSE(dfa_matches(*d, "xyes"));
  EXPECT_TRUE(dfa_matches(*RegexDfa::build(*Regex::compile("(yes|no)")), "xyes"));
  // The subset construction's classic blow-up: the 15th character from the end.
  try {
    RegexDfa::build(*Regex::compile("[ab]*a[ab]{14}", Regex::Match::kFull));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("automaton states"), std::string::npos) << e.what();
  }
  try {
    RegexDfa::build(*Regex::compile("[^\\s\\S]", Regex::Match::kFull));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("matches no string"), std::string::npos) << e.what();
  }
}

// Python's spellings, which vLLM's regexes use: named groups (?P<name>...), \A and \Z anchors.
TEST(RegexDfa, PythonSpellings) {
  const auto d = RegexDfa::compile("\\A(?P<area>\\d{3})-(?P<line>\\d{4})\\Z|x\\Z");
  EXPECT_TRUE(dfa_matches(*d, "555-1234"));
  EXPECT_TRUE(dfa_matches(*d, "x"));
  EXPECT_FALSE(dfa_matches(*d, "555-123"));
  EXPECT_FALSE(dfa_matches(*d, "x555-1234"));
  // A search: \A and \Z anchor as ^ and $ do.
  const auto r = Regex::compile("\\Aab\\Z");
  EXPECT_TRUE(r->accepts(r->step(r->step(r->start(), 'a'), 'b')));
  EXPECT_FALSE(dfa_matches(*RegexDfa::build(*Regex::compile("\\Aab")), "xab"));
  EXPECT_TRUE(dfa_matches(*RegexDfa::build(*Regex::compile("ab\\\\Z")), "ab\\Zx"));  // \\ then Z
  for (const char* bad : {"(?P<a>x)(?P=a)", "a\\Ab", "a\\Zb"}) {
    EXPECT_THROW(RegexDfa::compile(bad), Error) << bad;
  }
}

TEST(RegexDfa, LongRepetitionsPastTheNfaBoundCompile) {
  // 300 optional copies: more NFA nodes than Regex::compile allows (JSON Schema patterns), within
  // RegexDfa::compile's bound.
  EXPECT_THROW(Regex::compile("[a-z]{0,300}", Regex::Match::kFull), Error);
  const auto d = RegexDfa::compile("[a-z]{0,300}!");
  for (int len : {0, 1, 255, 256, 299, 300, 301}) {
    const std::string s = std::string(size_t(len), 'q') + "!";
    EXPECT_EQ(dfa_matches(*d, s), len <= 300) << len;
  }
  try {
    RegexDfa::compile("a{9000}");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than 8192 states"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace md
