// Constrained decoding (engine/token_constraint.h): a program of elements matched over the
// output's symbols, and the per-step mask of the ids whose symbols the current state accepts.
//
// The mask walks the vocabulary grouped by first byte: a state that refuses a byte rules out
// every ordinary token starting with it after one step, and the two common states where every
// byte of a token is accepted without changing how the next token is judged (free text with no
// pattern under way, and the inside of a JSON string for a token free of '"', '\' and control
// bytes) allow their tokens without walking them. Everything else is simulated byte by byte on a
// copy of the state, which is a few dozen bytes of plain data.
#include "megadecode/engine/token_constraint.h"

#include "grammar_masks.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "megadecode/base/error.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace md {

void append_text_symbols(std::vector<ConstraintSymbol>& out, std::string_view text) {
  for (char c : text) out.push_back(byte_symbol(static_cast<uint8_t>(c)));
}

namespace {

using Kind = ConstraintElement::Kind;
constexpr size_t kMaxPatterns = 4;  // forbidden patterns of one kFree element

bool is_byte(ConstraintSymbol s) {
  return s >= kByteSymbol;
}
bool is_space(uint8_t b) {
  return b == ' ' || b == '\t' || b == '\n' || b == '\r';
}
bool is_digit(uint8_t b) {
  return b >= '0' && b <= '9';
}
bool is_hex(uint8_t b) {
  return is_digit(b) || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F');
}

// A pattern's progress after `sym`, given `done` symbols of it matched so far: the length of the
// longest prefix of the pattern that ends the stream (the patterns are a few symbols long).
uint32_t pattern_step(const std::vector<ConstraintSymbol>& p, uint32_t done, ConstraintSymbol sym) {
  if (done < p.size() && p[done] == sym) return done + 1;
  for (uint32_t k = std::min<uint32_t>(done, uint32_t(p.size()) - 1); k > 0; --k) {
    // Is p[0..k) == (the last k - 1 matched symbols) + sym?
    if (p[k - 1] != sym) continue;
    bool ok = true;
    for (uint32_t i = 0; i + 1 < k && ok; ++i) ok = p[i] == p[done - (k - 1) + i];
    if (ok) return k;
  }
  return 0;
}

// ---- JSON: one object, byte by byte ------------------------------------------------------------

enum class J : uint8_t {
  kStart,     // before the top-level '{' (any value: its first byte)
  kObjFirst,  // after '{': a key or '}'
  kObjKey,    // after ',' in an object: a key
  kColon,     // after a key
  kValue,     // a value must start
  kArrFirst,  // after '[': a value or ']'
  kAfter,     // after a value: ',' or the container's closing bracket
  kStr,
  kStrEsc,
  kStrU,
  kNumSign,  // after '-'
  kNumZero,  // a leading 0
  kNumInt,
  kNumDot,
  kNumFrac,
  kNumE,
  kNumESign,
  kNumExp,
  kLit,  // inside true / false / null
  kDone,
};

constexpr std::array<std::string_view, 3> kLiterals = {"true", "false", "null"};

struct JsonState {
  J mode = J::kStart;
  bool any_root = false;  // the answer is any JSON value, not only an object
  bool key = false;     // the string being read is an object key
  uint8_t depth = 0;    // open containers
  uint8_t u_left = 0;   // hex digits left of a \u escape
  uint8_t lit = 0, lit_pos = 0;
  uint8_t space = 0;    // whitespace bytes in a row
  // Strings hold valid UTF-8 and valid \u escapes (what a JSON parser accepts): the continuation
  // bytes a character still needs and the range of the next one; the first hex digit of a \u;
  // whether a high surrogate was read (its \u is under way, or its low half must follow).
  uint8_t utf_left = 0, utf_lo = 0x80, utf_hi = 0xBF;
  uint8_t u_first = 0;
  bool high = false, low_needed = false;
  uint64_t objects = 0;  // bit d: container d (0 = outermost) is an object

