// Checkpoint files in memory (model/mapped_file.h): both load modes give the file's bytes on a
// 2 MiB boundary, the copy is read-only and reports its progress, errors name the file, and a
// model loaded either way computes the same logits.
#include "megadecode/model/mapped_file.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "test_util.h"

namespace md {
namespace {

std::string write_file(const std::string& path, size_t n, uint32_t seed) {
  std::vector<uint8_t> b(n);
  uint32_t x = seed;
  for (auto& v : b) {
    x = x * 1664525u + 1013904223u;
    v = uint8_t(x >> 24);
  }
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), long(n));
  return std::string(b.begin(), b.end());
}

class MappedFileModes : public ::testing::TestWithParam<WeightLoad> {};

TEST_P(MappedFileModes, BytesOnA2MiBBoundary) {
  test::TempDir d("mapped");
  // Sizes around the 2 MiB rounding and the copy's 64 MiB chunks are not needed to see the
  // bytes; a size that is not a multiple of a page or of 2 MiB is.
  for (size_t n : {size_t{1}, size_t{4097}, size_t{(3u << 20) + 123}}) {
    const std::string path = d / ("f" + std::to_string(n));
    const std::string bytes = write_file(path, n, uint32_t(n));
    std::vector<std::pair<double, double>> seen;
    LoadOptions o;
    o.mode = GetParam();
    o.progress = [&](double done, double total) { seen.emplace_back(done, total); };
    MappedFile f(path, o);
    ASSERT_EQ(f.size(), n);
    EXPECT_EQ(f.mode(), GetParam());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data()) % (size_t{2} << 20), 0u);
    EXPECT_EQ(std::memcmp(f.data(), bytes.data(), n), 0) << n;
    EXPECT_LE(huge_mapped_bytes(f.data(), f.size()), f.size());
    if (GetParam() == WeightLoad::kCopy) {
      ASSERT_FALSE(seen.empty());
      EXPECT_EQ(seen.back().first, double(n));
      EXPECT_EQ(seen.back().second, double(n));
    } else {
      EXPECT_TRUE(seen.empty());  // nothing to report: the mapping reads lazily
    }
  }
}

TEST_P(MappedFileModes, ErrorsNameTheFile) {
  test::TempDir d("mapped_err");
  LoadOptions o;
  o.mode = GetParam();
  for (const std::string& p : {d / "absent", d.path()}) {
    try {
      MappedFile f(p, o);
      ADD_FAILURE() << "no error for " << p;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
  std::ofstream(d / "empty").close();
  EXPECT_THROW(MappedFile(d / "empty", o), Error);
}

INSTANTIATE_TEST_SUITE_P(Load, MappedFileModes,
                         ::testing::Values(WeightLoad::kMap, WeightLoad::kCopy),
                         [](const auto& info) {
                           return info.param == WeightLoad::kMap ? std::string("Map")
                                                                 : std::string("Copy");
                         });

TEST(MappedFile, TheCopyIsReadOnly) {
  test::TempDir d("mapped_ro");
  const std::string path = d / "f";
  write_file(path, 10000, 3);
  LoadOptions o;
  o.mode = WeightLoad::kCopy;
  MappedFile f(path, o);
  // (A write would be a crash: read the protection from /proc/self/maps instead.)
  const auto addr = reinterpret_cast<uintptr_t>(f.data());
  std::ifstream maps("/proc/self/maps");
  std::string line;
  bool found = false;
  while (std::getline(maps, line)) {
    uintptr_t a = 0, b = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %4s", &a, &b, perms) != 3) continue;
    if (addr >= a && addr < b) {
      found = true;
      EXPECT_EQ(std::string(perms).substr(0, 2), "r-") << line;
    }
  }
  EXPECT_TRUE(found);
}

// A model whose checkpoint was copied computes exactly what the mapped one does (the same bytes
// through the same kernels). (A distributed rank's refusal: Shard.WhatCannotRunASliceSaysSo.)
TEST(MappedFile, ModelLoadedEitherWayGivesTheSameLogits) {
  const std::string dir = test::shared_checkpoint("tiny", 11, 2);
  auto logits = [&](WeightLoad mode) {
    ModelOptions o;
    o.threads = 1;
    o.load.mode = mode;
    double last = 0;
    o.load.progress = [&](double done, double) { last = done; };
    Model m(dir, o);
    EXPECT_EQ(m.options().load.mode, mode);
    if (mode == WeightLoad::kCopy) {
      EXPECT_EQ(last, double(m.checkpoint().file_bytes()));  // progress over all the shards
    }
    SequenceState s = m.new_sequence();
    std::vector<int32_t> ids = {5, 17, 3, 99, 42};
    std::vector<float> out(ids.size() * size_t(m.config().vocab_size));
    m.forward(s, ids, out.data(), true);
    return out;
  };
  const std::vector<float> a = logits(WeightLoad::kMap), b = logits(WeightLoad::kCopy);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);

}

}  // namespace
}  // namespace md
