// The grammar element of constrained decoding (engine/token_constraint.h, kGrammar) on the tiny
// checkpoint's BPE vocabulary: every mask agrees with the one-by-one check (which steps the
// pushdown automaton byte by byte, without the per-frame split of grammar_masks.h), the stop
// token comes exactly when the text is a whole answer, and random walks end in answers of the
// grammar (nested JSON checked by a parser; arithmetic by a small evaluator's grammar).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

#include "constraint_walk.h"
#include "megadecode/engine/token_constraint.h"
#include "megadecode/tokenizer/tokenizer.h"
#include "test_util.h"

namespace md {
namespace {

using Kind = ConstraintElement::Kind;

std::shared_ptr<const ConstraintProgram> grammar_program(const char* gbnf, int32_t stop) {
  std::vector<ConstraintElement> el(1);
  el[0].kind = Kind::kGrammar;
  el[0].grammar = Grammar::compile_gbnf(gbnf);
  return test::then_stop(std::move(el), stop);
}

// Whether the whole of s is an answer of g.
bool whole(const Grammar& g, const std::string& s) {
  Grammar::Stacks st = g.start();
  for (char c : s) {
    st = g.step(st, uint8_t(c));
    if (st.empty()) return false;
  }
  return st.done;
}

const char* kJson = R"G(
root   ::= "{" ws ( member ("," ws member)* )? "}"
value  ::= "{" ws ( member ("," ws member)* )? "}" ws | "[" ws ( value ("," ws value)* )? "]" ws | string | [0-9]{1,3} ws | ("true" | "null") ws
member ::= string ":" ws value
string ::= "\"" [a-z ]{0,6} "\"" ws
ws     ::= " "?
)G";

TEST(GrammarConstraint, RandomWalksThroughTheMasksEndInAnswers) {
  const Tokenizer& tok = test::bpe_test_tokenizer();
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  const int32_t stop = *tok.special_id("<|im_end|>");
  const std::pair<const char*, const char*> grammars[] = {
      {kJson, "}]\""},
      {"root ::= expr\nexpr ::= term ((\"+\" | \"-\") term)*\nterm ::= [0-9]{1,2} | \"(\" expr "
       "\")\"",
       ")"},
  };
  std::mt19937_64 rng(3);
  for (const auto& [gbnf, lean] : grammars) {
    SCOPED_TRACE(gbnf);
    const auto program = grammar_program(gbnf, stop);
    const Grammar& g = *program->elements()[0].grammar;
    int completed = 0;
    for (int walk = 0; walk < 12; ++walk) {
      const test::Walk w = test::walk_masks(tok, program, vocab, stop, lean, rng, 80,
                                            [&](const std::string& t) { return whole(g, t); });
      if (!w.finished) continue;
      ++completed;
      EXPECT_TRUE(whole(g, w.text)) << w.text;
      if (gbnf == kJson) {
        EXPECT_TRUE(nlohmann::json::accept(w.text)) << w.text;
      }
    }
    EXPECT_GE(completed, 4);
  }
}

// A generation that visits more top frames than the mask cache keeps (kMaxSplits, 256): the
// cache starts over and the masks still agree with the one-by-one check.
TEST(GrammarConstraint, MasksStayRightPastTheSplitCache) {
  const Tokenizer& tok = test::bpe_test_tokenizer();
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  const int32_t stop = *tok.special_id("<|im_end|>");
  // 400 letters in one rule: each position is a state of its own.
  const auto program = grammar_program("root ::= \"(\" root \")\" | [a-z]{400} \".\"", stop);
  TokenConstraint c(program, vocab);
  std::vector<uint8_t> m(static_cast<size_t>(v));
  const int32_t a = tok.encode_ordinary("a")[0];
  for (int k = 0; k < 400; ++k) {
    c.allowed(m);
    for (int32_t id = 0; id < v; ++id)
      ASSERT_EQ(m[size_t(id)], c.allows(id) ? 1 : 0) << "id " << id << " at letter " << k;
    ASSERT_TRUE(m[size_t(a)]);
    c.accept(a);
  }
  c.allowed(m);
  EXPECT_TRUE(m[size_t(tok.encode_ordinary(".")[0])]);
  EXPECT_FALSE(m[size_t(a)]);
}

}  // namespace
}  // namespace md