  // Inside a string with no character, escape or surrogate pair half done.
  bool clean_string() const { return mode == J::kStr && utf_left == 0 && !low_needed; }
  // Where a value that just ended goes: the container's ',' or bracket, or (a top-level scalar
  // of any_root) the end.
  J after_value() const { return depth == 0 ? J::kDone : J::kAfter; }
  // A top-level number (any_root) that could end here: it ends at the first symbol that does not
  // go on with it, which belongs to what follows.
  bool root_number_whole() const {
    return depth == 0 &&
           (mode == J::kNumZero || mode == J::kNumInt || mode == J::kNumFrac || mode == J::kNumExp);
  }
  bool continues_number(uint8_t b) const {
    return is_digit(b) && mode != J::kNumZero ? true
           : b == '.'                         ? mode == J::kNumZero || mode == J::kNumInt
           : b == 'e' || b == 'E'             ? mode != J::kNumExp
                                              : false;
  }

  bool top_is_object() const { return (objects >> (depth - 1)) & 1u; }
  bool push(bool object) {
    if (depth >= kMaxJsonDepth) return false;
    if (object)
      objects |= uint64_t(1) << depth;
    else
      objects &= ~(uint64_t(1) << depth);
    ++depth;
    mode = object ? J::kObjFirst : J::kArrFirst;
    return true;
  }
  void pop() {
    --depth;
    mode = depth == 0 ? J::kDone : J::kAfter;
  }
  bool value(uint8_t b) {
    switch (b) {
      case '{':
        return push(true);
      case '[':
        return push(false);
      case '"':
        mode = J::kStr;
        key = false;
        return true;
      case '-':
        mode = J::kNumSign;
        return true;
      case '0':
        mode = J::kNumZero;
        return true;
      case 't':
      case 'f':
      case 'n':
        mode = J::kLit;
        lit = b == 't' ? 0 : b == 'f' ? 1 : 2;
        lit_pos = 1;
        return true;
      default:
        if (b >= '1' && b <= '9') {
          mode = J::kNumInt;
          return true;
        }
        return false;
    }
  }
  bool string_byte(uint8_t b) {
    if (utf_left > 0) {
      if (b < utf_lo || b > utf_hi) return false;
      --utf_left;
      utf_lo = 0x80;
      utf_hi = 0xBF;
      return true;
    }
    if (low_needed && b != '\\') return false;  // a high surrogate's \u must follow at once
    if (b < 0x20) return false;
    if (b == '"') mode = key ? J::kColon : after_value();
    if (b == '\\') mode = J::kStrEsc;
    if (b < 0x80) return true;
    // A UTF-8 lead byte (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF).
    if (b >= 0xC2 && b <= 0xDF) {
      utf_left = 1;
    } else if (b >= 0xE0 && b <= 0xEF) {
      utf_left = 2;
      if (b == 0xE0) utf_lo = 0xA0;
      if (b == 0xED) utf_hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      utf_left = 3;
      if (b == 0xF0) utf_lo = 0x90;
      if (b == 0xF4) utf_hi = 0x8F;
    } else {
      return false;
    }
    return true;
  }
  // A hex digit of \uXXXX. Surrogates come in pairs: D800-DBFF then \u DC00-DFFF; a lone half
  // is refused at its second digit, where it shows.
  bool escape_digit(uint8_t b) {
    if (!is_hex(b)) return false;
    const uint8_t v = is_digit(b) ? b - '0' : (b | 0x20) - 'a' + 10;
    const int pos = 4 - u_left;
    if (pos == 0) {
      if (low_needed && v != 0xD) return false;
      u_first = v;
    } else if (pos == 1 && u_first == 0xD) {
      if (low_needed != (v >= 0xC)) return false;
      low_needed = false;
      high = v >= 0x8 && v < 0xC;
    }
    if (--u_left == 0) {
      mode = J::kStr;
      low_needed = high;
      high = false;
    }
    return true;
  }
  bool step(uint8_t b) {
    for (;;) {
      const bool ws_ok = mode == J::kStart || mode == J::kObjFirst || mode == J::kObjKey ||
                         mode == J::kColon || mode == J::kValue || mode == J::kArrFirst ||
                         mode == J::kAfter;
      if (ws_ok && is_space(b)) return ++space <= kMaxJsonSpace;
      if (ws_ok) space = 0;
      switch (mode) {
        case J::kStart:
          return any_root ? value(b) : b == '{' && push(true);
        case J::kObjFirst:
          if (b == '}') {
            pop();
            return true;
          }
          [[fallthrough]];
        case J::kObjKey:
          if (b != '"') return false;
          mode = J::kStr;
          key = true;
          return true;
        case J::kColon:
          if (b != ':') return false;
          mode = J::kValue;
          return true;
        case J::kArrFirst:
          if (b == ']') {
            pop();
            return true;
          }
          return value(b);
        case J::kValue:
          return value(b);
        case J::kAfter:
          if (b == ',') {
            mode = top_is_object() ? J::kObjKey : J::kValue;
            return true;
          }
          if (b == (top_is_object() ? '}' : ']')) {
            pop();
            return true;
          }
          return false;
        case J::kStr:
          return string_byte(b);
        case J::kStrEsc:
          if (b == 'u') {
            mode = J::kStrU;
            u_left = 4;
            return true;
          }
          if (low_needed || (b != '"' && b != '\\' && b != '/' && b != 'b' && b != 'f' &&
                             b != 'n' && b != 'r' && b != 't'))
            return false;
          mode = J::kStr;
          return true;
        case J::kStrU:
          return escape_digit(b);
        case J::kNumSign:
          if (b == '0') mode = J::kNumZero;
          else if (is_digit(b)) mode = J::kNumInt;
          else return false;
          return true;
        case J::kNumInt:
          if (is_digit(b)) return true;
          [[fallthrough]];
        case J::kNumZero:
          if (b == '.') {
            mode = J::kNumDot;
            return true;
          }
          [[fallthrough]];
        case J::kNumFrac:
          if (mode == J::kNumFrac && is_digit(b)) return true;
          if (b == 'e' || b == 'E') {
            mode = J::kNumE;
            return true;
          }
          mode = J::kAfter;  // the number ended: b is judged after it
          continue;
        case J::kNumDot:
          if (!is_digit(b)) return false;
          mode = J::kNumFrac;
          return true;
        case J::kNumE:
          if (b == '+' || b == '-') {
            mode = J::kNumESign;
            return true;
          }
          [[fallthrough]];
        case J::kNumESign:
          if (!is_digit(b)) return false;
          mode = J::kNumExp;
          return true;
        case J::kNumExp:
          if (is_digit(b)) return true;
          mode = J::kAfter;
          continue;
        case J::kLit: {
          const std::string_view l = kLiterals[lit];
          if (b != uint8_t(l[lit_pos])) return false;
          if (++lit_pos == l.size()) mode = after_value();
          return true;
        }
        case J::kDone:
          return false;
      }
      return false;
    }
  }
};

}  // namespace

