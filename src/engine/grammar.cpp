// Context-free grammars as pushdown automata (engine/grammar.h).
#include "megadecode/engine/grammar.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <string>

#include "gbnf_parse.h"
#include "megadecode/base/error.h"

namespace md {
namespace {

using gbnf::Alternatives;
using gbnf::Item;
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;
using Node = RegexDfa::Node;
constexpr uint32_t kMaxCp = 0x10FFFF;

Ranges normalized(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1)
      out.back().second = std::max(out.back().second, hi);
    else
      out.emplace_back(lo, hi);
  }
  return out;
}
Ranges complement(const Ranges& r) {
  Ranges out;
  uint32_t at = 0;
  for (const auto& [lo, hi] : normalized(r)) {
    if (lo > at) out.emplace_back(at, lo - 1);
    at = hi + 1;
  }
  if (at <= kMaxCp) out.emplace_back(at, kMaxCp);
  return out;
}

// One rule's body as a node graph (Thompson's construction, as engine/json_regex.cpp builds a
// pattern's), a rule name becoming a call node.
class Body {
 public:
  struct Frag {
    int start;
    std::vector<std::pair<int, int>> holes;  // (node, -1: next; k >= 0: eps[k])
  };
  Body(const gbnf::Parser& p, const std::map<std::string, int>& index) : p_(p), index_(index) {}

  std::vector<Node> nodes;

  int add(Node n) {
    if (nodes.size() >= size_t(RegexDfa::kMaxNodes))
      p_.fail(fmt::format("a rule with more than {} states once its repetitions are expanded",
                          RegexDfa::kMaxNodes));
    nodes.push_back(std::move(n));
    return int(nodes.size()) - 1;
  }
  void patch(const std::vector<std::pair<int, int>>& holes, int target) {
    for (const auto& [n, k] : holes) {
      if (k < 0)
        nodes[size_t(n)].next = target;
      else
        nodes[size_t(n)].eps[size_t(k)] = target;
    }
  }
  Frag alternatives(const Alternatives& a) {
    Frag all{-1, {}};
    for (const auto& seq : a.seqs) {
      Frag f = nothing();
      for (const Item& it : seq) f = concat(f, item(it));
      all = all.start < 0 ? f : either(all, f);
    }
    return all;
  }

 private:
  Frag chars(Ranges r) {
    Node n;
    n.ranges = std::move(r);
    const int i = add(std::move(n));
    return {i, {{i, -1}}};
  }
  Frag call(int rule) {
    Node n;
    n.call = rule;
    const int i = add(std::move(n));
    return {i, {{i, -1}}};
  }
  Frag nothing() {
    Node n;
    n.eps = {-1};
    const int i = add(std::move(n));
    return {i, {{i, 0}}};
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
  Frag optional(Frag a) {
    Node n;
    n.eps = {a.start, -1};
    const int s = add(std::move(n));
    a.holes.emplace_back(s, 1);
    return {s, a.holes};
  }

  Frag atom(const Item& it) {
    switch (it.kind) {
      case Item::Kind::kLiteral: {
        Frag f = nothing();
        for (uint32_t c : it.text) f = concat(f, chars({{c, c}}));
        return f;
      }
      case Item::Kind::kClass:
        return chars(it.negated ? complement(it.ranges) : normalized(it.ranges));
      case Item::Kind::kAny:
        return chars({{0, kMaxCp}});
      case Item::Kind::kRef: {
        const auto r = index_.find(it.name);
        if (r == index_.end()) p_.fail(fmt::format("the rule '{}' is not defined", it.name), it.at);
        return call(r->second);
      }
      case Item::Kind::kGroup:
        return alternatives(*it.group);
    }
    return nothing();
  }
  // The item with its repetition: min copies, then the optional ones nested (one way to read
  // each string, as engine/json_regex.cpp expands counted repetitions) or a star.
  Frag item(const Item& it) {
    if (it.min == 1 && it.max == 1) return atom(it);
    Frag f = nothing();
    for (int k = 0; k < it.min; ++k) f = concat(f, atom(it));
    if (it.max < 0) return concat(f, star(atom(it)));
    if (it.max == it.min) return f;
    std::vector<Frag> copies;
    for (int k = it.min; k < it.max; ++k) copies.push_back(atom(it));
    Frag tail = optional(copies.back());
    for (size_t k = copies.size() - 1; k-- > 0;) tail = optional(concat(copies[k], tail));
    return concat(f, tail);
  }

  const gbnf::Parser& p_;
  const std::map<std::string, int>& index_;
};

// Whether rule r's automaton reaches acceptance from its start, stepping on bytes when `bytes`
// and on calls of the rules in `ok`.
bool reaches_accept(const RegexDfa& d, const std::vector<uint8_t>& ok, bool bytes) {
  std::vector<uint8_t> seen(static_cast<size_t>(d.states()), 0);
  std::vector<int32_t> todo{d.start()};
  seen[0] = 1;
  while (!todo.empty()) {
    const int32_t s = todo.back();
    todo.pop_back();
    if (d.accepts(s)) return true;
    auto visit = [&](int32_t t) {
      if (t != RegexDfa::kDead && !seen[size_t(t)]) {
        seen[size_t(t)] = 1;
        todo.push_back(t);
      }
    };
    for (const RegexDfa::Call& c : d.calls(s))
      if (ok[size_t(c.rule)]) visit(c.to);
    if (bytes)
      for (int b = 0; b < 256; ++b) visit(d.step(s, uint8_t(b)));
  }
  return false;
}

}  // namespace

