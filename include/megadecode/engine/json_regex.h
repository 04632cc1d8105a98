// Regular expressions for JSON Schema's `pattern` and `format` (engine/json_schema.h): the
// common subset of ECMA-262 syntax, compiled to a Thompson NFA over Unicode code points and run
// as a set of states, so that constrained decoding can tell after every character whether the
// string can still match (the set, pruned to states that can reach the match, is not empty) and
// whether it may end (the set holds the match).
//
// Supported: literals (UTF-8), `.`, classes `[...]` / `[^...]` with ranges and `\d \w \s \D \W
// \S`, escapes (`\n \r \t \f \v \0 \xHH \uHHHH` and escaped syntax characters), groups `(...)`,
// `(?:...)`, `(?<name>...)` (and Python's `(?P<name>...)`), alternation `|`, quantifiers `* + ?
// {m} {m,} {m,n}` (lazy `?` accepted: it changes which match a search finds, not whether one
// exists), `^` (Python's `\A`) at the start and `$` (`\Z`) at the end. JSON Schema patterns
// are searches: without `^` (`$`) the match may start (end) anywhere in the string; Match::kFull
// compiles a pattern that must match the whole string (what a `regex` structured output asks for:
// engine/regex_dfa.h). Not supported (an md::Error naming it): backreferences, lookaround, word
// boundaries, anchors elsewhere, more than kMaxStates states after expanding repetitions.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

namespace md {

class Regex {
 public:
  static constexpr int kMaxStates = 256;
  using States = std::array<uint64_t, kMaxStates / 64>;

  enum class Match { kSearch, kFull };
  // Throws md::Error naming the pattern and what in it is not supported.
  static std::shared_ptr<const Regex> compile(std::string_view pattern,
                                              Match mode = Match::kSearch);

  States start() const { return closure_[size_t(start_)]; }
  // After code point c: the states that can still reach the match (empty: no match possible).
  States step(const States& s, uint32_t c) const;
  // Whether some code point in [lo, hi] can be stepped on from s (a partly written character's
  // possible values: a UTF-8 lead byte's, an escape's).
  bool can_step(const States& s, uint32_t lo, uint32_t hi) const;
  bool accepts(const States& s) const { return has(s, match_); }
  static bool empty(const States& s) {
    for (uint64_t w : s)
      if (w) return false;
    return true;
  }
  int states() const { return int(nodes_.size()); }

 private:
  friend class RegexParser;
  friend class RegexDfa;
  // The nodes alone (no closures: start(), step() and accepts() cannot be used), up to
  // max_nodes of them: what RegexDfa compiles further, with sets of any size.
  static std::shared_ptr<const Regex> parse(std::string_view pattern, Match mode, int max_nodes);
  using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;  // sorted, disjoint, inclusive
  struct Node {
    Ranges ranges;         // a character node (non-empty ranges): consumes one in them
    int next = -1;         // the character node's successor
    std::vector<int> eps;  // an empty node: its successors without consuming
  };
  static bool has(const States& s, int i) { return s[size_t(i) >> 6] >> (i & 63) & 1; }
  void finish();  // closures and the live states

  std::vector<Node> nodes_;
  int start_ = 0, match_ = 0;
  std::vector<States> closure_;  // per node: the character nodes and match reachable emptily
  States live_{};                // nodes from which the match can be reached
};

}  // namespace md