// ---- the program ---------------------------------------------------------------------------------

ConstraintProgram::ConstraintProgram(std::vector<ConstraintElement> elements)
    : elements_(std::move(elements)) {
  const int n = int(elements_.size());
  for (int i = 0; i < n; ++i) {
    const ConstraintElement& e = elements_[size_t(i)];
    auto fail = [&](std::string_view why) {
      throw Error(fmt::format("constraint program: element {}: {}", i, why));
    };
    switch (e.kind) {
      case Kind::kSpecial:
        if (e.special < 0) fail("a special element needs a token id");
        break;
      case Kind::kText:
        if (e.text.empty()) fail("a text element needs text");
        break;
      case Kind::kName:
        if (e.names.empty()) fail("a name element needs names");
        if (!std::is_sorted(e.names.begin(), e.names.end()) ||
            std::adjacent_find(e.names.begin(), e.names.end()) != e.names.end())
          fail("names must be sorted and unique");
        for (const std::string& s : e.names)
          if (s.empty()) fail("a name is empty");
        break;
      case Kind::kFree:
        if (!e.trigger.empty() && (is_byte(e.trigger.front()) || is_byte(e.trigger.back())))
          fail("a trigger must start and end with a special token");
        if (e.forbidden.size() > kMaxPatterns) fail("too many forbidden patterns");
        for (const auto& p : e.forbidden)
          if (p.empty() || is_byte(p.front())) fail("a forbidden pattern must start with a special");
        break;
      case Kind::kBranch:
        if (e.branches.empty()) fail("a branch needs branches");
        for (const auto& [id, to] : e.branches)
          if (id < 0 || to < 0 || to > n) fail("a branch needs a special id and a target");
        break;
      case Kind::kDigits:
        if (e.max_digits < 1) fail("a digits element needs room for a digit");
        break;
      case Kind::kJson: {
        if (e.schema_by_name.empty()) break;
        if (e.schema) fail("a json element takes a schema or schemas by name, not both");
        int name = i - 1;
        while (name >= 0 && elements_[size_t(name)].kind != Kind::kName) --name;
        if (name < 0 || elements_[size_t(name)].names.size() != e.schema_by_name.size())
          fail("schemas by name need a name element before them with as many names");
        break;
      }
      case Kind::kRegex:
        if (!e.regex) fail("a regex element needs its automaton");
        break;
      case Kind::kGrammar:
        if (!e.grammar) fail("a grammar element needs its grammar");
        break;
      case Kind::kStop:
        break;
    }
  }
}

