// Context-free grammars as pushdown automata (engine/grammar.h): recursive grammars (nested JSON,
// arithmetic) accept exactly their language, byte by byte (every prefix of an accepted string
// keeps a stack, `done` exactly at a whole answer); a non-recursive grammar reads as its single
// automaton does (engine/gbnf.h); left recursion and rules without a finite string are errors.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "megadecode/base/error.h"
#include "megadecode/engine/gbnf.h"
#include "megadecode/engine/grammar.h"

namespace md {
namespace {

// 1: a whole answer; 0: a prefix of one; -1: refused.
int run(const Grammar& g, const std::string& s) {
  Grammar::Stacks st = g.start();
  for (char c : s) {
    st = g.step(st, uint8_t(c));
    if (st.empty()) return -1;
  }
  return st.done ? 1 : 0;
}

// JSON objects as GBNF (whitespace runs of at most 8).
std::string json_gbnf() {
  std::ifstream f(std::string(MD_TEST_DATA_DIR) + "/data/grammars/json.gbnf");
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

TEST(Grammar, NestedJsonIsReadExactly) {
  const auto g = Grammar::compile_gbnf(json_gbnf());
  EXPECT_TRUE(g->recursive());
  const std::string yes[] = {
      "{}",
      R"({"a":1})",
      R"({"a": [1, {"b": [[], {}, "x\"y\u00e9"]}], "c": -0.5e+3})",
      R"({"deep": [[[[[[[[[[1]]]]]]]]]]})",
      "{\"t\": true, \"n\": null} \n",
  };
  for (const std::string& s : yes) {
    EXPECT_EQ(run(*g, s), 1) << s;
    // Every proper prefix keeps a stack and is not a whole answer (an object ends at its brace,
    // its trailing blanks aside).
    for (size_t k = 1; k < s.size(); ++k)
      if (s.find_first_not_of(" \n", k) != std::string::npos) {
        EXPECT_EQ(run(*g, s.substr(0, k)), 0) << s.substr(0, k);
      }
  }
  const std::string no[] = {"[]",          R"({"a":})",  R"({"a":1,})",      R"({"a":[1,]})",
                            R"({"a":01})", R"({"a":"x)", "{\"a\":\"\x01\"}", R"({"a":1}})",
                            R"({a:1})"};
  for (const std::string& s : no) EXPECT_NE(run(*g, s), 1) << s;
  EXPECT_EQ(run(*g, R"({"a":})"), -1);
  EXPECT_EQ(run(*g, R"({"a":[1]]})"), -1);
}

TEST(Grammar, RandomJsonValuesAgreeWithAParser) {
  const auto g = Grammar::compile_gbnf(json_gbnf());
  std::mt19937 rng(9);
  std::function<nlohmann::json(int)> value = [&](int depth) -> nlohmann::json {
    switch (depth > 3 ? rng() % 4 : rng() % 6) {
      case 0:
        return int(rng() % 2000) - 1000;
      case 1:
        return std::string(1 + rng() % 4, char('a' + rng() % 26));
      case 2:
        return rng() % 2 == 0;
      case 3:
        return nullptr;
      case 4: {
        nlohmann::json a = nlohmann::json::array();
        for (int k = int(rng() % 3); k > 0; --k) a.push_back(value(depth + 1));
        return a;
      }
      default: {
        nlohmann::json o = nlohmann::json::object();
        for (int k = int(rng() % 3); k > 0; --k)
          o[std::string(1, char('a' + rng() % 26))] = value(depth + 1);
        return o;
      }
    }
  };
  for (int t = 0; t < 200; ++t) {
    nlohmann::json o = nlohmann::json::object();
    o["k"] = value(0);
    std::string s = o.dump(rng() % 2 ? -1 : 1);
    EXPECT_EQ(run(*g, s), 1) << s;
    // One byte changed: accepted exactly when it still parses as an object (the grammar's
    // whitespace is at most 8 in a row, which these texts stay within).
    std::string m = s;
    m[rng() % m.size()] = "{}[],:\"0a- "[rng() % 11];
    const bool parses = nlohmann::json::accept(m) && nlohmann::json::parse(m).is_object();
    EXPECT_EQ(run(*g, m) == 1, parses) << m;
  }
}

