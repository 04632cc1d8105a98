// A regular expression as a deterministic automaton over UTF-8 bytes: what a `regex` structured
// output (server: `structured_outputs.regex`, `guided_regex`) steps through for every byte of
// every token that a mask tries, so a step must be a table lookup, not a set of NFA states.
//
// Built from a Regex's nodes (engine/json_regex.h, parsed with Match::kFull) in two stages:
//  1. Each character node's code point ranges become UTF-8 byte sequences (valid UTF-8 only:
//     no surrogates, no overlong forms), a small byte automaton per node;
//  2. the subset construction over those, on byte classes (bytes no range boundary separates
//     step alike), done once at build time, bounded by kMaxStates.
// Every state it keeps can still reach the match: a byte that leads nowhere that can is dead (-1),
// so "still matchable" is one comparison. Immutable once built: shared by every choice and thread.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "megadecode/engine/json_regex.h"

namespace md {

class RegexDfa {
 public:
  static constexpr int kMaxStates = 16384;  // automaton states (`.{0,1000}` takes ~10000)
  static constexpr int kMaxNodes = 8192;    // NFA nodes once repetitions are expanded
  // Set members stepped while building, at most (a few hundred ms): a pattern whose automaton
  // is large and whose sets are large too is refused rather than built for seconds.
  static constexpr int64_t kMaxWork = int64_t{1} << 26;
  static constexpr int32_t kDead = -1;

  // A pattern that must match the whole text (Regex::Match::kFull). Unlike Regex::compile, not
  // held to Regex::kMaxStates NFA nodes: `.{0,500}` is fine here. Throws md::Error naming the
  // unsupported syntax, or when the pattern matches no string or needs more than kMaxNodes
  // nodes, kMaxStates automaton states or kMaxWork to build.
  static std::shared_ptr<const RegexDfa> compile(std::string_view pattern);
  // From a parsed or compiled Regex (its nodes; its own closures are not used).
  static std::shared_ptr<const RegexDfa> build(const Regex& regex);

  // A node graph as Regex's (a character node: `ranges` and `next`; an empty node: `eps`; the
  // match: neither), plus call nodes (`call` >= 0, `next`): a grammar rule's body
  // (engine/grammar.h), where a call node stands for a whole string of rule `call`. The
  // automaton then has call edges beside its byte transitions.
  struct Node {
    std::vector<std::pair<uint32_t, uint32_t>> ranges;
    int call = -1;
    int next = -1;
    std::vector<int> eps;
  };
  // `budget`: construction work left (as kMaxWork counts it) shared by several builds (a
  // grammar's rules), decreased by this one's; null: kMaxWork for this build alone.
  static std::shared_ptr<const RegexDfa> build(const std::vector<Node>& nodes, int start, int match,
                                               int64_t* budget = nullptr);
  struct Call {
    int32_t rule;  // the rule called
    int32_t to;    // the state once its string has been read
  };
  const std::vector<Call>& calls(int32_t s) const { return calls_[size_t(s)]; }

  int32_t start() const { return 0; }
  // The state after byte b (kDead: no string that goes on this way matches).
  int32_t step(int32_t s, uint8_t b) const {
    return next_[size_t(s) * size_t(classes_) + class_of_[b]];
  }
  // The bytes so far match the whole pattern.
  bool accepts(int32_t s) const { return accept_[size_t(s)] != 0; }
  // Some byte leads to a live state (false: the match, if any, cannot be extended).
  bool can_continue(int32_t s) const { return more_[size_t(s)] != 0; }
  int states() const { return int(accept_.size()); }

 private:
  std::array<uint8_t, 256> class_of_{};
  int classes_ = 0;
  std::vector<int32_t> next_;  // [state][class]
  std::vector<uint8_t> accept_, more_;
  std::vector<std::vector<Call>> calls_;  // per state (empty for a plain regex)
};

}  // namespace md
