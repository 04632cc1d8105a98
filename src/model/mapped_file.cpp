// Checkpoint files in memory: a 2 MiB-aligned read-only mapping, or a copy in huge-page-advised
// anonymous memory (model/mapped_file.h says why).
#include "megadecode/model/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "megadecode/base/error.h"

namespace md {
namespace {

constexpr size_t kHuge = size_t{2} << 20;

std::string errno_text(int e) {
  return std::error_code(e, std::generic_category()).message();
}

size_t round_up(size_t n, size_t a) {
  return (n + a - 1) / a * a;
}

// A 2 MiB-aligned range of `bytes` (a multiple of 2 MiB) of inaccessible address space: a larger
// reservation with the slack on both sides given back.
uint8_t* reserve_aligned(size_t bytes, const std::string& path) {
  void* r = ::mmap(nullptr, bytes + kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
  MD_CHECK(r != MAP_FAILED, "cannot reserve {} bytes of address space for {}: {}", bytes, path,
           errno_text(errno));
  const auto base = reinterpret_cast<uintptr_t>(r);
  const uintptr_t aligned = round_up(base, kHuge);
  if (aligned > base) ::munmap(r, aligned - base);
  const uintptr_t end = base + bytes + kHuge;
  if (end > aligned + bytes) ::munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
  return reinterpret_cast<uint8_t*>(aligned);
}

}  // namespace

MappedFile::MappedFile(const std::string& path, const LoadOptions& opt)
    : path_(path), mode_(opt.mode) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MD_CHECK(fd >= 0, "cannot open {}: {}", path, errno_text(errno));
  struct CloseFd {
    int fd;
    ~CloseFd() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  MD_CHECK(::fstat(fd, &st) == 0, "cannot stat {}: {}", path, errno_text(errno));
  MD_CHECK(!S_ISDIR(st.st_mode), "cannot map {}: is a directory", path);
  MD_CHECK(S_ISREG(st.st_mode), "cannot map {}: not a regular file", path);
  // mmap rejects a zero length, and an empty file is never a valid checkpoint part anyway.
  MD_CHECK(st.st_size > 0, "cannot map {}: file is empty", path);
  const auto size = static_cast<size_t>(st.st_size);
  const size_t reserved = round_up(size, kHuge);
  uint8_t* base = reserve_aligned(reserved, path);
  struct Unreserve {  // until the region is ours for good
    uint8_t* p;
    size_t n;
    ~Unreserve() {
      if (p) ::munmap(p, n);
    }
  } guard{base, reserved};

  if (mode_ == WeightLoad::kMap) {
    void* p = ::mmap(base, size, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);
    MD_CHECK(p != MAP_FAILED, "cannot mmap {}: {}", path, errno_text(errno));
    // Advice only: a kernel without file THP refuses it, and the mapping works the same.
    ::madvise(p, size, MADV_HUGEPAGE);
    // Every weight is read during loading and then on every step: start readahead now.
    ::madvise(p, size, MADV_WILLNEED);
  } else {
    void* p = ::mmap(base, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                     -1, 0);
    MD_CHECK(p != MAP_FAILED, "cannot allocate {} bytes to copy {} into: {}", reserved, path,
             errno_text(errno));
    ::madvise(p, reserved, MADV_HUGEPAGE);  // before the first touch, so faults take 2 MiB
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    constexpr size_t kChunk = size_t{64} << 20;
    size_t done = 0;
    while (done < size) {
      const size_t want = std::min(kChunk, size - done);
      size_t got = 0;
      while (got < want) {
        const ssize_t r = ::pread(fd, base + done + got, want - got, off_t(done + got));
        if (r < 0 && errno == EINTR) continue;
        MD_CHECK(r > 0, "cannot read {} at byte {}: {}", path, done + got,
                 r < 0 ? errno_text(errno) : "the file ended early (it shrank while loading)");
        got += size_t(r);
      }
      // The copy is what the process reads from now on; the page cache's copy would only double
      // the memory this model takes.
      ::posix_fadvise(fd, off_t(done), off_t(want), POSIX_FADV_DONTNEED);
      done += want;
      if (opt.progress) opt.progress(double(done), double(size));
    }
    // Read-only from here, as a mapping would be: a stray write is a crash, not silent damage.
    MD_CHECK(::mprotect(base, reserved, PROT_READ) == 0, "cannot protect the copy of {}: {}", path,
             errno_text(errno));
  }
  guard.p = nullptr;
  data_ = base;
  size_ = size;
  reserved_ = reserved;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), reserved_);
}

size_t huge_mapped_bytes(const void* p, size_t n) {
  FILE* f = std::fopen("/proc/self/smaps", "re");
  if (!f) return 0;
  const auto lo = reinterpret_cast<uintptr_t>(p), hi = lo + n;
  char line[512];
  uintptr_t vs = 0, ve = 0;
  double total = 0;
  while (std::fgets(line, sizeof line, f)) {
    uintptr_t a = 0, b = 0;
    if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " ", &a, &b) == 2 && std::strchr(line, ' ') &&
        std::strchr(line, '-') < std::strchr(line, ' ')) {
      vs = a;
      ve = b;
      continue;
    }
    const uintptr_t os = std::max(vs, lo), oe = std::min(ve, hi);
    if (oe <= os) continue;
    unsigned long long kb = 0;
    if (std::sscanf(line, "AnonHugePages: %llu kB", &kb) == 1 ||
        std::sscanf(line, "FilePmdMapped: %llu kB", &kb) == 1)
      total += double(kb) * 1024.0 * double(oe - os) / double(ve - vs);
  }
  std::fclose(f);
  return size_t(total);
}

}  // namespace md
