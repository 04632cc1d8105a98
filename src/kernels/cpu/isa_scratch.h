// Per-thread, 64-byte aligned scratch for the ISA kernel files (repacked activations). Internal
// linkage on purpose: each *_avx2 / *_avx512 / *_avx512bf16 file that includes this compiles its
// own copy with its own flags, so an AVX-512-compiled copy can never be linked into a path that
// runs on a CPU without AVX-512 (the usual hazard of inline functions shared across ISA files).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace md::cpu::detail {
namespace {

// Grows, never shrinks: after the first calls of a run the hot path does not allocate.
class IsaScratch {
 public:
  ~IsaScratch() { std::free(p_); }
  void* get(size_t bytes) {
    if (bytes > cap_) {
      std::free(p_);
      cap_ = (bytes + 4095) / 4096 * 4096;
      p_ = std::aligned_alloc(64, cap_);
      if (!p_) {
        cap_ = 0;
        throw std::bad_alloc();
      }
    }
    return p_;
  }

 private:
  void* p_ = nullptr;
  size_t cap_ = 0;
};

// The sub-group -> group table of a quantized matrix's rows: entry j (32-column sub-group j) is
// the index of the scale group holding it, min(j, G - 1) * 32 / group, and `pad` entries past G
// repeat the last (kernels whose blocks of lanes run past a row's end). Consecutive calls share
// the geometry (a worker's tiles of one op, an expert's gate and up), so the table is rebuilt only
// when it changes: its 72 divisions for a 2304-column row cost about a percent of a decode tile.
class SubgroupMap {
 public:
  const int32_t* get(int64_t G, int64_t group, int64_t pad = 0) {
    if (G != G_ || group != group_ || pad != pad_) {
      G_ = -1;  // while the table changes (get may throw)
      map_ = static_cast<int32_t*>(mem_.get(static_cast<size_t>(G + pad) * sizeof(int32_t)));
      for (int64_t j = 0; j < G + pad; ++j)
        map_[j] = static_cast<int32_t>(32 * std::min(j, G - 1) / group);
      G_ = G, group_ = group, pad_ = pad;
    }
    return map_;
  }

 private:
  IsaScratch mem_;
  int32_t* map_ = nullptr;
  int64_t G_ = -1, group_ = 0, pad_ = 0;
};

}  // namespace
}  // namespace md::cpu::detail
