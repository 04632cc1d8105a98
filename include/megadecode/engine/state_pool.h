// The state pool (docs/architecture.md "State pool"): every sequence's state between steps lives
// in one pool allocated up front, so that a step never allocates and a backend can hand the
// pool's flat buffers to its kernels as they are.
//
//  * A slot per sequence (at most max_sequences): the KDA state of every KDA layer ([H][K][V]
//    fp32), its conv cache ([3 (q, k, v)][W - 1][C] fp32), and the row log a step keeps for a
//    commit to a prefix of its rows (the state and conv cache before the step and commit_rows
//    rows of recurrence inputs).
//  * Pages of the MLA latent caches: page_rows tokens of every MLA layer, rows of
//    mla_cache_width() values (576 for Kimi Linear) in the activations' storage type: bf16 in
//    BF16 precision (where every cached value is bf16-exact, so this loses nothing) and fp32 in
//    FP32 precision. A sequence holds a page table (its page ids in row order); the pages of all
//    sequences come from one budget of cache_tokens.
//
// Running out of slots or pages is an md::Error naming the budget and the option that sets it.
// Freed slots and pages are reused. The reference path (Model) and each executor own a pool; a
// sequence can be copied between pools of the same model (SequenceState::copy_from).
//
// A pool must outlive its sequences (as a container its iterators).
//
// Memory is reserved up front and committed by the OS as it is first written (a slot's state
// when the slot is taken, a page when a sequence first writes into it), so an idle budget costs
// address space, not resident memory.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "megadecode/kernels/cpu/mla.h"
#include "megadecode/model/config.h"

namespace md {

struct PoolOptions {
  int max_sequences = 16;    // slots (--max-sequences)
  int64_t cache_tokens = 0;  // latent-cache rows over all sequences (--cache-tokens); 0:
                             // max_sequences * kDefaultTokensPerSequence
  int page_rows = 64;        // tokens per page, a multiple of cpu::kMlaBlockRows
  int commit_rows = 16;      // rows a slot's row log holds (0: steps cannot be committed)
};

inline constexpr int64_t kDefaultTokensPerSequence = 16384;

// One token row's entry in a KDA layer's row log: raw q, k, v (the conv inputs), the conv outputs
// qc, kc, vc, the decay gate f (each C floats), then beta (H floats).
inline int64_t kda_row_log_floats(const ModelConfig& c) {
  return 7 * c.kda_dim() + c.kda_num_heads;
}

class StatePool;

// Where a pool keeps its slots and pages: host memory by default, a device's memory for a device
// backend (exec/cuda). The pool's bookkeeping (free lists, page tables) stays in host memory.
// Must outlive the pools that use it.
class PoolMemory {
 public:
  virtual ~PoolMemory() = default;
  virtual void* alloc_zeroed(size_t bytes) = 0;
  virtual void free(void* p) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  // Copies between this memory and host memory or this memory, in either direction; done when it
  // returns.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // Whether the host may dereference the memory (host memory, the CUDA simulation's).
  virtual bool host_accessible() const = 0;
};

// One sequence: a slot of a pool and the pages of its latent caches. Move-only; destroying it
// (or assigning over it) returns its slot and pages to the pool. A default-constructed state
// belongs to no pool. Accessors take the model's layer index.
class SequenceState {
 public:
  SequenceState() = default;
  ~SequenceState();
  SequenceState(SequenceState&& o) noexcept;
  SequenceState& operator=(SequenceState&& o) noexcept;
  SequenceState(const SequenceState&) = delete;
  SequenceState& operator=(const SequenceState&) = delete;

  int64_t pos = 0;  // tokens consumed so far
  // What a multi-row step kept for a commit to a prefix of its rows (Executor::commit): the
  // position before the step and its row count (rows == 0: nothing kept). The data is in the
  // slot's row log.
  struct RowLog {
    int64_t pos0 = 0;
    int rows = 0;
  } rowlog;

  StatePool* pool() const { return pool_; }
  bool valid() const { return pool_ != nullptr; }
  int slot() const { return slot_; }

