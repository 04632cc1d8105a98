// Regular expressions for JSON Schema (json_regex.h): a recursive-descent parser that builds a
// Thompson NFA (character nodes with one successor, empty nodes with any number), the empty
// closures of every node, and the nodes that can still reach the match.
#include "megadecode/engine/json_regex.h"

#include <fmt/format.h>

#include <algorithm>

#include "megadecode/base/error.h"
#include "nfa_builder.h"

namespace md {

namespace {

using Ranges = detail::CodeRanges;
using detail::complement;
using detail::normalized;
constexpr uint32_t kMaxCp = detail::kMaxCodePoint;

const Ranges kDigit = {{'0', '9'}};
const Ranges kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
// ECMA-262's WhiteSpace and LineTerminator.
const Ranges kSpace = {{0x09, 0x0D},     {0x20, 0x20},     {0xA0, 0xA0},     {0x1680, 0x1680},
                       {0x2000, 0x200A}, {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F},
                       {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};
const Ranges kLineTerminators = {{0x0A, 0x0A}, {0x0D, 0x0D}, {0x2028, 0x2029}};

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

class RegexParser {
 public:
  RegexParser(std::string_view pattern, Regex& r, int max_nodes)
      : whole_(pattern), r_(r), b_(r.nodes_, max_nodes, [this, max_nodes] {
          fail(
              fmt::format("more than {} states once its repetitions are expanded (too large for "
                          "the decoding constraint)",
                          max_nodes));
        }) {}

  // A search: each top-level alternative is anchored by its own ^ and $, and is otherwise
  // free to start and end anywhere in the string. A full match: every alternative is anchored at
  // both ends (a ^ or $ there is allowed and changes nothing).
  void run(Regex::Match mode) {
    const bool full = mode == Regex::Match::kFull;
    Frag all{-1, {}};
    for (std::string_view alt : top_level_alternatives()) {
      // ^ and $, or Python's \A and \Z (vLLM's regexes are Python's).
      const bool at_start = alt.starts_with('^') || alt.starts_with("\\A");
      if (at_start) alt.remove_prefix(alt.front() == '^' ? 1 : 2);
      const size_t end_anchor = ends_with_anchor(alt);
      const bool at_end = end_anchor > 0;
      alt.remove_suffix(end_anchor);
      p_ = alt;
      i_ = 0;
      Frag f = alternation();
      if (i_ != p_.size()) fail(fmt::format("an unmatched '{}'", p_[i_]));
      if (!at_start && !full) f = b_.concat(b_.star(b_.chars({{0, kMaxCp}})), f);
      if (!at_end && !full) f = b_.concat(f, b_.star(b_.chars({{0, kMaxCp}})));
      all = all.start < 0 ? f : b_.either(all, f);
    }
    r_.match_ = b_.add({});
    b_.patch(all.holes, r_.match_);
    r_.start_ = all.start;
  }

 private:
  using Frag = detail::NfaBuilder<Regex::Node>::Frag;

  [[noreturn]] void fail(const std::string& why) const {
    throw Error(fmt::format("pattern '{}': {}", whole_, why));
  }

  // The pattern split at its top-level '|' (outside groups, classes and escapes).
  std::vector<std::string_view> top_level_alternatives() const {
    std::vector<std::string_view> out;
    int depth = 0;
    bool in_class = false;
    size_t from = 0;
    for (size_t k = 0; k < whole_.size(); ++k) {
      const char c = whole_[k];
      if (c == '\\') {
        ++k;
      } else if (in_class) {
        in_class = c != ']';
      } else if (c == '[') {
        in_class = true;
      } else if (c == '(') {
        ++depth;
      } else if (c == ')') {
        --depth;
      } else if (c == '|' && depth == 0) {
        out.push_back(whole_.substr(from, k - from));
        from = k + 1;
      }
    }
    out.push_back(whole_.substr(from));
    return out;
  }

  // The length of the end anchor s ends with: a '$' that is not escaped (1), Python's \Z (2),
  // or none (0).
  static size_t ends_with_anchor(std::string_view s) {
    auto escaped = [&](size_t at) {  // s[at] follows an odd run of backslashes
      size_t slashes = 0;
      for (size_t k = at; k > 0 && s[k - 1] == '\\'; --k) ++slashes;
      return slashes % 2 == 1;
    };
    if (s.empty()) return 0;
    if (s.back() == '$' && !escaped(s.size() - 1)) return 1;
    if (s.ends_with("\\Z") && escaped(s.size() - 1)) return 2;
    return 0;
  }

  bool at_end() const { return i_ >= p_.size(); }
  char peek() const { return at_end() ? '\0' : p_[i_]; }

  // One code point of the pattern (UTF-8).
  uint32_t code_point() {
    const auto b = uint8_t(p_[i_++]);
    if (b < 0x80) return b;
    const int n = b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : b >= 0xC0 ? 1 : -1;
    if (n < 0) fail("invalid UTF-8");
    uint32_t c = b & (0x3F >> n);
    for (int k = 0; k < n; ++k) {
      if (at_end() || (uint8_t(p_[i_]) & 0xC0) != 0x80) fail("invalid UTF-8");
      c = c << 6 | (uint8_t(p_[i_++]) & 0x3F);
    }
    return c;
  }

  Frag alternation() {
    Frag f = sequence();
    while (peek() == '|') {
      ++i_;
      f = b_.either(f, sequence());
    }
    return f;
  }

  Frag sequence() {
    Frag f = b_.nothing();
    while (!at_end() && peek() != '|' && peek() != ')') f = b_.concat(f, repeat());
    return f;
  }

  // {m}, {m,} or {m,n} at i_ (false: not a quantifier; '{' is then a literal).
  bool braces(int& lo, int& hi) {
    size_t k = i_ + 1;
    auto number = [&](int& out) {
      const size_t from = k;
      out = 0;
      while (k < p_.size() && p_[k] >= '0' && p_[k] <= '9') {
        out = std::min(out * 10 + (p_[k] - '0'), 100000);
        ++k;
      }
      return k > from;
    };
    if (!number(lo)) return false;
    hi = lo;
    if (k < p_.size() && p_[k] == ',') {
      ++k;
      if (!number(hi)) hi = -1;
    }
    if (k >= p_.size() || p_[k] != '}') return false;
    i_ = k + 1;
    if (hi >= 0 && hi < lo) fail(fmt::format("a repetition {{{},{}}} out of order", lo, hi));
    return true;
  }

  // Whether a {m}, {m,} or {m,n} quantifier starts at i_ (without consuming it).
  bool quantifier_at() {
    const size_t at = i_;
    int lo = 0, hi = 0;
    const bool q = braces(lo, hi);
    i_ = at;
    return q;
  }

  Frag repeat() {
    const size_t at = i_;
    Frag a = atom();
    const char q = peek();
    int lo = 0, hi = 0;
    if (q == '*' || q == '+' || q == '?') {
      ++i_;
    } else if (q != '{' || !braces(lo, hi)) {
      return a;
    }
    if (peek() == '?') ++i_;  // lazy: the same strings match
    // A quantifier on a quantifier is a syntax error (as JavaScript engines report it).
    if (const char n = peek(); n == '*' || n == '+' || n == '?' || (n == '{' && quantifier_at()))
      fail(fmt::format("nothing to repeat before '{}'", n));
    if (q == '*') return b_.star(a);
    if (q == '+') return b_.plus(a);
    if (q == '?') return b_.optional(a);
    // x{lo,hi} (NfaBuilder::repeat): the first copy is the atom parsed above, each other one
    // the atom parsed again (fresh nodes).
    const size_t after = i_;
    bool first = true;
    return b_.repeat(lo, hi, [&]() {
      if (first) {
        first = false;
        return a;
      }
      i_ = at;
      Frag c = atom();
      i_ = after;
      return c;
    });
  }

  Frag atom() {
    if (at_end()) fail("ends where an expression is expected");
    const char c = p_[i_];
    switch (c) {
      case '(': {
        ++i_;
        if (peek() == '?') {
          const std::string_view rest = p_.substr(i_);
          if (rest.starts_with("?:")) {
            i_ += 2;
          } else if (rest.starts_with("?P=")) {
            fail("backreferences are not supported");
          } else if ((rest.starts_with("?<") && !rest.starts_with("?<=") &&
                      !rest.starts_with("?<!")) ||
                     rest.starts_with("?P<")) {  // a name, ECMAScript's or Python's spelling
            const size_t close = p_.find('>', i_);
            if (close == std::string_view::npos) fail("an unterminated group name");
            i_ = close + 1;
          } else {
            fail("lookahead and lookbehind are not supported");
          }
        }
        Frag f = alternation();
        if (peek() != ')') fail("an unterminated group");
        ++i_;
        return f;
      }
      case '[':
        return b_.chars(char_class());
      case '.':
        ++i_;
        return b_.chars(complement(kLineTerminators));
      case '\\':
        return b_.chars(escape(false));
      case '^':
      case '$':
        fail(
            "'^' and '$' are supported only at the start and end of the pattern (or of a "
            "top-level alternative)");
      case '*':
      case '+':
      case '?':
        fail(fmt::format("nothing to repeat before '{}'", c));
      case ')':
        fail("an unmatched ')'");
      default: {
        const uint32_t cp = code_point();
        return b_.chars({{cp, cp}});
      }
    }
  }

  // After '\': the escape's characters (a class escape, or one code point).
  Ranges escape(bool in_class) {
    ++i_;
    if (at_end()) fail("ends with '\\'");
    const char c = p_[i_++];
    auto one = [](uint32_t cp) { return Ranges{{cp, cp}}; };
    auto hex = [&](int digits) {
      uint32_t v = 0;
      for (int k = 0; k < digits; ++k) {
        const int h = at_end() ? -1 : hex_value(p_[i_]);
        if (h < 0) fail(fmt::format("'\\{}' needs {} hex digits", c, digits));
        v = v * 16 + uint32_t(h);
        ++i_;
      }
      return v;
    };
    switch (c) {
      case 'd':
        return kDigit;
      case 'D':
        return complement(kDigit);
      case 'w':
        return kWord;
      case 'W':
        return complement(kWord);
      case 's':
        return kSpace;
      case 'S':
        return complement(kSpace);
      case 'n':
        return one('\n');
      case 'r':
        return one('\r');
      case 't':
        return one('\t');
      case 'f':
        return one('\f');
      case 'v':
        return one('\v');
      case '0':
        return one(0);
      case 'x':
        return one(hex(2));
      case 'u':
        return one(hex(4));
      case 'A':
      case 'Z':
        fail(
            "\\A and \\Z are supported only at the start and end of the pattern (or of a "
            "top-level alternative)");
      case 'b':
        if (in_class) return one(8);
        fail("word boundaries (\\b, \\B) are not supported");
      case 'B':
        fail("word boundaries (\\b, \\B) are not supported");
      case 'k':
        fail("backreferences are not supported");
      default:
        if (c >= '1' && c <= '9') fail("backreferences are not supported");
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
          fail(fmt::format("the escape '\\{}' is not supported", c));
        --i_;
        {
          const uint32_t cp = code_point();  // an escaped punctuation (or other) character
          return one(cp);
        }
    }
  }

  // After '[': the class's characters (complemented for '[^').
  Ranges char_class() {
    ++i_;
    const bool negated = peek() == '^';
    if (negated) ++i_;
    Ranges r;
    // One item: a code point (single = true) or a class escape's set.
    auto item = [&](bool& single) {
      single = true;
      if (peek() == '\\') {
        Ranges e = escape(true);
        single = e.size() == 1 && e[0].first == e[0].second;
        return e;
      }
      const uint32_t cp = code_point();
      return Ranges{{cp, cp}};
    };
    while (true) {
      if (at_end()) fail("an unterminated class '['");
      if (peek() == ']') {
        ++i_;
        break;
      }
      bool single = false;
      Ranges a = item(single);
      if (single && peek() == '-' && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        ++i_;
        bool single_b = false;
        const Ranges b = item(single_b);
        if (!single_b) fail("a class range ends in a class escape");
        if (b[0].first < a[0].first) fail("a class range out of order");
        r.emplace_back(a[0].first, b[0].first);
        continue;
      }
      r.insert(r.end(), a.begin(), a.end());
    }
    return negated ? complement(r) : normalized(r);
  }

  std::string_view whole_, p_;
  size_t i_ = 0;
  Regex& r_;
  detail::NfaBuilder<Regex::Node> b_;
};

std::shared_ptr<const Regex> Regex::compile(std::string_view pattern, Match mode) {
  auto r = std::make_shared<Regex>();
  RegexParser(pattern, *r, kMaxStates).run(mode);
  r->finish();
  return r;
}

std::shared_ptr<const Regex> Regex::parse(std::string_view pattern, Match mode, int max_nodes) {
  auto r = std::make_shared<Regex>();
  RegexParser(pattern, *r, max_nodes).run(mode);
  return r;
}

void Regex::finish() {
  const int n = int(nodes_.size());
  // Live: the match, and whatever reaches a live node (to a fixed point).
  live_ = {};
  live_[size_t(match_) >> 6] |= uint64_t(1) << (match_ & 63);
  for (bool grew = true; grew;) {
    grew = false;
    for (int i = 0; i < n; ++i) {
      if (has(live_, i)) continue;
      const Node& x = nodes_[size_t(i)];
      bool reach = !x.ranges.empty() && x.next >= 0 && has(live_, x.next);
      for (int e : x.eps) reach = reach || (e >= 0 && has(live_, e));
      if (reach) {
        live_[size_t(i) >> 6] |= uint64_t(1) << (i & 63);
        grew = true;
      }
    }
  }
  // Closures: the character nodes and the match reachable through empty nodes, live ones only.
  closure_.assign(size_t(n), States{});
  for (int i = 0; i < n; ++i) {
    States& c = closure_[size_t(i)];
    std::vector<int> stack{i};
    States seen{};
    while (!stack.empty()) {
      const int k = stack.back();
      stack.pop_back();
      if (k < 0 || has(seen, k)) continue;
      seen[size_t(k) >> 6] |= uint64_t(1) << (k & 63);
      const Node& x = nodes_[size_t(k)];
      if ((!x.ranges.empty() || k == match_) && has(live_, k))
        c[size_t(k) >> 6] |= uint64_t(1) << (k & 63);
      for (int e : x.eps) stack.push_back(e);
    }
  }
}

bool Regex::can_step(const States& s, uint32_t lo, uint32_t hi) const {
  for (size_t w = 0; w < s.size(); ++w)
    for (uint64_t bits = s[w]; bits; bits &= bits - 1) {
      const Node& x = nodes_[w * 64 + size_t(__builtin_ctzll(bits))];
      // The first range ending at or after lo starts at or before hi.
      const auto it = std::lower_bound(
          x.ranges.begin(), x.ranges.end(), lo,
          [](const std::pair<uint32_t, uint32_t>& r, uint32_t v) { return r.second < v; });
      if (it != x.ranges.end() && it->first <= hi) return true;
    }
  return false;
}

Regex::States Regex::step(const States& s, uint32_t c) const {
  States out{};
  for (size_t w = 0; w < s.size(); ++w)
    for (uint64_t bits = s[w]; bits; bits &= bits - 1) {
      const int i = int(w * 64) + __builtin_ctzll(bits);
      const Node& x = nodes_[size_t(i)];
      if (x.ranges.empty()) continue;  // the match
      const auto it = std::upper_bound(x.ranges.begin(), x.ranges.end(),
                                       std::pair<uint32_t, uint32_t>{c, UINT32_MAX});
      if (it == x.ranges.begin() || std::prev(it)->second < c) continue;
      const States& next = closure_[size_t(x.next)];
      for (size_t k = 0; k < out.size(); ++k) out[k] |= next[k];
    }
  return out;
}

}  // namespace md