ConstraintVocab::ConstraintVocab(const Tokenizer& tok, int64_t vocab_size)
    : size_(vocab_size), by_first_byte_(256) {
  MD_CHECK(vocab_size > 0, "constraint vocabulary: size {}", vocab_size);
  special_.assign(size_t(vocab_size), 2);
  plain_string_.assign(size_t(vocab_size), 0);
  offset_.assign(size_t(vocab_size) + 1, 0);
  const int64_t known = std::min<int64_t>(vocab_size, tok.vocab_size());
  for (int64_t id = 0; id < vocab_size; ++id) {
    offset_[size_t(id)] = uint32_t(bytes_.size());
    if (id >= known) continue;
    if (tok.is_special(int32_t(id))) {
      special_[size_t(id)] = 1;
      specials_.push_back(int32_t(id));
      continue;
    }
    const std::string_view b = tok.token_bytes(int32_t(id));
    if (b.empty()) continue;
    special_[size_t(id)] = 0;
    bytes_.append(b);
    // Plain inside a string: from a clean string state, back in one, no quote on the way.
    JsonState js;
    js.mode = J::kStr;
    bool plain = b.find('"') == std::string_view::npos;
    for (size_t i = 0; i < b.size() && plain; ++i) plain = js.step(static_cast<uint8_t>(b[i]));
    plain_string_[size_t(id)] = plain && js.clean_string();
    by_first_byte_[static_cast<uint8_t>(b[0])].push_back(int32_t(id));
  }
  offset_[size_t(vocab_size)] = uint32_t(bytes_.size());
}

// ---- the state -----------------------------------------------------------------------------------

struct TokenConstraint::State {
  int pc = 0;
  bool broken = false;
  uint32_t off = 0;         // kText: bytes matched; kDigits: digits; kName: bytes matched
  uint32_t lo = 0, hi = 0;  // kName: the names consistent with the bytes so far
  uint32_t trigger = 0;     // kFree: progress in the trigger
  std::array<uint32_t, kMaxPatterns> forbid{};  // kFree: progress in each forbidden pattern
  JsonState json;
  JsonSchemaCursor schema;  // kJson with a schema
  int32_t dfa = 0;          // kRegex: the automaton's state
  std::shared_ptr<const Grammar::Stacks> stacks;  // kGrammar: the pushdown automaton's state
  int32_t name = -1;        // the name the last kName element matched (kept across elements)
};

