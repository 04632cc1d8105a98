// Regular expressions for JSON Schema patterns (engine/json_regex.h), against std::regex's
// ECMAScript grammar as the reference (a search, as JSON Schema's `pattern`): whole strings match
// exactly when std::regex_search finds a match, every prefix of a matching string keeps the state
// set non-empty, and a non-empty set can still be completed into a match. Unsupported syntax is an
// error naming it.
#include <gtest/gtest.h>

#include <random>
#include <regex>

#include "megadecode/base/error.h"
#include "megadecode/engine/json_regex.h"

namespace md {
namespace {

// The states after the code points of an ASCII / Latin string (one byte a code point).
Regex::States run(const Regex& r, const std::string& s, size_t n = std::string::npos) {
  Regex::States st = r.start();
  for (size_t i = 0; i < std::min(n, s.size()); ++i) st = r.step(st, uint8_t(s[i]));
  return st;
}

bool matches(const Regex& r, const std::string& s) {
  return r.accepts(run(r, s));
}

// Whether some string over `alphabet` of at most `depth` more characters completes a match from
// st (a breadth-first search over the state sets).
bool completable(const Regex& r, Regex::States st, const std::string& alphabet, int depth) {
  std::vector<Regex::States> level{st};
  for (int d = 0; d <= depth; ++d) {
    std::vector<Regex::States> next;
    for (const auto& s : level) {
      if (r.accepts(s)) return true;
      for (char c : alphabet) {
        const Regex::States t = r.step(s, uint8_t(c));
        if (!Regex::empty(t) && std::find(next.begin(), next.end(), t) == next.end())
          next.push_back(t);
      }
    }
    level = std::move(next);
  }
  return false;
}

TEST(JsonRegex, AgreesWithStdRegexSearchOnRandomStrings) {
  // Each pattern with a string it matches (whose characters join the random strings' alphabet).
  const std::pair<const char*, const char*> patterns[] = {
      {"^[A-Z]{2}-\\d{3}$", "AB-123"},
      {"ab+c", "xabbbc"},
      {"^(a|bc)*d?$", "abcad"},
      {"^a.c$", "a c"},
      {"x{2,3}y", "xxxy"},
      {"^[^abc]+$", "xyz"},
      {"^(?:ab|a)(?:bc|c)$", "abc"},
      {"^\\w+@\\w+\\.(com|org)$", "a_1@b.org"},
      {"^-?\\d+(\\.\\d{1,2})?$", "-12.5"},
      {"^[a-c-]{0,4}$", "a-c"},
      {"b{2,}", "abbb"},
      {"^(?<word>[a-d]+)\\s[0-9]$", "cab 7"},
      {"^a|b$", "ab"},
      {"^\\$\\d+\\.\\d\\d$", "$10.99"},
      {"^[\\d.]+$", "1.2.3"},
      {"a{0}b", "b"},
      {"^(a{1,2}b?){2}$", "abaa"},
  };
  std::mt19937_64 rng(3);
  for (const auto& [p, example] : patterns) {
    SCOPED_TRACE(p);
    std::shared_ptr<const Regex> r;
    ASSERT_NO_THROW(r = Regex::compile(p));
    // (std::regex has no named groups: the reference takes the group unnamed.)
    std::string plain = p;
    if (const size_t g = plain.find("(?<word>"); g != std::string::npos) plain.replace(g, 8, "(");
    const std::regex ref(plain, std::regex::ECMAScript);
    ASSERT_TRUE(std::regex_search(example, ref));
    EXPECT_TRUE(matches(*r, example));
    const std::string alphabet = std::string("abcxyA-.@ 09$_") + example;
    for (int k = 0; k < 3000; ++k) {
      std::string s;
      const size_t len = rng() % 9;
      for (size_t i = 0; i < len; ++i) s += alphabet[rng() % alphabet.size()];
      const bool want = std::regex_search(s, ref);
      ASSERT_EQ(matches(*r, s), want) << '"' << s << '"';
      // Every prefix of a match keeps states; every non-empty set completes (within 8 more
      // characters of the alphabet: the patterns here need at most that).
      for (size_t n = 0; n <= s.size(); ++n) {
        const Regex::States st = run(*r, s, n);
        if (want) {
          ASSERT_FALSE(Regex::empty(st)) << '"' << s << "\" prefix " << n;
        }
        if (!Regex::empty(st) && k % 10 == 0) {
          ASSERT_TRUE(completable(*r, st, alphabet, 8)) << '"' << s << "\" prefix " << n;
        }
      }
    }
  }
}

TEST(JsonRegex, CodePointsAndEscapes) {
  auto r = Regex::compile("^\\u00e9+\\x41[\\u3040-\\u309f]$");
  Regex::States st = r->start();
  for (uint32_t c : {0xE9u, 0xE9u, 0x41u, 0x3042u}) st = r->step(st, c);
  EXPECT_TRUE(r->accepts(st));
  st = r->step(r->start(), 0x41);
  EXPECT_TRUE(Regex::empty(st));
  // A literal UTF-8 character in the pattern is one code point.
  r = Regex::compile("^日本$");
  st = r->step(r->step(r->start(), 0x65E5), 0x672C);
  EXPECT_TRUE(r->accepts(st));
  // '.' takes any code point but line terminators.
  r = Regex::compile("^.$");
  EXPECT_TRUE(r->accepts(r->step(r->start(), 0x1F600)));
  EXPECT_TRUE(Regex::empty(r->step(r->start(), '\n')));
}

TEST(JsonRegex, UnsupportedSyntaxIsAnErrorNamingIt) {
  const std::pair<const char*, const char*> cases[] = {
      {"(a)\\1", "backreferences"},
      {"a(?=b)", "lookahead"},
      {"a(?<!b)", "lookahead"},
      {"\\bword", "word boundaries"},
      {"a^b", "only at the start and end"},
      {"a$b", "only at the start and end"},
      {"[abc", "unterminated class"},
      {"(ab", "unterminated group"},
      {"ab)", "unmatched ')'"},
      {"*a", "nothing to repeat"},
      {"a{2}{3}", "nothing to repeat before '{'"},
      {"a+*", "nothing to repeat before '*'"},
      {"a{3,2}", "out of order"},
      {"[z-a]", "out of order"},
      {"(abcdef){60}", "more than 256 states"},
      {"\\q", "escape '\\q'"},
      {"\\u12", "hex digits"},
  };
  for (const auto& [p, what] : cases) {
    try {
      Regex::compile(p);
      ADD_FAILURE() << p << " compiled";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << p << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
}

// Random patterns from regex pieces (100,000 of them; fixed seed): each compiles or is an
// md::Error, never anything else; and where std::regex also takes one, the two agree on random
// strings (a differential check of the parser and the automaton).
TEST(JsonRegex, RandomPatternsCompileOrFailCleanlyAndAgreeWithStdRegex) {
  const char* pieces[] = {"a",   "b", "c",    ".",   "\\d",  "\\w",     "\\s",   "[a-c]", "[^b]",
                          "(",   ")", "|",    "*",   "+",    "?",       "{1,2}", "{2}",   "{0,}",
                          "^",   "$", "\\.",  "-",   "[",    "]",       "{",     "}",     "\\",
                          "(?:", "x", "[.-]", "\\D", "{,3}", "\\u0061", "é",     "[a-]",  "\\b"};
  const std::string alphabet = "abcx.-_ 1";
  std::mt19937_64 rng(11);
  int compiled = 0, compared = 0;
  for (int k = 0; k < 100000; ++k) {
    std::string p;
    const int n = 1 + int(rng() % 7);
    for (int i = 0; i < n; ++i) p += pieces[rng() % std::size(pieces)];
    std::shared_ptr<const Regex> r;
    try {
      r = Regex::compile(p);
    } catch (const Error&) {
      continue;
    }
    ++compiled;
    if (k % 10 != 0 || p.find("é") != std::string::npos) continue;  // (std::regex: bytes)
    std::regex ref;
    try {
      ref = std::regex(p, std::regex::ECMAScript);
    } catch (const std::regex_error&) {
      continue;
    }
    ++compared;
    for (int j = 0; j < 20; ++j) {
      std::string s;
      const size_t len = rng() % 6;
      for (size_t i = 0; i < len; ++i) s += alphabet[rng() % alphabet.size()];
      ASSERT_EQ(matches(*r, s), std::regex_search(s, ref))
          << "pattern " << p << " on \"" << s << '"';
    }
  }
  EXPECT_GT(compiled, 20000);
  EXPECT_GT(compared, 1000);
}

}  // namespace
}  // namespace md
