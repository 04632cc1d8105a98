// Prefix caching for a hybrid model (docs/server.md "Prefix cache"): copies of sequences' states
// (every KDA layer's recurrent state and conv cache, every MLA layer's latent rows) kept after
// they consumed given tokens, so that a later prompt starting with those tokens continues from the
// copy and prefills only the rest.
//
// A transformer's cache can be cut at any token (vLLM shares its KV blocks); a recurrent state
// cannot: it is the state after exactly its tokens. So an entry is a whole state at one position,
// taken where the serving loop can tell that a later prompt will reuse it: at the end of a prompt,
// at the end of a generation (a chat's next turn repeats the conversation so far), and at the
// point where a new prompt departs from a cached one (a shared system prompt or few-shot prefix:
// the next prompt with it hits). A hit gives the same bits as prefilling from scratch, since the
// executors compute a sequence's rows the same however its prompt is chunked.
//
// The entries are sequences of the executor's own pool (a slot and pages each), at most
// `capacity`, least recently used first out. Engine-thread only (not thread-safe).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "megadecode/engine/state_pool.h"

namespace md {

class PrefixCache {
 public:
  // How a state is copied (dst becomes src): SequenceState::copy_from by default; a serving
  // loop passes its executor's copy_sequence (a distributed leader copies on every rank).
  using Copy = std::function<void(SequenceState& dst, const SequenceState& src)>;
  // Entries of at least min_tokens tokens (shorter ones are cheap to prefill and would only
  // churn the cache), at most `capacity` of them (0: the cache keeps nothing).
  PrefixCache(StatePool& pool, int capacity, int64_t min_tokens, Copy copy = {});
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  struct Match {
    int entry = -1;      // the entry to restore (-1: none)
    int64_t cached = 0;  // its tokens: the longest entry that is a proper prefix of the prompt
    // The longest common prefix of the prompt with any entry (>= cached): where the prompt
    // departs from what was cached before, a position worth keeping a state at.
    int64_t shared = 0;
    // An entry of exactly the prompt's tokens that kept the logits of its last row (-1: none):
    // restore_whole() gives the prompt's state and the logits of its first draw, no row fed.
    int whole = -1;
  };
  // A proper prefix only: the rest of the prompt, at least one token, gives the logits of the
  // first draw.
  Match match(std::span<const int32_t> prompt) const;
  // `into` (a sequence of a pool of the same model) becomes a copy of the match's entry, which
  // becomes the most recently used.
  void restore(const Match& m, SequenceState& into);
  void restore_whole(const Match& m, SequenceState& into, std::vector<float>& logits);

  // Keeps a copy of `from`, the state after consuming `tokens` (from.pos == tokens.size()), and
  // the logits of the last token's row if given (a prompt's end: the same prompt again then
  // feeds nothing). False when it keeps nothing new: too short, already kept (then it is touched,
  // and takes the logits if it had none), or no slot and pages left in the pool even after
  // evicting every entry.
  bool insert(std::span<const int32_t> tokens, const SequenceState& from,
              std::span<const float> logits = {});

  // Evicts entries (least recently used first) until the pool has a free slot, or none is left.
  void free_a_slot();
  void clear() { entries_.clear(); }

  int size() const { return int(entries_.size()); }
  int capacity() const { return capacity_; }
  int64_t min_tokens() const { return min_tokens_; }
  size_t bytes() const;  // memory the entries hold (their pool slots and pages, and logits)

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    SequenceState state;
    std::vector<float> logits;  // the last token's row (empty: not kept)
    uint64_t used = 0;
  };
  void evict_lru();

  StatePool& pool_;
  Copy copy_;
  int capacity_;
  int64_t min_tokens_;
  uint64_t clock_ = 0;
  std::vector<Entry> entries_;
};

}  // namespace md