  float* kda_state(int layer) const;   // [H][K][V]
  float* conv_cache(int layer) const;  // [3][W - 1][C]
  // The row log of a KDA layer: state and conv cache before the step, then per row its
  // recurrence inputs ([commit_rows][row_log_floats]).
  float* kda_state0(int layer) const;
  float* conv0(int layer) const;
  float* row_inputs(int layer) const;
  // The latent cache of an MLA layer, rows [0, capacity()).
  cpu::LatentCache latent(int layer) const;
  std::span<const int32_t> pages() const;
  // Latent-cache rows the sequence's pages hold.
  int64_t capacity() const;

  // Makes the pages hold rows [0, tokens) (an md::Error naming the budget when the pool has too
  // few free pages; then nothing changes).
  void reserve(int64_t tokens);
  // Returns the pages past the first `tokens` rows (a commit to a prefix, a reset).
  void truncate(int64_t tokens);
  // This sequence becomes a copy of `from` (a sequence of a pool of the same model and cache
  // type, possibly another pool): position, states, latent rows [0, pos); row log dropped.
  void copy_from(const SequenceState& from);

  // Bytes of pool memory this sequence holds (its slot and pages).
  size_t bytes() const;

 private:
  friend class StatePool;
  void release() noexcept;
  StatePool* pool_ = nullptr;
  int slot_ = -1;
  int npages_ = 0;
};

class StatePool {
 public:
  // A pool for sequences of `cfg`; latent caches in bf16 when cache_bf16, else fp32; slots and
  // pages in `memory` (null: host memory).
  StatePool(const ModelConfig& cfg, bool cache_bf16, const PoolOptions& opt = {},
            PoolMemory* memory = nullptr);
  ~StatePool();
  StatePool(const StatePool&) = delete;
  StatePool& operator=(const StatePool&) = delete;

  // A fresh sequence at position 0 (zero state): an md::Error naming --max-sequences when every
  // slot is taken.
  SequenceState acquire();

  const ModelConfig& config() const { return cfg_; }
  const PoolOptions& options() const { return opt_; }
  bool cache_bf16() const { return bf16_; }
  int max_sequences() const { return opt_.max_sequences; }
  int sequences_in_use() const;
  std::vector<int> slots_in_use() const;  // ascending
  int64_t total_pages() const { return total_pages_; }
  int64_t free_pages() const;
  int64_t pages_for(int64_t tokens) const { return (tokens + opt_.page_rows - 1) / opt_.page_rows; }
  // Bytes: one slot (state, conv, row log), one page (all MLA layers), the whole pool.
  size_t slot_bytes() const { return slot_floats_ * sizeof(float); }
  size_t page_bytes() const { return page_bytes_; }
  size_t bytes() const;
  // Whether sequences of `other` can be copied into this pool's (same model layout and type).
  bool compatible(const StatePool& other) const;
  PoolMemory& memory() const { return *mem_; }

 private:
  friend class SequenceState;
  float* slot_data(int slot) const { return slots_ + size_t(slot) * slot_floats_; }
  int32_t* table(int slot) const { return tables_.get() + size_t(slot) * size_t(total_pages_); }
  void grow(SequenceState& s, int64_t tokens);
  void shrink(SequenceState& s, int64_t tokens);
  void free_slot(int slot, int npages) noexcept;

  struct FreeDeleter {
    void operator()(void* p) const;
  };

  PoolMemory* mem_ = nullptr;
  ModelConfig cfg_;
  PoolOptions opt_;
  bool bf16_;
  std::vector<int> kda_index_, mla_index_;  // per layer: index among KDA / MLA layers, or -1
  int nkda_ = 0;
  size_t state_floats_ = 0, conv_floats_ = 0, log_floats_ = 0;  // per KDA layer
  size_t slot_floats_ = 0;
  size_t row_bytes_ = 0, layer_page_bytes_ = 0, page_bytes_ = 0;
  int64_t total_pages_ = 0;
  float* slots_ = nullptr;                          // in mem_
  uint8_t* pages_ = nullptr;                        // in mem_
  std::unique_ptr<int32_t[], FreeDeleter> tables_;  // [slot][total_pages]
  mutable std::mutex mu_;
  std::vector<int> free_slots_;
  std::vector<int32_t> free_pages_;
};

}  // namespace md
