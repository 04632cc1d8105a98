// A checkpoint file's bytes in this process: a read-only mapping of the file (the default: the
// page cache is shared with other processes and nothing is copied), or a private copy in
// anonymous memory (--no-mmap, as llama.cpp's flag). Either way the bytes start on a 2 MiB
// boundary and are advised for transparent huge pages, because decode streams every active
// weight once per token and 4 KiB pages cost it twice: a TLB miss every 4 KiB, and hardware
// prefetchers that stop at every page boundary (bench/RESULTS.md, "Weights on huge pages").
//  * mapped: huge pages are used where the page cache holds the file in 2 MiB folios (recent
//    kernels on ext4/xfs read files into large folios; a file just written, e.g. by make-model,
//    stays in small ones until it is read back from disk);
//  * copied: huge pages whenever THP is not "never"; the copy's page-cache pages are dropped as
//    it goes (POSIX_FADV_DONTNEED), so a model that fills most of memory can still be copied.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace md {

enum class WeightLoad : uint8_t {
  kMap,   // mmap the files (default)
  kCopy,  // read them into anonymous, huge-page-advised memory
};

struct LoadOptions {
  WeightLoad mode = WeightLoad::kMap;
  // kCopy: called as the bytes are read (done, total bytes of this file); may be empty.
  std::function<void(double done, double total)> progress;
};

class MappedFile {
 public:
  explicit MappedFile(const std::string& path, const LoadOptions& opt = {});  // throws md::Error
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  WeightLoad mode() const { return mode_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t reserved_ = 0;  // bytes of the region at data_ (size_ rounded up to 2 MiB)
  WeightLoad mode_ = WeightLoad::kMap;
};

// Bytes of [p, p + n) that the kernel currently maps with huge pages (AnonHugePages and
// FilePmdMapped of the mappings that overlap it, from /proc/self/smaps; each mapping counted in
// proportion to its overlap). 0 where /proc is not readable.
size_t huge_mapped_bytes(const void* p, size_t n);

}  // namespace md
