// GBNF grammars as automata (engine/gbnf.h): the language of each grammar, written by hand
// against strings it must and must not accept; errors give the place and the reason; mutated
// grammars compile or fail cleanly.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "megadecode/base/error.h"
#include "megadecode/engine/gbnf.h"

namespace md {
namespace {

bool accepts(const RegexDfa& d, const std::string& s) {
  int32_t st = d.start();
  for (char c : s) {
    st = d.step(st, uint8_t(c));
    if (st == RegexDfa::kDead) return false;
  }
  return d.accepts(st);
}

const char* kChess = R"(# a game: the first move, then numbered ones
root ::= (
    "1. " move " " move "\n"   # the first pair

    ([1-9] [0-9]? ". " move " " move "\n")+
)
move ::= (pawn | piece) "+"?
pawn ::= [a-h] [1-8]
piece ::= [KQRBN] [a-h] [1-8]
)";

TEST(Gbnf, GrammarsAcceptTheirLanguageAndNothingElse) {
  struct Case {
    const char* grammar;
    std::vector<std::string> yes, no;
  };
  const Case cases[] = {
      {kChess,
       {"1. e4 e5\n2. Nf3 Nc6\n", "1. e4 e5\n2. Bb5+ a6\n10. Qh5 Kd8\n"},
       {"1. e4 e5\n", "1. e9 e5\n2. a3 a4\n", "1. e4 e5\n2. Nf3 Nc6", "1. e4 e5\n0. a3 a4\n"}},
      {"root ::= item+\nitem ::= \"- \" [^\\n]+ \"\\n\"",
       {"- a\n", "- a b\n- \xC3\xA9\n"},
       {"", "- \n", "- a", "-a\n"}},
      {R"(root ::= "\x41\u00e9\U0001F600\t\"\\")", {"A\xC3\xA9\xF0\x9F\x98\x80\t\"\\"}, {"A"}},
      {R"(root ::= [\]\-\\a^]+)", {"]", "-", "\\", "a", "^a]"}, {"b", ""}},
      {R"(root ::= "\"" [^"\\]* "\"")", {"\"\"", "\"ab c\""}, {"\"a\"b\"", "\"a\\\""}},
      {"root ::= . .", {"\n\n", "a\xE2\x82\xAC"}, {"a", "abc"}},
      {R"(root ::= "a"{2} "b"{2,} "c"{1,3} ("d"+)? "e"{0,1})",
       {"aabbc", "aabbbccc", "aabbcddde"},
       {"abbc", "aabc", "aabbcccc", "aabbcee"}},
      {"root ::= \"a\" | ", {"", "a"}, {"aa"}},
      {"root ::= \"a\"\n   \"b\"\nother ::= \"x\"", {"ab"}, {"a", "b", "x"}},
      {"root ::= \"a\"\n  | \"b\" # either\n", {"a", "b"}, {"ab"}},
      {"root ::= x x\nx ::= y | \"z\"\ny ::= [0-9]", {"1z", "zz", "09"}, {"1", "1zz"}},
      {"root ::= (\"yes\" | \"no\") (\", \" (\"yes\" | \"no\")){0,2}",
       {"yes", "no, yes", "yes, yes, no"},
       {"yes, yes, yes, yes", "maybe"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.grammar);
    const auto d = compile_gbnf(c.grammar);
    for (const std::string& s : c.yes) EXPECT_TRUE(accepts(*d, s)) << testing::PrintToString(s);
    for (const std::string& s : c.no) EXPECT_FALSE(accepts(*d, s)) << testing::PrintToString(s);
  }
}

TEST(Gbnf, ErrorsGiveThePlaceAndTheReason) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "empty"},
      {"item ::= \"a\"", "no 'root' rule"},
      {"root ::= item", "line 1 column 10: the rule 'item' is not defined"},
      {"root ::= \"a\"\nunused ::= missing", "line 2 column 12: the rule 'missing' is not defined"},
      {"root ::= \"(\" root \")\" | \"x\"", "the rule 'root' is recursive"},
      {"root ::= a\na ::= \"[\" b \"]\"\nb ::= a | \"x\"", "recursive"},
      {"root ::= \"\\q\"", "line 1 column 11: unknown escape '\\q'"},
      {"root ::= \"abc", "unterminated literal"},
      {"root ::= [abc", "unterminated character class"},
      {"root ::= (\"a\"", "unterminated group"},
      {"root ::= \"a\")", "unmatched ')'"},
      {"root ::= <think> \"a\"", "token references"},
      {"root ::= \"a\"\nroot ::= \"b\"", "line 2 column 1: the rule 'root' is defined twice"},
      {"root \"a\"", "'::=' is expected"},
      {"root ::= \"a\"{3,2}", "out of order"},
      {"root ::= [z-a]", "out of order"},
      {"root ::= []", "empty character class"},
      {"root ::= \"\\uD800\"", "grammar: "},  // a lone surrogate: the regex refuses it
      {"root ::= \"a\"{9000}", "states"},
      {"root ::= [ab]* \"a\" [ab]{14}", "automaton states"},
  };
  for (const auto& [grammar, want] : cases) {
    try {
      compile_gbnf(grammar);
      ADD_FAILURE() << "accepted: " << grammar;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos)
          << grammar << " -> " << e.what();
    }
  }
}

TEST(Gbnf, MutatedGrammarsCompileOrFailCleanly) {
  const std::string seeds[] = {
      kChess,
      "root ::= item+\nitem ::= \"- \" [^\\n]+ \"\\n\"",
      R"(root ::= "a"{2} "b"{2,} ("c" | [x-z\u00e9])? . "\"")",
  };
  std::mt19937 rng(3);
  const std::string alphabet = "\"[]()|*+?{},.-^\\#:=\n abcxyz019";
  int compiled = 0;
  for (int t = 0; t < 3000; ++t) {
    std::string g = seeds[size_t(t) % 3];
    for (int m = 0, edits = 1 + int(rng() % 3); m < edits; ++m) {
      const size_t at = rng() % (g.size() + 1);
      switch (rng() % 3) {
        case 0:
          g.insert(at, 1, alphabet[rng() % alphabet.size()]);
          break;
        case 1:
          if (at < g.size()) g.erase(at, 1);
          break;
        default:
          if (at < g.size()) g[at] = alphabet[rng() % alphabet.size()];
      }
    }
    try {
      compile_gbnf(g);
      ++compiled;
    } catch (const Error&) {
    }
  }
  EXPECT_GT(compiled, 100);  // (mutations of comments and literals keep grammars valid)
}

}  // namespace
}  // namespace md
