// The GBNF reader shared by engine/gbnf.cpp (grammars without recursion, written out as one
// pattern) and engine/grammar.cpp (any grammar, as a pushdown automaton): the syntax tree of each
// rule, and errors with the line and column. Private to src/engine.
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "megadecode/base/error.h"

namespace md::gbnf {

struct Alternatives;

// One item of a sequence, with its repetition.
struct Item {
  enum class Kind { kLiteral, kClass, kAny, kRef, kGroup };
  Kind kind = Kind::kLiteral;
  std::vector<uint32_t> text;                         // kLiteral: code points
  std::vector<std::pair<uint32_t, uint32_t>> ranges;  // kClass
  bool negated = false;                               // kClass
  std::string name;                                   // kRef
  size_t at = 0;                                      // kRef: where it is used (for errors)
  std::shared_ptr<Alternatives> group;                // kGroup
  int min = 1, max = 1;                               // max -1: unbounded
};
struct Alternatives {
  std::vector<std::vector<Item>> seqs;
};

class Parser {
 public:
  explicit Parser(std::string_view src) : src_(src) {}

  std::map<std::string, std::pair<Alternatives, size_t>> rules() {
    std::map<std::string, std::pair<Alternatives, size_t>> out;
    space();
    if (at_end()) fail("the grammar is empty");
    while (!at_end()) {
      const size_t start = i_;
      const std::string name = identifier();
      if (name.empty()) fail("a rule name is expected");
      space();
      if (src_.substr(i_, 3) != "::=") fail(fmt::format("'::=' is expected after '{}'", name));
      i_ += 3;
      Alternatives body = alternatives();
      if (!at_end() && peek() == ')') fail("an unmatched ')'");
      if (out.count(name)) fail(fmt::format("the rule '{}' is defined twice", name), start);
      out.emplace(name, std::make_pair(std::move(body), start));
    }
    return out;
  }

