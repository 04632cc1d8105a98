// Thompson's construction, shared by the regular expressions of engine/json_regex.cpp and the
// grammar rules of engine/grammar.cpp: fragments of a node graph whose character nodes have one
// successor (`next`) and whose empty nodes have any number (`eps`), joined by patching their open
// successor slots. Also the code point range sets both read. Private to src/engine.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace md::detail {

using CodeRanges = std::vector<std::pair<uint32_t, uint32_t>>;  // inclusive
constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// Sorted, with overlapping and adjacent ranges merged.
inline CodeRanges normalized(CodeRanges r) {
  std::sort(r.begin(), r.end());
  CodeRanges out;
  for (const auto& [a, b] : r) {
    if (!out.empty() && a <= out.back().second + 1)
      out.back().second = std::max(out.back().second, b);
    else
      out.emplace_back(a, b);
  }
  return out;
}

// Every code point not in r.
inline CodeRanges complement(const CodeRanges& r) {
  CodeRanges out;
  uint32_t at = 0;
  for (const auto& [a, b] : normalized(r)) {
    if (a > at) out.emplace_back(at, a - 1);
    at = b + 1;
  }
  if (at <= kMaxCodePoint) out.emplace_back(at, kMaxCodePoint);
  return out;
}

// Node: {ranges, next, eps} at least (Regex::Node, RegexDfa::Node).
template <class Node>
class NfaBuilder {
 public:
  // A fragment: its first node and its open successor slots (node, -1: a character node's
  // next; k >= 0: an empty node's eps[k]).
  struct Frag {
    int start;
    std::vector<std::pair<int, int>> holes;
  };

  // `too_many` is called (and must throw) when a node past max_nodes is added.
  NfaBuilder(std::vector<Node>& nodes, int max_nodes, std::function<void()> too_many)
      : nodes_(nodes), max_nodes_(max_nodes), too_many_(std::move(too_many)) {}

  int add(Node n) {
    if (nodes_.size() >= size_t(max_nodes_)) too_many_();
    nodes_.push_back(std::move(n));
    return int(nodes_.size()) - 1;
  }
  // A node with a single successor slot (a character or a call node).
  Frag one(Node n) {
    const int i = add(std::move(n));
    return {i, {{i, -1}}};
  }
  Frag chars(CodeRanges r) {
    Node n;
    n.ranges = normalized(std::move(r));
    return one(std::move(n));
  }
  Frag nothing() {  // the empty string
    Node n;
    n.eps = {-1};
    const int i = add(std::move(n));
    return {i, {{i, 0}}};
  }
  void patch(const std::vector<std::pair<int, int>>& holes, int target) {
    for (const auto& [n, k] : holes) {
      if (k < 0)
        nodes_[size_t(n)].next = target;
      else
        nodes_[size_t(n)].eps[size_t(k)] = target;
    }
  }
  Frag concat(Frag a, const Frag& b) {
    patch(a.holes, b.start);
    return {a.start, b.holes};
  }
  Frag either(Frag a, const Frag& b) {
    Node n;
    n.eps = {a.start, b.start};
    const int s = add(std::move(n));
    a.holes.insert(a.holes.end(), b.holes.begin(), b.holes.end());
    return {s, a.holes};
  }
  Frag star(const Frag& a) {
    Node n;
    n.eps = {a.start, -1};
    const int s = add(std::move(n));
    patch(a.holes, s);
    return {s, {{s, 1}}};
  }
  Frag plus(const Frag& a) { return {a.start, star(a).holes}; }
  Frag optional(Frag a) {
    Node n;
    n.eps = {a.start, -1};
    const int s = add(std::move(n));
    a.holes.emplace_back(s, 1);
    return {s, a.holes};
  }
  // x{lo,hi} (hi < 0: no upper bound), each copy of x a fresh fragment from make(): lo copies,
  // then x* or the optional copies nested, (x(x(x)?)?)? rather than x?x?x?: the same strings,
  // but one way to read each, so that a state set holds one position in the run, not all.
  template <class Make>
  Frag repeat(int lo, int hi, Make&& make) {
    Frag f = nothing();
    for (int k = 0; k < lo; ++k) f = concat(f, make());
    if (hi < 0) return concat(f, star(make()));
    if (hi == lo) return f;
    std::vector<Frag> copies;
    for (int k = lo; k < hi; ++k) copies.push_back(make());
    Frag tail = optional(copies.back());
    for (size_t k = copies.size() - 1; k-- > 0;) tail = optional(concat(copies[k], tail));
    return concat(f, tail);
  }

 private:
  std::vector<Node>& nodes_;
  int max_nodes_;
  std::function<void()> too_many_;
};

}  // namespace md::detail