TEST(Grammar, ArithmeticAndNonRecursiveGrammars) {
  const auto g = Grammar::compile_gbnf(R"G(
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")" | "-" factor
)G");
  for (const char* s : {"1", "1+2*3", "(1+2)*3", "((((4))))", "-(-1)", "2*(3-(4/5))"})
    EXPECT_EQ(run(*g, s), 1) << s;
  for (const char* s : {"1+", "(1", "1)", "()", "1++2", "*1"}) EXPECT_NE(run(*g, s), 1) << s;
  EXPECT_EQ(run(*g, "(("), 0);
  EXPECT_EQ(run(*g, "1)"), -1);
  // Without recursion the pushdown automaton reads what the single automaton reads.
  const char* flat = R"(root ::= item{1,3}
item ::= ("yes" | "no") sep?
sep ::= ", " | ";")";
  const auto p = Grammar::compile_gbnf(flat);
  EXPECT_FALSE(p->recursive());
  const auto d = compile_gbnf(flat);
  std::mt19937 rng(2);
  for (int t = 0; t < 2000; ++t) {
    std::string s;
    for (int k = int(rng() % 12); k > 0; --k) s += "yesno, ;"[rng() % 8];
    int32_t st = d->start();
    for (char c : s)
      if (st != RegexDfa::kDead) st = d->step(st, uint8_t(c));
    EXPECT_EQ(run(*p, s) == 1, st != RegexDfa::kDead && d->accepts(st)) << s;
  }
}

TEST(Grammar, LeftRecursionAndEndlessRulesAreErrors) {
  const std::pair<const char*, const char*> cases[] = {
      {"root ::= root \"a\" | \"b\"", "'root' is left-recursive"},
      {"root ::= x\nx ::= y? \"a\"\ny ::= \"\" | x \"b\"", "left-recursive"},
      {"root ::= \"(\" root \")\"", "derives no finite string"},
      {"root ::= x\nx ::= \"a\" y\ny ::= \"b\" x", "derives no finite string"},
      {"root ::= undefined", "line 1 column 10: the rule 'undefined' is not defined"},
  };
  for (const auto& [grammar, want] : cases) {
    try {
      Grammar::compile_gbnf(grammar);
      ADD_FAILURE() << "accepted: " << grammar;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos)
          << grammar << " -> " << e.what();
    }
  }
}

// The rules' automata are bounded together: many rules that each fit are refused when their
// states add up past Grammar::kMaxStates (a request cannot build gigabytes of tables).
TEST(Grammar, RulesAreBoundedTogether) {
  std::string g = "root ::= r0";
  for (int r = 0; r < 24; ++r) {
    g += fmt::format(" | r{}", r + 1);
    g += fmt::format("\nr{} ::= \"{}\" [a-z]{{0,3000}}", r, r);
  }
  g += "\nr24 ::= \"(\" root \")\"";
  try {
    Grammar::compile_gbnf(g);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("automaton states together"), std::string::npos)
        << e.what();
  }
}

// Mutated grammars compile or fail with an md::Error; those that compile are stepped through
// random bytes (under the sanitizer builds of make test: no memory error, no endless closure).
TEST(Grammar, MutatedGrammarsCompileOrFailCleanlyAndStep) {
  const std::string seeds[] = {json_gbnf(),
                               "root ::= expr\nexpr ::= term ((\"+\" | \"-\") term)*\n"
                               "term ::= [0-9]+ | \"(\" expr \")\" | \"-\" term"};
  std::mt19937 rng(4);
  const std::string alphabet = "\"[]()|*+?{},.-^\\#:=\n abxyz019";
  int compiled = 0;
  for (int t = 0; t < 1500; ++t) {
    std::string g = seeds[size_t(t) % 2];
    for (int m = 0, edits = 1 + int(rng() % 3); m < edits; ++m) {
      const size_t at = rng() % (g.size() + 1);
      if (rng() % 2)
        g.insert(at, 1, alphabet[rng() % alphabet.size()]);
      else if (at < g.size())
        g.erase(at, 1);
    }
    std::shared_ptr<const Grammar> c;
    try {
      c = Grammar::compile_gbnf(g);
    } catch (const Error&) {
      continue;
    }
    ++compiled;
    Grammar::Stacks st = c->start();
    for (int k = 0; k < 40 && !st.empty(); ++k)
      st = c->step(st, uint8_t("{}[]\",:0a- ("[rng() % 12]));
  }
  EXPECT_GT(compiled, 100);
}

}  // namespace
}  // namespace md