namespace {

using Elements = std::vector<ConstraintElement>;

template <typename S>
void enter(const Elements& el, S& s, int pc) {
  s.pc = pc;
  s.off = 0;
  s.trigger = 0;
  s.forbid.fill(0);
  s.json = JsonState{};
  s.schema = JsonSchemaCursor{};
  if (pc < int(el.size())) {
    const ConstraintElement& e = el[size_t(pc)];
    s.lo = 0;
    s.hi = uint32_t(e.names.size());
    if (e.kind == Kind::kRegex) s.dfa = e.regex->start();
    s.json.any_root = e.kind == Kind::kJson && e.any_value;
    if (e.kind == Kind::kGrammar)
      s.stacks = std::make_shared<const Grammar::Stacks>(e.grammar->start());
    if (e.kind == Kind::kStop && e.stop_ids.empty()) s.pc = int(el.size());
  }
}

bool is_number_mode(J m) {
  return m >= J::kNumSign && m <= J::kNumExp;
}

// The schema's verdict on byte b of the JSON text, given the recognizer's state before it (which
// judges the syntax itself): the events b makes (a value, key or container beginning or ending),
// passed to the cursor.
bool schema_step(const JsonSchema& sc, JsonSchemaCursor& c, const JsonState& js, uint8_t b) {
  J mode = js.mode;
  if (is_number_mode(mode)) {
    // Does b go on with the number? (In the modes that need a digit or sign, it must.)
    const bool more = mode == J::kNumSign || mode == J::kNumDot || mode == J::kNumE ||
                      mode == J::kNumESign || is_digit(b) ||
                      ((b == '.') && (mode == J::kNumInt || mode == J::kNumZero)) ||
                      ((b == 'e' || b == 'E') && mode != J::kNumExp);
    if (more) return c.scalar_byte(sc, b);
    if (!c.scalar_end(sc)) return false;
    mode = J::kAfter;  // b is judged after the number, as the recognizer does
  }
  const bool ws_ok = mode == J::kStart || mode == J::kObjFirst || mode == J::kObjKey ||
                     mode == J::kColon || mode == J::kValue || mode == J::kArrFirst ||
                     mode == J::kAfter;
  if (ws_ok && is_space(b)) return true;
  switch (mode) {
    case J::kStart:
    case J::kValue:
      return c.value_begin(sc, b);
    case J::kObjFirst:
    case J::kObjKey:
      if (b == '}') return c.close_object(sc);
      return b != '"' || c.key_begin(sc);
    case J::kArrFirst:
      if (b == ']') return c.close_array(sc);
      return c.value_begin(sc, b);
    case J::kAfter:
      if (b == ',') return js.top_is_object() ? c.member_comma(sc) : c.element_comma(sc);
      if (b == '}') return c.close_object(sc);
      if (b == ']') return c.close_array(sc);
      return true;
    case J::kStr:
    case J::kStrEsc:
    case J::kStrU: {
      if (js.key) return mode == J::kStr && b == '"' ? c.key_end(sc) : c.key_byte(sc, b);
      // A character starts at an ASCII or UTF-8 lead byte, or at an escape's backslash.
      const bool plain = mode == J::kStr && js.utf_left == 0;
      return c.string_byte(sc, b, plain && (b < 0x80 || b >= 0xC0), plain && b == '"');
    }
    case J::kLit:
      return c.scalar_byte(sc, b);
    default:
      return true;
  }
}

// The schema a kJson element holds the object to in state s (null: none).
template <typename S>
const JsonSchema* schema_of(const ConstraintElement& e, const S& s) {
  if (e.schema_by_name.empty()) return e.schema.get();
  return s.name >= 0 && size_t(s.name) < e.schema_by_name.size()
             ? e.schema_by_name[size_t(s.name)].get()
             : nullptr;
}

// One symbol; false when the state refuses it (s is then garbage).
template <typename S>
bool step(const Elements& el, S& s, ConstraintSymbol sym) {
  const int n = int(el.size());
  for (;;) {
    if (s.pc >= n) return true;
    const ConstraintElement& e = el[size_t(s.pc)];
    const bool byte = is_byte(sym);
    const uint8_t b = byte ? uint8_t(sym - kByteSymbol) : 0;
    switch (e.kind) {
      case Kind::kSpecial:
        if (sym != special_symbol(e.special)) return false;
        enter(el, s, s.pc + 1);
        return true;
      case Kind::kText:
        if (!byte || b != uint8_t(e.text[s.off])) return false;
        if (++s.off == e.text.size()) enter(el, s, s.pc + 1);
        return true;
      case Kind::kName: {
        if (byte) {
          // The names with b at position off, within [lo, hi): a subrange, as the names are sorted.
          uint32_t lo = s.lo, hi = s.hi;
          while (lo < hi && (e.names[lo].size() <= s.off || uint8_t(e.names[lo][s.off]) < b)) ++lo;
          uint32_t h = lo;
          while (h < hi && e.names[h].size() > s.off && uint8_t(e.names[h][s.off]) == b) ++h;
          if (h > lo) {
            s.lo = lo;
            s.hi = h;
            ++s.off;
            return true;
          }
        }
        // Nothing continues: the element is done if a whole name was read (the shortest
        // consistent name sorts first).
        if (s.off == 0 || e.names[s.lo].size() != s.off) return false;
        s.name = int32_t(s.lo);
        enter(el, s, s.pc + 1);
        continue;
      }
      case Kind::kDigits:
        if (byte && is_digit(b) && s.off < uint32_t(e.max_digits)) {
          ++s.off;
          return true;
        }
        if (s.off == 0) return false;
        enter(el, s, s.pc + 1);
        continue;
      case Kind::kJson: {
        if (s.json.depth == 0 && s.json.root_number_whole() &&
            (!byte || !s.json.continues_number(b))) [[unlikely]] {
          // A top-level number ends at the symbol after it, which goes to the next element.
          const JsonSchema* schema = schema_of(e, s);
          if (schema && !s.schema.scalar_end(*schema)) return false;
          enter(el, s, s.pc + 1);
          continue;
        }
        if (!byte) return false;
        const J before = s.json.mode;
        const JsonSchema* schema = schema_of(e, s);
        if (schema && !schema_step(*schema, s.schema, s.json, b)) return false;
        if (!s.json.step(b)) return false;
        // A string or literal value ends with its last byte (a number at the byte after it).
        if (schema && (s.json.mode == J::kAfter || s.json.mode == J::kDone) &&
            (before == J::kStr || before == J::kLit) && !s.schema.scalar_end(*schema))
          return false;
        if (s.json.mode == J::kDone) enter(el, s, s.pc + 1);
        return true;
      }
      case Kind::kRegex: {
        if (byte) {
          const int32_t t = e.regex->step(s.dfa, b);
          if (t != RegexDfa::kDead) {
            s.dfa = t;
            return true;
          }
        }
        // Nothing continues a match: the element is done if the text so far is one.
        if (!e.regex->accepts(s.dfa)) return false;
        enter(el, s, s.pc + 1);
        continue;
      }
      case Kind::kGrammar: {
        if (byte) {
          Grammar::Stacks t = e.grammar->step(*s.stacks, b);
          if (!t.empty()) {
            s.stacks = std::make_shared<const Grammar::Stacks>(std::move(t));
            return true;
          }
        }
        if (!s.stacks->done) return false;  // as kRegex: the longest answer the symbols allow
        enter(el, s, s.pc + 1);
        continue;
      }
      case Kind::kFree:
        for (size_t k = 0; k < e.forbidden.size(); ++k) {
          s.forbid[k] = pattern_step(e.forbidden[k], s.forbid[k], sym);
          if (s.forbid[k] == e.forbidden[k].size()) return false;
        }
        if (!e.trigger.empty()) {
          s.trigger = pattern_step(e.trigger, s.trigger, sym);
          if (s.trigger == e.trigger.size()) enter(el, s, s.pc + 1);
        }
        return true;
      case Kind::kBranch:
        for (const auto& [id, to] : e.branches)
          if (sym == special_symbol(id)) {
            enter(el, s, to);
            return true;
          }
        return false;
      case Kind::kStop:  // reached by a symbol that ended the element before: a stop id ends all
        if (byte ||
            std::find(e.stop_ids.begin(), e.stop_ids.end(), int32_t(sym)) == e.stop_ids.end())
          return false;
        s.pc = n;
        return true;
    }
    return false;
  }
}

}  // namespace

