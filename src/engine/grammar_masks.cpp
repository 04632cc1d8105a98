// Grammar masks (grammar_masks.h).
#include "grammar_masks.h"

#include <algorithm>
#include <iterator>
#include <string_view>

namespace md::detail {

namespace {
// Ids in the order of their bytes (ties by id).
struct ByBytes {
  const TokenBytes& v;
  std::string_view bytes(int32_t id) const {
    return {v.bytes + v.offset[id], v.offset[id + 1] - v.offset[id]};
  }
  bool operator()(int32_t a, int32_t b) const {
    const auto x = bytes(a), y = bytes(b);
    return x != y ? x < y : a < b;
  }
};
}  // namespace

const GrammarMasks::Split& GrammarMasks::split(const Grammar& g, Grammar::Frame top,
                                               const TokenBytes& v) {
  const auto key = std::make_pair(top.rule, top.state);
  if (const auto it = cache_.find(key); it != cache_.end()) return it->second;
  if (cache_.size() >= kMaxSplits) cache_.clear();
  Split& out = cache_[key];
  out.whole.assign((size_t(v.size) + 63) / 64, 0);
  const RegexDfa& d = g.rule(top.rule);
  for (int64_t id = 0; id < v.size; ++id) {
    if (v.special[id] != 0) continue;
    const uint32_t from = v.offset[id], to = v.offset[id + 1];
    int32_t s = top.state;
    bool may_leave = false;  // a state inside the token where a call or a return could start
    uint32_t i = from;
    for (; i < to; ++i) {
      const int32_t t = d.step(s, uint8_t(v.bytes[i]));
      if (t == RegexDfa::kDead) break;
      s = t;
      if (i + 1 < to && (d.accepts(s) || !d.calls(s).empty())) may_leave = true;
    }
    if (i == to)
      out.whole[size_t(id) >> 6] |= uint64_t{1} << (id & 63);
    else if (may_leave)
      out.uncertain.push_back(int32_t(id));
  }
  std::sort(out.uncertain.begin(), out.uncertain.end(), ByBytes{v});
  return out;
}

int64_t GrammarMasks::add(const Grammar& g, const Grammar::Stacks& stacks, const TokenBytes& v,
                          std::span<uint8_t> mask, bool bytes_follow,
                          const std::function<bool(int32_t)>& fallback) {
  int64_t count = 0;
  std::vector<int32_t> unsure, merged;
  for (const Grammar::Stack& st : stacks.stacks) {
    const Split& s = split(g, st.back(), v);
    for (size_t w = 0; w < s.whole.size(); ++w)
      for (uint64_t b = s.whole[w]; b; b &= b - 1) {
        const size_t id = w * 64 + size_t(__builtin_ctzll(b));
        count += !mask[id];
        mask[id] = 1;
      }
    merged.clear();
    std::merge(unsure.begin(), unsure.end(), s.uncertain.begin(), s.uncertain.end(),
               std::back_inserter(merged), ByBytes{v});
    unsure.swap(merged);
  }
  // The uncertain ids in byte order, run through the automaton as a walk of the trie they form:
  // a prefix shared with the previous id is not stepped again, and once a byte is refused every
  // id that shares the prefix through that byte is refused with it (most leave their rule and
  // die a byte or two later, so this steps far fewer bytes than there are ids).
  auto bytes_of = [&](int32_t id) { return ByBytes{v}.bytes(id); };
  unsure.erase(std::unique(unsure.begin(), unsure.end()), unsure.end());
  std::vector<Grammar::Stacks> path{stacks};  // path[k]: the state after k bytes of `prev`
  std::string_view prev;
  size_t dead_at = std::string_view::npos;  // the byte of `prev` that was refused
  for (int32_t id : unsure) {
    const std::string_view b = bytes_of(id);
    size_t lcp = 0;
    while (lcp < b.size() && lcp < prev.size() && b[lcp] == prev[lcp]) ++lcp;
    prev = b;
    if (mask[size_t(id)]) {
      dead_at = std::string_view::npos;
      path.resize(std::min(lcp, path.size() - 1) + 1);
      continue;
    }
    bool ok;
    if (dead_at != std::string_view::npos && lcp > dead_at) {  // refused at the same byte
      ok = path[dead_at].done && bytes_follow && fallback(id);
    } else {
      path.resize(std::min(lcp, path.size() - 1) + 1);
      dead_at = std::string_view::npos;
      size_t k = path.size() - 1;
      for (; k < b.size(); ++k) {
        Grammar::Stacks next = g.step(path[k], uint8_t(b[k]));
        if (next.empty()) break;
        path.push_back(std::move(next));
      }
      if (k == b.size()) {
        ok = true;
      } else {
        dead_at = k;
        ok = path[k].done && bytes_follow && fallback(id);
      }
    }
    if (ok) count += mask[size_t(id)] = 1;
  }
  // A finished answer: tokens that start what follows it (none when a stop token follows).
  if (stacks.done && bytes_follow)
    for (int64_t id = 0; id < v.size; ++id)
      if (v.special[id] == 0 && !mask[size_t(id)] && fallback(int32_t(id)))
        count += mask[size_t(id)] = 1;
  return count;
}

}  // namespace md::detail
