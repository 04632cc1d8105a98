// Context-free grammars (GBNF, recursion allowed) for constrained decoding, run as a pushdown
// automaton over UTF-8 bytes.
//
// Each rule's body is a regular expression over characters and rule names; it compiles to a byte
// automaton whose states also have call edges, one per rule that can be read next
// (RegexDfa::Call). The grammar's state is a set of stacks of frames (rule, automaton state), the
// bottom frame the root; a frame below the top holds the state its rule returns to. Every stack is
// kept *closed*: its top frame can read a byte (calls have been entered, finished rules returned
// from), so stepping a byte is one table lookup per stack, then the closure again. `done`: the root
// has been read whole (the answer may end there).
//
// Compile-time checks (md::Error with the line and column): GBNF syntax and undefined rules (as
// engine/gbnf.h), a rule that derives no finite string, left recursion (a rule that can reach
// itself before reading a byte: the closure would never end), more than kMaxStates automaton
// states over all rules. Run-time bounds: stacks deeper than
// kMaxDepth frames are not entered, and at most kMaxStacks stacks are kept (ambiguous grammars);
// both only ever refuse text, never accept text outside the grammar.
#pragma once
#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "megadecode/engine/regex_dfa.h"

namespace md {

class Grammar {
 public:
  static constexpr int kMaxDepth = 256;
  static constexpr int kMaxStacks = 256;
  // All the rules' automaton states together (their construction also shares one budget of
  // RegexDfa::kMaxWork).
  static constexpr int64_t kMaxStates = 1 << 16;

  struct Frame {
    int32_t rule, state;
    auto operator<=>(const Frame&) const = default;
  };
  using Stack = std::vector<Frame>;  // bottom (the root) first
  struct Stacks {
    std::vector<Stack> stacks;  // sorted, unique, each closed
    bool done = false;          // the root has been read whole
    bool empty() const { return stacks.empty() && !done; }
  };

  static std::shared_ptr<const Grammar> compile_gbnf(std::string_view grammar);

  Stacks start() const;
  // After byte b (empty(): refused, unless `from.done`, where the answer could have ended).
  Stacks step(const Stacks& from, uint8_t b) const;
  const RegexDfa& rule(int32_t r) const { return *rules_[size_t(r)]; }
  int rules() const { return int(rules_.size()); }
  // Some rule refers to itself (else engine/gbnf.h's single automaton reads the same language
  // faster).
  bool recursive() const { return recursive_; }

 private:
  void close(Stack st, Stacks& out, std::vector<Stack>& seen) const;
  std::vector<std::shared_ptr<const RegexDfa>> rules_;
  int32_t root_ = 0;
  bool recursive_ = false;
};

}  // namespace md