TokenConstraint::TokenConstraint(std::shared_ptr<const ConstraintProgram> program,
                                 std::shared_ptr<const ConstraintVocab> vocab)
    : program_(std::move(program)), vocab_(std::move(vocab)), state_(std::make_unique<State>()) {
  MD_CHECK(program_ && vocab_, "token constraint: a program and a vocabulary are needed");
  enter(program_->elements(), *state_, 0);
}
TokenConstraint::~TokenConstraint() = default;
TokenConstraint::TokenConstraint(TokenConstraint&&) noexcept = default;
TokenConstraint& TokenConstraint::operator=(TokenConstraint&&) noexcept = default;

bool TokenConstraint::finished() const {
  return state_->pc >= int(program_->elements().size());
}
bool TokenConstraint::broken() const {
  return state_->broken;
}

bool TokenConstraint::allows(int32_t id) const {
  const ConstraintVocab& v = *vocab_;
  if (id < 0 || id >= v.size_ || v.special_[size_t(id)] == 2) return false;
  if (state_->broken || finished()) return true;
  const Elements& el = program_->elements();
  const ConstraintElement& e = el[size_t(state_->pc)];
  if (e.kind == Kind::kStop)
    return std::find(e.stop_ids.begin(), e.stop_ids.end(), id) != e.stop_ids.end();
  State s = *state_;
  if (v.special_[size_t(id)] == 1) return step(el, s, special_symbol(id));
  for (uint32_t i = v.offset_[size_t(id)]; i < v.offset_[size_t(id) + 1]; ++i)
    if (!step(el, s, byte_symbol(uint8_t(v.bytes_[i])))) return false;
  return true;
}