std::shared_ptr<const Grammar> Grammar::compile_gbnf(std::string_view src) {
  gbnf::Parser p(src);
  const gbnf::Rules rules = p.rules();
  if (!rules.count("root")) p.fail("there is no 'root' rule", 0);
  std::map<std::string, int> index;
  std::vector<std::string> names;
  for (const auto& [name, def] : rules) {
    index.emplace(name, int(names.size()));
    names.push_back(name);
  }
  auto g = std::make_shared<Grammar>();
  g->root_ = index.at("root");
  for (const auto& [name, def] : rules) {
    Body b(p, index);
    const Body::Frag f = b.alternatives(def.first);
    const int match = b.add({});
    b.patch(f.holes, match);
    try {
      g->rules_.push_back(RegexDfa::build(b.nodes, f.start, match));
    } catch (const Error& e) {
      p.fail(fmt::format("the rule '{}': {}", name, e.what()), def.second);
    }
  }
  const int n = int(names.size());
  auto at = [&](int r) { return rules.at(names[size_t(r)]).second; };
  // Productive rules (some finite string) and nullable ones (the empty string), to fixed points.
  std::vector<uint8_t> productive(static_cast<size_t>(n), 0), nullable(static_cast<size_t>(n), 0);
  for (bool grew = true; grew;) {
    grew = false;
    for (int r = 0; r < n; ++r) {
      if (!productive[size_t(r)] && reaches_accept(g->rule(r), productive, true))
        productive[size_t(r)] = 1, grew = true;
      if (!nullable[size_t(r)] && reaches_accept(g->rule(r), nullable, false))
        nullable[size_t(r)] = 1, grew = true;
    }
  }
  for (int r = 0; r < n; ++r)
    if (!productive[size_t(r)])
      p.fail(fmt::format("the rule '{}' derives no finite string (its recursion never ends)",
                         names[size_t(r)]),
             at(r));
  // Left calls: the rules a rule can call before reading a byte (through nullable calls).
  std::vector<std::vector<int>> left(static_cast<size_t>(n));
  std::vector<std::vector<int>> calls(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    const RegexDfa& d = g->rule(r);
    std::vector<uint8_t> seen(static_cast<size_t>(d.states()), 0);
    std::vector<int32_t> todo{d.start()};
    seen[0] = 1;
    while (!todo.empty()) {
      const int32_t s = todo.back();
      todo.pop_back();
      for (const RegexDfa::Call& c : d.calls(s)) {
        left[size_t(r)].push_back(c.rule);
        if (nullable[size_t(c.rule)] && c.to != RegexDfa::kDead && !seen[size_t(c.to)]) {
          seen[size_t(c.to)] = 1;
          todo.push_back(c.to);
        }
      }
    }
    for (int32_t s = 0; s < d.states(); ++s)
      for (const RegexDfa::Call& c : d.calls(s)) calls[size_t(r)].push_back(c.rule);
  }
  // A cycle in a graph of rules (0: unvisited, 1: on the path, 2: done); returns a rule on it.
  auto cycle = [&](const std::vector<std::vector<int>>& edges) {
    std::vector<int> mark(static_cast<size_t>(n), 0);
    std::function<int(int)> dfs = [&](int r) -> int {
      mark[size_t(r)] = 1;
      for (int s : edges[size_t(r)]) {
        if (mark[size_t(s)] == 1) return s;
        if (mark[size_t(s)] == 0)
          if (const int c = dfs(s); c >= 0) return c;
      }
      mark[size_t(r)] = 2;
      return -1;
    };
    for (int r = 0; r < n; ++r)
      if (mark[size_t(r)] == 0)
        if (const int c = dfs(r); c >= 0) return c;
    return -1;
  };
  if (const int r = cycle(left); r >= 0)
    p.fail(fmt::format("the rule '{}' is left-recursive (it can reach itself before reading a "
                       "character); write the repetition with * or + instead",
                       names[size_t(r)]),
           at(r));
  g->recursive_ = cycle(calls) >= 0;
  return g;
}

void Grammar::close(Stack st, Stacks& out, std::vector<Stack>& seen) const {
  if (std::find(seen.begin(), seen.end(), st) != seen.end()) return;
  seen.push_back(st);
  const Frame top = st.back();
  const RegexDfa& d = rule(top.rule);
  if (d.can_continue(top.state)) out.stacks.push_back(st);
  if (int(st.size()) < kMaxDepth)
    for (const RegexDfa::Call& c : d.calls(top.state)) {
      if (c.to == RegexDfa::kDead) continue;
      Stack in = st;
      in.back().state = c.to;  // where the caller goes on once the callee is read
      in.push_back({c.rule, rule(c.rule).start()});
      close(std::move(in), out, seen);
    }
  if (d.accepts(top.state)) {
    st.pop_back();
    if (st.empty())
      out.done = true;
    else
      close(std::move(st), out, seen);
  }
}

namespace {
void finish(Grammar::Stacks& s) {
  std::sort(s.stacks.begin(), s.stacks.end());
  s.stacks.erase(std::unique(s.stacks.begin(), s.stacks.end()), s.stacks.end());
  if (s.stacks.size() > size_t(Grammar::kMaxStacks)) s.stacks.resize(size_t(Grammar::kMaxStacks));
}
}  // namespace

Grammar::Stacks Grammar::start() const {
  Stacks out;
  std::vector<Stack> seen;
  close({{root_, rule(root_).start()}}, out, seen);
  finish(out);
  return out;
}

Grammar::Stacks Grammar::step(const Stacks& from, uint8_t b) const {
  Stacks out;
  std::vector<Stack> seen;
  for (const Stack& st : from.stacks) {
    const int32_t t = rule(st.back().rule).step(st.back().state, b);
    if (t == RegexDfa::kDead) continue;
    Stack next = st;
    next.back().state = t;
    close(std::move(next), out, seen);
  }
  finish(out);
  return out;
}

}  // namespace md