  [[noreturn]] void fail(const std::string& why, size_t at = std::string::npos) const {
    throw Error(fmt::format("grammar, {}: {}", where(at == std::string::npos ? i_ : at), why));
  }
  std::string where(size_t at) const {
    int line = 1, col = 1;
    for (size_t k = 0; k < at && k < src_.size(); ++k) {
      if (src_[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    return fmt::format("line {} column {}", line, col);
  }

 private:
  bool at_end() const { return i_ >= src_.size(); }
  char peek() const { return at_end() ? '\0' : src_[i_]; }
  static bool word(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
  }

  // Blanks, newlines and comments.
  void space() {
    while (!at_end()) {
      const char c = peek();
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++i_;
      } else if (c == '#') {
        while (!at_end() && peek() != '\n') ++i_;
      } else {
        break;
      }
    }
  }
  std::string identifier() {
    const size_t from = i_;
    while (!at_end() && word(peek())) ++i_;
    return std::string(src_.substr(from, i_ - from));
  }
  // Whether a new rule (`name ::=`) starts at i_.
  bool rule_starts() const {
    size_t k = i_;
    while (k < src_.size() && word(src_[k])) ++k;
    if (k == i_) return false;
    while (k < src_.size() && (src_[k] == ' ' || src_[k] == '\t')) ++k;
    return src_.substr(k, 3) == "::=";
  }

  Alternatives alternatives() {
    Alternatives a;
    a.seqs.push_back(sequence());
    while (peek() == '|') {
      ++i_;
      a.seqs.push_back(sequence());
    }
    return a;
  }

  std::vector<Item> sequence() {
    std::vector<Item> seq;
    for (;;) {
      space();
      if (at_end() || peek() == '|' || peek() == ')' || rule_starts()) return seq;
      Item it = atom();
      suffixes(it);
      seq.push_back(std::move(it));
    }
  }

  // One code point of UTF-8 text.
  uint32_t utf8() {
    const auto b = uint8_t(src_[i_++]);
    if (b < 0x80) return b;
    const int n = b >= 0xF0 && b < 0xF8 ? 3 : b >= 0xE0 ? 2 : b >= 0xC2 && b < 0xE0 ? 1 : -1;
    if (n < 0 || b >= 0xF8) fail("invalid UTF-8", i_ - 1);
    uint32_t c = b & (0x3F >> n);
    for (int k = 0; k < n; ++k) {
      if (at_end() || (uint8_t(peek()) & 0xC0) != 0x80) fail("invalid UTF-8");
      c = c << 6 | (uint8_t(src_[i_++]) & 0x3F);
    }
    return c;
  }
  uint32_t hex(int digits) {
    uint32_t v = 0;
    for (int k = 0; k < digits; ++k) {
      const char c = peek();
      const int d = c >= '0' && c <= '9'   ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
      if (d < 0) fail(fmt::format("an escape needs {} hex digits", digits));
      v = v << 4 | uint32_t(d);
      ++i_;
    }
    if (v > 0x10FFFF) fail("an escape past U+10FFFF");
    return v;
  }
  // A character of a literal or a class (at a backslash: its escape).
  uint32_t character() {
    if (at_end()) fail("the grammar ends inside a literal or class");
    if (peek() != '\\') return utf8();
    ++i_;
    if (at_end()) fail("the grammar ends inside an escape");
    const char c = src_[i_++];
    switch (c) {
      case 'n':
        return '\n';
      case 'r':
        return '\r';
      case 't':
        return '\t';
      case '\\':
      case '"':
      case '[':
      case ']':
      case '-':
      case '^':
        return uint8_t(c);
      case 'x':
        return hex(2);
      case 'u':
        return hex(4);
      case 'U':
        return hex(8);
      default:
        fail(fmt::format("unknown escape '\\{}'", c), i_ - 2);
    }
  }

  Item atom() {
    Item it;
    const char c = peek();
    if (c == '"') {
      ++i_;
      while (peek() != '"') {
        if (at_end() || peek() == '\n') fail("an unterminated literal");
        it.text.push_back(character());
      }
      ++i_;
      it.kind = Item::Kind::kLiteral;
    } else if (c == '[') {
      ++i_;
      it.kind = Item::Kind::kClass;
      if (peek() == '^') {
        it.negated = true;
        ++i_;
      }
      while (peek() != ']') {
        if (at_end()) fail("an unterminated character class");
        const uint32_t lo = character();
        uint32_t hi = lo;
        if (peek() == '-' && i_ + 1 < src_.size() && src_[i_ + 1] != ']') {
          ++i_;
          hi = character();
          if (hi < lo) fail("a class range out of order");
        }
        it.ranges.emplace_back(lo, hi);
      }
      ++i_;
      if (it.ranges.empty() && !it.negated) fail("an empty character class");
    } else if (c == '.') {
      ++i_;
      it.kind = Item::Kind::kAny;
    } else if (c == '(') {
      ++i_;
      it.kind = Item::Kind::kGroup;
      it.group = std::make_shared<Alternatives>(alternatives());
      space();
      if (peek() != ')') fail("an unterminated group");
      ++i_;
    } else if (word(c)) {
      it.kind = Item::Kind::kRef;
      it.at = i_;
      it.name = identifier();
    } else if (c == '<') {
      fail("token references (<...>) are not supported");
    } else {
      fail(fmt::format("unexpected '{}'", c));
    }
    return it;
  }

  // {m}, {m,} or {m,n} at i_ (after the brace).
  void braces(int& lo, int& hi) {
    auto number = [&]() {
      space();
      if (!(peek() >= '0' && peek() <= '9')) fail("a number is expected in a repetition");
      int v = 0;
      while (peek() >= '0' && peek() <= '9') v = std::min(v * 10 + (src_[i_++] - '0'), 100000);
      space();
      return v;
    };
    lo = number();
    hi = lo;
    if (peek() == ',') {
      ++i_;
      space();
      hi = peek() == '}' ? -1 : number();
    }
    if (peek() != '}') fail("an unterminated repetition");
    ++i_;
    if (hi >= 0 && hi < lo) fail(fmt::format("a repetition {{{},{}}} out of order", lo, hi));
  }

  void suffixes(Item& it) {
    for (;;) {
      const char c = peek();
      int lo, hi;
      if (c == '*') {
        lo = 0, hi = -1, ++i_;
      } else if (c == '+') {
        lo = 1, hi = -1, ++i_;
      } else if (c == '?') {
        lo = 0, hi = 1, ++i_;
      } else if (c == '{') {
        ++i_;
        braces(lo, hi);
      } else {
        return;
      }
      if (it.min != 1 || it.max != 1) {  // a repetition of a repetition: group the first
        Item inner = std::move(it);
        it = Item{};
        it.kind = Item::Kind::kGroup;
        it.group = std::make_shared<Alternatives>();
        it.group->seqs.push_back({std::move(inner)});
      }
      it.min = lo, it.max = hi;
    }
  }

  std::string_view src_;
  size_t i_ = 0;
};

// Each rule's alternatives and where its definition starts.
using Rules = std::map<std::string, std::pair<Alternatives, size_t>>;

}  // namespace md::gbnf