namespace {
int64_t ones(std::span<const uint8_t> mask) {
  // Blocks of 255: a byte accumulator per lane cannot overflow, so the loop vectorizes bytewise.
  int64_t n = 0;
  for (size_t i = 0; i < mask.size(); i += 255) {
    uint8_t block = 0;
    const size_t end = std::min(mask.size(), i + 255);
    for (size_t k = i; k < end; ++k) block = uint8_t(block + mask[k]);
    n += block;
  }
  return n;
}
}  // namespace

int64_t TokenConstraint::allowed(std::span<uint8_t> mask) const {
  const ConstraintVocab& v = *vocab_;
  MD_CHECK(int64_t(mask.size()) == v.size_, "token constraint: mask of {} for a vocabulary of {}",
           mask.size(), v.size_);
  int64_t count = 0;
  if (state_->broken || finished()) {
    for (size_t id = 0; id < mask.size(); ++id) count += mask[id] = v.special_[id] != 2;
    return count;
  }
  std::fill(mask.begin(), mask.end(), uint8_t(0));
  const Elements& el = program_->elements();
  const ConstraintElement& e = el[size_t(state_->pc)];
  if (e.kind == Kind::kStop) {
    for (int32_t id : e.stop_ids)
      if (id >= 0 && id < v.size_ && v.special_[size_t(id)] != 2 && !mask[size_t(id)])
        count += mask[size_t(id)] = 1;
    return count;
  }
  for (int32_t id : v.specials_) {
    State s = *state_;
    if (step(el, s, special_symbol(id))) mask[size_t(id)] = 1;
  }
  if (e.kind == Kind::kGrammar) {  // (grammar_masks.h)
    if (!grammar_masks_) grammar_masks_ = std::make_unique<detail::GrammarMasks>();
    const detail::TokenBytes tb{v.offset_.data(), v.bytes_.data(), v.special_.data(), v.size_};
    const size_t after = size_t(state_->pc) + 1;
    const bool bytes_follow = after < el.size() && el[after].kind != Kind::kStop &&
                              el[after].kind != Kind::kSpecial && el[after].kind != Kind::kBranch;
    grammar_masks_->add(*e.grammar, *state_->stacks, tb, mask, bytes_follow,
                        [&](int32_t id) { return allows(id); });
    return ones(mask);
  }
  for (int b = 0; b < 256; ++b) {
    const std::vector<int32_t>& ids = v.by_first_byte_[size_t(b)];
    if (ids.empty()) continue;
    State first = *state_;
    if (!step(el, first, byte_symbol(uint8_t(b)))) continue;
    // States in which every later byte of a token passes without changing anything that judges
    // the next token: free text with no pattern under way, and a JSON string's plain bytes.
    const bool free_text = first.pc < int(el.size()) &&
                           el[size_t(first.pc)].kind == Kind::kFree && first.trigger == 0 &&
                           std::all_of(first.forbid.begin(), first.forbid.end(),
                                       [](uint32_t p) { return p == 0; });
    const ConstraintElement& cur = el[size_t(state_->pc)];
    const bool in_string = cur.kind == Kind::kJson && state_->json.clean_string() &&
                           (!schema_of(cur, *state_) || state_->schema.free_string());
    // In a regex, the automaton alone judges the bytes until the match cannot go on.
    const bool in_regex = cur.kind == Kind::kRegex && first.pc == state_->pc;
    if (free_text) {
      // Bytes never start a pattern (they start with a special), so none is under way after.
      for (int32_t id : ids) mask[size_t(id)] = 1;
      continue;
    }
    for (int32_t id : ids) {
      const uint32_t from = v.offset_[size_t(id)] + 1, to = v.offset_[size_t(id) + 1];
      bool ok = true;
      if (in_string && v.plain_string_[size_t(id)]) {
      } else if (in_regex) {
        int32_t d = first.dfa;
        uint32_t i = from;
        for (; i < to; ++i) {
          const int32_t t = cur.regex->step(d, uint8_t(v.bytes_[i]));
          if (t == RegexDfa::kDead) break;
          d = t;
        }
        if (i < to && !cur.regex->accepts(d)) {
          ok = false;
        } else if (i < to) {  // the match ends inside the token: the rest is the next element's
          State s = first;
          s.dfa = d;
          for (; i < to && ok; ++i) ok = step(el, s, byte_symbol(uint8_t(v.bytes_[i])));
        }
      } else {
        State s = first;
        for (uint32_t i = from; i < to && ok; ++i) ok = step(el, s, byte_symbol(uint8_t(v.bytes_[i])));
      }
      if (ok) mask[size_t(id)] = 1;
    }
  }
  // Counted once here: a count kept in the loops above lived in memory (they call step()), a
  // dependency through memory per id that doubled the free-text mask's time.
  return ones(mask);
}

void TokenConstraint::accept(int32_t id) {
  State& s = *state_;
  if (s.broken || finished()) return;
  const Elements& el = program_->elements();
  if (el[size_t(s.pc)].kind == Kind::kStop) {
    s.pc = int(el.size());
    return;
  }
  if (!allows(id)) {
    s.broken = true;
    return;
  }
  const ConstraintVocab& v = *vocab_;
  if (v.special_[size_t(id)] == 1) {
    step(el, s, special_symbol(id));
    return;
  }
  for (uint32_t i = v.offset_[size_t(id)]; i < v.offset_[size_t(id) + 1]; ++i)
    step(el, s, byte_symbol(uint8_t(v.bytes_[i])));
}

}  // namespace md
