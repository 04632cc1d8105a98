#include "megadecode/base/util.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include "megadecode/base/error.h"

namespace md {

std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000.0 && u < 4) {
    b /= 1000.0;
    ++u;
  }
  return fmt::format("{:.2f} {}", b, units[u]);
}

WeightBuffer::WeightBuffer(size_t n) : n_(n) {
  if (n == 0) return;
  constexpr size_t kHuge = size_t{2} << 20;
  mapped_ = (n + kHuge - 1) / kHuge * kHuge;
  // Over-allocate by one huge page, keep the aligned part, give the rest back.
  const size_t want = mapped_ + kHuge;
  void* raw = ::mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  MD_CHECK(raw != MAP_FAILED, "cannot allocate {} bytes of weights", n);
  const auto b = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t a = (b + kHuge - 1) & ~uintptr_t(kHuge - 1);
  if (a > b) ::munmap(raw, a - b);
  if (a + mapped_ < b + want)
    ::munmap(reinterpret_cast<void*>(a + mapped_), b + want - a - mapped_);
  p_ = reinterpret_cast<uint8_t*>(a);
  ::madvise(p_, mapped_, MADV_HUGEPAGE);  // advice only: a kernel without THP maps 4 KiB pages
}

WeightBuffer::~WeightBuffer() {
  if (p_) ::munmap(p_, mapped_);
}

std::shared_ptr<WeightBuffer> weight_buffer(size_t n) {
  return std::make_shared<WeightBuffer>(n);
}

}  // namespace md
