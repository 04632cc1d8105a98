// The byte automaton of a regular expression (engine/regex_dfa.h).
#include "megadecode/engine/regex_dfa.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>

#include "megadecode/base/error.h"

namespace md {
namespace {

struct ByteRange {
  uint8_t lo, hi;
  bool operator==(const ByteRange&) const = default;
};
using Sequence = std::vector<ByteRange>;  // one byte range per position of the encoding

int utf8_length(uint32_t c) {
  return c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4;
}

void encode(uint32_t c, uint8_t* out) {
  const int n = utf8_length(c);
  if (n == 1) {
    out[0] = uint8_t(c);
    return;
  }
  for (int k = n - 1; k > 0; --k, c >>= 6) out[k] = uint8_t(0x80 | (c & 0x3F));
  out[0] = uint8_t((0xF00 >> n) | c);  // n = 2: 0xC0, 3: 0xE0, 4: 0xF0
}

// The UTF-8 encodings of the code points [lo, hi] as sequences of byte ranges, each sequence's
// set of strings being the product of its ranges. Surrogates are left out. A range is split
// first where the encoded length changes, then until every position after the first that the
// two ends do not share spans whole continuation bytes (0x80-0xBF), so the product is exact.
void utf8_sequences(uint32_t lo, uint32_t hi, std::vector<Sequence>& out) {
  if (lo > hi) return;
  if (lo <= 0xDFFF && hi >= 0xD800) {
    if (lo < 0xD800) utf8_sequences(lo, 0xD7FF, out);
    if (hi > 0xDFFF) utf8_sequences(0xE000, hi, out);
    return;
  }
  for (uint32_t top : {0x7Fu, 0x7FFu, 0xFFFFu})
    if (lo <= top && hi > top) {
      utf8_sequences(lo, top, out);
      utf8_sequences(top + 1, hi, out);
      return;
    }
  const int n = utf8_length(lo);
  for (int k = 1; k < n; ++k) {
    const uint32_t low = (uint32_t{1} << (6 * k)) - 1;  // the last k bytes' bits
    if ((lo & ~low) == (hi & ~low)) continue;
    if ((lo & low) != 0) {
      utf8_sequences(lo, lo | low, out);
      utf8_sequences((lo | low) + 1, hi, out);
      return;
    }
    if ((hi & low) != low) {
      utf8_sequences(lo, (hi & ~low) - 1, out);
      utf8_sequences(hi & ~low, hi, out);
      return;
    }
  }
  uint8_t a[4], b[4];
  encode(lo, a);
  encode(hi, b);
  Sequence s;
  for (int k = 0; k < n; ++k) s.push_back({a[k], b[k]});
  out.push_back(std::move(s));
}

// A byte transition of the byte NFA: on [lo, hi] to state `to`, or (to < 0) past the end of the
// character: into the closure of its regex node's successor.
struct Edge {
  uint8_t lo, hi;
  int32_t to;
};

using Bits = std::vector<uint64_t>;
void set(Bits& b, int i) {
  b[size_t(i) >> 6] |= uint64_t{1} << (i & 63);
}

}  // namespace

std::shared_ptr<const RegexDfa> RegexDfa::compile(std::string_view pattern) {
  return build(*Regex::parse(pattern, Regex::Match::kFull, kMaxNodes));
}

std::shared_ptr<const RegexDfa> RegexDfa::build(const Regex& regex) {
  std::vector<Node> nodes;
  nodes.reserve(regex.nodes_.size());
  for (const Regex::Node& x : regex.nodes_) nodes.push_back({x.ranges, -1, x.next, x.eps});
  return build(nodes, regex.start_, regex.match_);
}

std::shared_ptr<const RegexDfa> RegexDfa::build(const std::vector<Node>& nodes, int start,
                                                int match, int64_t* budget) {
  int64_t own = kMaxWork;
  int64_t& left = budget ? *budget : own;
  const int n = int(nodes.size());
  // Each character node's UTF-8 byte sequences (none for a node of surrogates only).
  std::vector<std::vector<Sequence>> seqs(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    for (const auto& [lo, hi] : nodes[size_t(i)].ranges)
      utf8_sequences(lo, std::min<uint32_t>(hi, 0x10FFFF), seqs[size_t(i)]);
  // Live nodes: those from which the match can be reached (backwards from it).
  std::vector<std::vector<int>> into(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const Node& x = nodes[size_t(i)];
    if ((!seqs[size_t(i)].empty() || x.call >= 0) && x.next >= 0) into[size_t(x.next)].push_back(i);
    for (int e : x.eps)
      if (e >= 0) into[size_t(e)].push_back(i);
  }
  std::vector<uint8_t> live(static_cast<size_t>(n), 0);
  std::vector<int> stack{match};
  live[size_t(match)] = 1;
  while (!stack.empty()) {
    const int k = stack.back();
    stack.pop_back();
    for (int from : into[size_t(k)])
      if (!live[size_t(from)]) {
        live[size_t(from)] = 1;
        stack.push_back(from);
      }
  }
  // closure(i): the live character and call nodes and the match reachable from i through empty
  // nodes.
  std::vector<std::vector<int>> closure(static_cast<size_t>(n));
  std::vector<uint8_t> closed(static_cast<size_t>(n), 0);
  std::vector<int> seen_at(static_cast<size_t>(n), -1);
  auto closure_of = [&](int i) -> const std::vector<int>& {
    if (closed[size_t(i)]) return closure[size_t(i)];
    std::vector<int>& c = closure[size_t(i)];
    std::vector<int> todo{i};
    while (!todo.empty()) {
      const int k = todo.back();
      todo.pop_back();
      if (k < 0 || seen_at[size_t(k)] == i) continue;
      seen_at[size_t(k)] = i;
      const Node& x = nodes[size_t(k)];
      if ((!x.ranges.empty() || x.call >= 0 || k == match) && live[size_t(k)]) c.push_back(k);
      for (int e : x.eps) todo.push_back(e);
    }
    closed[size_t(i)] = 1;
    return c;
  };

  // Stage 1: the byte NFA. States 0 .. n-1 are the regex's nodes (a character node: before its
  // first byte); the states after them are part-read characters, each owned by one node.
  std::vector<std::vector<Edge>> edges(static_cast<size_t>(n));
  std::vector<int> owner(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) owner[size_t(i)] = i;
  for (int i = 0; i < n; ++i) {
    const Node& node = nodes[size_t(i)];
    if (node.ranges.empty() || !live[size_t(i)]) continue;
    // A trie of the sequences' ranges (a prefix shared by several sequences is one state) whose
    // tails of whole continuation bytes are shared too: "r more bytes 80-BF" is one state per
    // node and r, whatever led there. (Without this, each position of `.{0,200}` would take
    // some 19 automaton states instead of 7.)
    std::array<int, 4> tail{-1, -1, -1, -1};
    auto new_state = [&]() {
      edges.emplace_back();
      owner.push_back(i);
      return int(edges.size()) - 1;
    };
    std::function<int(int)> tail_state = [&](int r) {
      if (tail[size_t(r)] < 0) {
        const int t = new_state();
        tail[size_t(r)] = t;
        const int to = r == 1 ? -1 : tail_state(r - 1);
        edges[size_t(t)].push_back({0x80, 0xBF, to});
      }
      return tail[size_t(r)];
    };
    auto edge_to = [&](int at, ByteRange r, int to) {
      for (const Edge& e : edges[size_t(at)])
        if (e.lo == r.lo && e.hi == r.hi && e.to == to) return;
      edges[size_t(at)].push_back({r.lo, r.hi, to});
    };
    for (const Sequence& s : seqs[size_t(i)]) {
      int at = i;
      size_t k = 0;
      for (; k + 1 < s.size(); ++k) {
        const bool whole_tail = std::all_of(s.begin() + long(k) + 1, s.end(), [](ByteRange r) {
          return r.lo == 0x80 && r.hi == 0xBF;
        });
        if (whole_tail) {
          edge_to(at, s[k], tail_state(int(s.size() - 1 - k)));
          break;
        }
        int to = -1;
        for (const Edge& e : edges[size_t(at)])
          if (e.to >= 0 && e.lo == s[k].lo && e.hi == s[k].hi) to = e.to;
        if (to < 0) {
          to = new_state();
          edges[size_t(at)].push_back({s[k].lo, s[k].hi, to});
        }
        at = to;
      }
      if (k + 1 == s.size()) edge_to(at, s.back(), -1);
    }
  }
  const int total = int(edges.size());
  const size_t words = (size_t(total) + 63) / 64;

  // Byte classes: bytes between the same range boundaries step alike.
  std::array<bool, 257> cut{};
  cut[0] = true;
  for (const auto& list : edges)
    for (const Edge& e : list) {
      cut[e.lo] = true;
      cut[size_t(e.hi) + 1] = true;
    }
  auto dfa = std::make_shared<RegexDfa>();
  std::vector<uint8_t> representative;
  for (int b = 0; b < 256; ++b) {
    if (cut[size_t(b)]) representative.push_back(uint8_t(b));
    dfa->class_of_[size_t(b)] = uint8_t(representative.size() - 1);
  }
  dfa->classes_ = int(representative.size());

  // Stage 2: subsets. A subset is its bits plus whether it holds the match.
  auto add_closure = [&](int i, Bits& bits, bool& accept) {
    for (int k : closure_of(i)) {
      if (k == match)
        accept = true;
      else
        set(bits, k);
    }
  };
  std::unordered_map<std::string, int32_t> index;
  std::vector<Bits> subsets;
  auto intern = [&](const Bits& bits, bool accept) -> int32_t {
    if (!accept && std::all_of(bits.begin(), bits.end(), [](uint64_t w) { return w == 0; }))
      return kDead;
    std::string key(reinterpret_cast<const char*>(bits.data()), bits.size() * 8);
    key.push_back(accept ? '1' : '0');
    const auto [it, fresh] = index.emplace(std::move(key), int32_t(subsets.size()));
    if (fresh) {
      if (int(subsets.size()) >= kMaxStates)
        throw Error(
            fmt::format("the regular expression needs more than {} automaton states (too large for "
                        "constrained decoding)",
                        kMaxStates));
      subsets.push_back(bits);
      dfa->accept_.push_back(accept);
    }
    return it->second;
  };
  {
    Bits bits(words, 0);
    bool accept = false;
    add_closure(start, bits, accept);
    if (intern(bits, accept) == kDead) throw Error("the regular expression matches no string");
  }
  for (size_t s = 0; s < subsets.size(); ++s) {
    const Bits members = subsets[s];  // (a copy: interning below may grow `subsets`)
    for (uint64_t w : members) left -= __builtin_popcountll(w) * int64_t(dfa->classes_);
    if (left < 0)
      throw Error(
          "the regular expression is too complex to compile for constrained decoding (its "
          "automaton's states hold too many positions)");
    for (int c = 0; c < dfa->classes_; ++c) {
      const uint8_t b = representative[size_t(c)];
      Bits bits(words, 0);
      bool accept = false;
      for (size_t w = 0; w < words; ++w)
        for (uint64_t m = members[w]; m; m &= m - 1) {
          const int k = int(w * 64) + __builtin_ctzll(m);
          for (const Edge& e : edges[size_t(k)]) {
            if (b < e.lo || b > e.hi) continue;
            if (e.to >= 0)
              set(bits, e.to);
            else
              add_closure(nodes[size_t(owner[size_t(k)])].next, bits, accept);
          }
        }
      dfa->next_.push_back(intern(bits, accept));
    }
    // Call edges: per rule called by a member, the members' successors after the call.
    struct Called {
      int rule;
      Bits bits;
      bool accept;
    };
    std::vector<Called> called;
    for (size_t w = 0; w < words && w * 64 < size_t(n); ++w)
      for (uint64_t m = members[w]; m; m &= m - 1) {
        const int k = int(w * 64) + __builtin_ctzll(m);
        if (k >= n || nodes[size_t(k)].call < 0) continue;
        const int rule = nodes[size_t(k)].call;
        auto it = std::find_if(called.begin(), called.end(),
                               [&](const Called& c) { return c.rule == rule; });
        if (it == called.end()) it = called.insert(called.end(), {rule, Bits(words, 0), false});
        add_closure(nodes[size_t(k)].next, it->bits, it->accept);
      }
    for (const Called& c : called) {
      const int32_t to = intern(c.bits, c.accept);  // may grow subsets
      dfa->calls_.resize(subsets.size());
      dfa->calls_[s].push_back({c.rule, to});
    }
  }
  dfa->calls_.resize(subsets.size());
  dfa->more_.resize(subsets.size());
  for (size_t s = 0; s < subsets.size(); ++s)
    for (int c = 0; c < dfa->classes_; ++c)
      dfa->more_[s] |= dfa->next_[s * size_t(dfa->classes_) + size_t(c)] != kDead;
  return dfa;
}

}  // namespace md
