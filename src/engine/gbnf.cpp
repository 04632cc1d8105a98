// GBNF grammars written out as regular expressions (engine/gbnf.h).
#include "megadecode/engine/gbnf.h"

#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "gbnf_parse.h"
#include "megadecode/base/error.h"

namespace md {
namespace {

using gbnf::Alternatives;
using gbnf::Item;
using gbnf::Parser;

constexpr size_t kMaxRegexBytes = 1 << 20;

// A code point as the regex syntax writes it, inside a class or not.
void put(std::string& out, uint32_t c) {
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
    out += char(c);
  } else if (c <= 0xFFFF) {
    out += fmt::format("\\u{:04X}", c);
  } else {  // as UTF-8 (the syntax has no escape above U+FFFF)
    out += char(0xF0 | c >> 18);
    out += char(0x80 | (c >> 12 & 0x3F));
    out += char(0x80 | (c >> 6 & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

class Writer {
 public:
  Writer(const Parser& p, const gbnf::Rules& rules) : parser_(p), rules_(rules) {}

  std::string rule(const std::string& name, size_t used_at) {
    const auto it = rules_.find(name);
    if (it == rules_.end())
      parser_.fail(fmt::format("the rule '{}' is not defined", name), used_at);
    if (const auto done = written_.find(name); done != written_.end()) return done->second;
    if (!open_.insert(name).second)
      parser_.fail(fmt::format("the rule '{}' is recursive: only grammars without recursion are "
                               "supported (they are run as a finite automaton)",
                               name),
                   used_at);
    std::string out = alternatives(it->second.first);
    open_.erase(name);
    written_.emplace(name, out);
    return out;
  }

 private:
  std::string alternatives(const Alternatives& a) {
    std::string out;
    for (size_t k = 0; k < a.seqs.size(); ++k) {
      if (k) out += '|';
      for (const Item& it : a.seqs[k]) {
        out += item(it);
        if (out.size() > kMaxRegexBytes)
          parser_.fail(fmt::format("the grammar is too large once its rules are written out (more "
                                   "than {} bytes of pattern)",
                                   kMaxRegexBytes),
                       0);
      }
    }
    return out;
  }
  std::string item(const Item& it) {
    std::string out;
    switch (it.kind) {
      case Item::Kind::kLiteral:
        out += "(?:";
        for (uint32_t c : it.text) put(out, c);
        out += ')';
        break;
      case Item::Kind::kClass:
        out += it.negated ? "[^" : "[";
        for (const auto& [lo, hi] : it.ranges) {
          put(out, lo);
          if (hi != lo) {
            out += '-';
            put(out, hi);
          }
        }
        out += ']';
        break;
      case Item::Kind::kAny:
        out += "[\\s\\S]";
        break;
      case Item::Kind::kRef:
        out += "(?:" + rule(it.name, it.at) + ")";
        break;
      case Item::Kind::kGroup:
        out += "(?:" + alternatives(*it.group) + ")";
        break;
    }
    if (it.min == 0 && it.max == -1)
      out += '*';
    else if (it.min == 1 && it.max == -1)
      out += '+';
    else if (it.min == 0 && it.max == 1)
      out += '?';
    else if (it.max == -1)
      out += fmt::format("{{{},}}", it.min);
    else if (it.min != 1 || it.max != 1)
      out += fmt::format("{{{},{}}}", it.min, it.max);
    return out;
  }

  const Parser& parser_;
  const gbnf::Rules& rules_;
  std::map<std::string, std::string> written_;
  std::set<std::string> open_;
};

}  // namespace

std::string gbnf_to_regex(std::string_view grammar) {
  Parser p(grammar);
  const auto rules = p.rules();
  if (!rules.count("root")) p.fail("there is no 'root' rule", 0);
  Writer w(p, rules);
  std::string out = w.rule("root", 0);
  for (const auto& [name, body] : rules) w.rule(name, body.second);  // undefined references
  return out;
}

std::shared_ptr<const RegexDfa> compile_gbnf(std::string_view grammar) {
  const std::string pattern = gbnf_to_regex(grammar);
  try {
    return RegexDfa::compile(pattern);
  } catch (const Error& e) {
    // Without the written-out pattern the regex parser quotes (it can be long).
    std::string why = e.what();
    const std::string quoted = "pattern '" + pattern + "': ";
    if (why.starts_with(quoted)) why = why.substr(quoted.size());
    throw Error(fmt::format("grammar: {}", why));
  }
}

}  // namespace md
