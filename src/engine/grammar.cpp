// Context-free grammars as pushdown automata (engine/grammar.h).
#include "megadecode/engine/grammar.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <string>

#include "gbnf_parse.h"
#include "megadecode/base/error.h"
#include "nfa_builder.h"

namespace md {
namespace {

using detail::complement;
using detail::normalized;
using gbnf::Alternatives;
using gbnf::Item;
using Node = RegexDfa::Node;
using Builder = detail::NfaBuilder<Node>;
using Frag = Builder::Frag;

// One rule's body as a node graph (Thompson's construction, as engine/json_regex.cpp builds a
// pattern's), a rule name becoming a call node.
class Body {
 public:
  Body(const gbnf::Parser& p, const std::map<std::string, int>& index)
      : p_(p), index_(index), b(nodes, RegexDfa::kMaxNodes, [this] {
          p_.fail(fmt::format("a rule with more than {} states once its repetitions are expanded",
                              RegexDfa::kMaxNodes));
        }) {}

  std::vector<Node> nodes;

  Frag alternatives(const Alternatives& a) {
    Frag all{-1, {}};
    for (const auto& seq : a.seqs) {
      Frag f = b.nothing();
      for (const Item& it : seq)
        f = b.concat(f, it.min == 1 && it.max == 1 ? atom(it) : b.repeat(it.min, it.max, [&] {
          return atom(it);
        }));
      all = all.start < 0 ? f : b.either(all, f);
    }
    return all;
  }
  // The rule's node graph, its start and its match.
  void finish(const Frag& f, int& start, int& match) {
    match = b.add({});
    b.patch(f.holes, match);
    start = f.start;
  }

 private:
  Frag atom(const Item& it) {
    switch (it.kind) {
      case Item::Kind::kLiteral: {
        Frag f = b.nothing();
        for (uint32_t c : it.text) f = b.concat(f, b.chars({{c, c}}));
        return f;
      }
      case Item::Kind::kClass:
        return b.chars(it.negated ? complement(it.ranges) : it.ranges);
      case Item::Kind::kAny:
        return b.chars({{0, detail::kMaxCodePoint}});
      case Item::Kind::kRef: {
        const auto r = index_.find(it.name);
        if (r == index_.end()) p_.fail(fmt::format("the rule '{}' is not defined", it.name), it.at);
        Node n;
        n.call = r->second;
        return b.one(std::move(n));
      }
      case Item::Kind::kGroup:
        return alternatives(*it.group);
    }
    return b.nothing();
  }

  const gbnf::Parser& p_;
  const std::map<std::string, int>& index_;

 public:
  Builder b;  // (declared after `nodes`, which it builds)
};

// Visits the states of d reachable from its start by bytes (when `bytes`) and by the call edges
// that `follow(call)` admits; stops early when visit(state) returns true, and returns that.
template <class Follow, class Visit>
bool search(const RegexDfa& d, bool bytes, Follow&& follow, Visit&& visit) {
  std::vector<uint8_t> seen(static_cast<size_t>(d.states()), 0);
  std::vector<int32_t> todo{d.start()};
  seen[0] = 1;
  auto push = [&](int32_t t) {
    if (t != RegexDfa::kDead && !seen[size_t(t)]) {
      seen[size_t(t)] = 1;
      todo.push_back(t);
    }
  };
  while (!todo.empty()) {
    const int32_t s = todo.back();
    todo.pop_back();
    if (visit(s)) return true;
    for (const RegexDfa::Call& c : d.calls(s))
      if (follow(c)) push(c.to);
    if (bytes)
      for (int b = 0; b < 256; ++b) push(d.step(s, uint8_t(b)));
  }
  return false;
}

// Whether d reaches acceptance from its start by bytes (when `bytes`) and calls of rules in `ok`.
bool reaches_accept(const RegexDfa& d, const std::vector<uint8_t>& ok, bool bytes) {
  return search(
      d, bytes, [&](const RegexDfa::Call& c) { return ok[size_t(c.rule)] != 0; },
      [&](int32_t s) { return d.accepts(s); });
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
  // One construction budget and one state bound for all the rules together: a request's grammar
  // of many large rules is refused like one large pattern, not built for minutes into gigabytes.
  int64_t budget = RegexDfa::kMaxWork;
  int64_t states = 0;
  for (const auto& [name, def] : rules) {
    Body body(p, index);
    int start = 0, match = 0;
    body.finish(body.alternatives(def.first), start, match);
    try {
      g->rules_.push_back(RegexDfa::build(body.nodes, start, match, &budget));
    } catch (const Error& e) {
      p.fail(fmt::format("the rule '{}': {}", name, e.what()), def.second);
    }
    states += g->rules_.back()->states();
    if (states > kMaxStates)
      p.fail(fmt::format("the grammar's rules need more than {} automaton states together (too "
                         "large for constrained decoding)",
                         kMaxStates),
             def.second);
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
    search(
        d, false, [&](const RegexDfa::Call& c) { return nullable[size_t(c.rule)] != 0; },
        [&](int32_t s) {
          for (const RegexDfa::Call& c : d.calls(s)) left[size_t(r)].push_back(c.rule);
          return false;
        });
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
