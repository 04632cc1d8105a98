// The prefix cache (prefix_cache.h): entries are whole sequence states in the pool, matched by
// their tokens, evicted least recently used first.
#include "megadecode/engine/prefix_cache.h"

#include <algorithm>

#include "megadecode/base/error.h"

namespace md {

PrefixCache::PrefixCache(StatePool& pool, int capacity, int64_t min_tokens, Copy copy)
    : pool_(pool),
      copy_(copy ? std::move(copy)
                 : Copy([](SequenceState& d, const SequenceState& s) { d.copy_from(s); })),
      capacity_(capacity),
      min_tokens_(std::max<int64_t>(min_tokens, 1)) {
  MD_CHECK(capacity >= 0, "prefix cache: {} entries", capacity);
}

PrefixCache::Match PrefixCache::match(std::span<const int32_t> prompt) const {
  Match m;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const std::vector<int32_t>& t = entries_[i].tokens;
    const size_t n = std::min(t.size(), prompt.size());
    const int64_t common =
        std::mismatch(t.begin(), t.begin() + std::ptrdiff_t(n), prompt.begin()).first - t.begin();
    m.shared = std::max(m.shared, common);
    if (t.size() == prompt.size() && size_t(common) == t.size() && !entries_[i].logits.empty())
      m.whole = int(i);
    if (size_t(common) == t.size() && t.size() < prompt.size() && common > m.cached) {
      m.cached = common;
      m.entry = int(i);
    }
  }
  return m;
}

void PrefixCache::restore(const Match& m, SequenceState& into) {
  MD_CHECK(m.entry >= 0 && size_t(m.entry) < entries_.size(), "prefix cache: no entry {}", m.entry);
  Entry& e = entries_[size_t(m.entry)];
  MD_CHECK(int64_t(e.tokens.size()) == m.cached, "prefix cache: a stale match");
  copy_(into, e.state);
  e.used = ++clock_;
}

void PrefixCache::restore_whole(const Match& m, SequenceState& into, std::vector<float>& logits) {
  MD_CHECK(m.whole >= 0 && size_t(m.whole) < entries_.size(), "prefix cache: no entry {}", m.whole);
  Entry& e = entries_[size_t(m.whole)];
  MD_CHECK(!e.logits.empty(), "prefix cache: a stale match");
  copy_(into, e.state);
  logits = e.logits;
  e.used = ++clock_;
}

bool PrefixCache::insert(std::span<const int32_t> tokens, const SequenceState& from,
                         std::span<const float> logits) {
  MD_CHECK(from.valid() && from.pos == int64_t(tokens.size()),
           "prefix cache: a state at position {} for {} tokens", from.pos, tokens.size());
  if (capacity_ == 0 || int64_t(tokens.size()) < min_tokens_) return false;
  for (Entry& e : entries_)
    if (std::ranges::equal(e.tokens, tokens)) {
      e.used = ++clock_;
      if (e.logits.empty()) e.logits.assign(logits.begin(), logits.end());
      return false;
    }
  if (size() >= capacity_) evict_lru();
  // A slot and the pages for the tokens, from entries if the pool has too few (the serving loop
  // sizes the pool so that it does not; a smaller pool makes the cache give way).
  const auto fits = [&] {
    return pool_.sequences_in_use() < pool_.max_sequences() &&
           pool_.free_pages() >= pool_.pages_for(int64_t(tokens.size()));
  };
  while (!fits() && !entries_.empty()) evict_lru();
  if (!fits()) return false;
  Entry e;
  e.tokens.assign(tokens.begin(), tokens.end());
  e.state = pool_.acquire();
  copy_(e.state, from);
  e.logits.assign(logits.begin(), logits.end());
  e.used = ++clock_;
  entries_.push_back(std::move(e));
  return true;
}

void PrefixCache::free_a_slot() {
  while (pool_.sequences_in_use() >= pool_.max_sequences() && !entries_.empty()) evict_lru();
}

size_t PrefixCache::bytes() const {
  size_t b = 0;
  for (const Entry& e : entries_) b += e.state.bytes() + e.logits.size() * sizeof(float);
  return b;
}

void PrefixCache::evict_lru() {
  if (entries_.empty()) return;
  const auto lru = std::ranges::min_element(entries_, {}, &Entry::used);
  entries_.erase(lru);
}

}  // namespace md
