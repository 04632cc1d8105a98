// Per-thread, 64-byte aligned scratch for the ISA kernel files (repacked activations). Internal
// linkage on purpose: each *_avx2 / *_avx512 / *_avx512bf16 file that includes this compiles its
// own copy with its own flags, so an AVX-512-compiled copy can never be linked into a path that
// runs on a CPU without AVX-512 (the usual hazard of inline functions shared across ISA files).
#pragma once
#include <cstddef>
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

}  // namespace
}  // namespace md::cpu::detail
