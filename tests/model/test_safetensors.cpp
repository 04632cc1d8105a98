#include "megadecode/model/safetensors.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"

namespace md {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Passes when fn throws md::Error with a one-line message containing every part: the equivalent of
// EXPECT_THAT(message, AllOf(HasSubstr(...), ...)) plus the one-line rule, and it also tells a
// missing throw apart from a throw of the wrong type.
::testing::AssertionResult ThrowsMdError(const std::function<void()>& fn,
                                         const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) {
      if (msg.find(p) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << p << "\"";
      }
    }
    if (msg.find('\n') != std::string::npos) {
      return ::testing::AssertionFailure() << "message spans lines: " << msg;
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-md::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// The bytes of a safetensors file; `len` overrides the header length field.
std::string make_file(const std::string& header, const std::string& data = "",
                      std::optional<uint64_t> len = std::nullopt) {
  return le64(len.value_or(header.size())) + header + data;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

SafetensorsContents parse(const std::string& bytes, const std::string& name = "mem") {
  return parse_safetensors_buffer(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                  name);
}

// Deterministic content that differs per tensor, so misplaced data is caught.
uint8_t pattern(const TensorSpec& s, size_t i) {
  return static_cast<uint8_t>(std::hash<std::string>{}(s.name) + i * 131 + (i >> 8));
}
void fill_pattern(const TensorSpec& s, uint8_t* out) {
  for (size_t i = 0; i < s.nbytes(); ++i) out[i] = pattern(s, i);
}
void expect_pattern(const TensorInfo& t, const TensorSpec& s) {
  ASSERT_EQ(t.nbytes, s.nbytes()) << s.name;
  const auto* p = static_cast<const uint8_t*>(t.data);
  for (size_t i = 0; i < t.nbytes; ++i) ASSERT_EQ(p[i], pattern(s, i)) << s.name << " byte " << i;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::path(::testing::TempDir()) / "md_safetensors_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << tmpl;
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }
  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string p = path(name);
    fs::create_directories(fs::path(p).parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  // Writes a file made of `header` and `data` and expects opening it to fail naming the file and
  // every part.
  void ExpectBad(const std::string& header, const std::string& data,
                 std::vector<std::string> parts) {
    const std::string p = write("bad.safetensors", make_file(header, data));
    parts.push_back(p);
    EXPECT_TRUE(ThrowsMdError([&] { SafetensorsFile f(p); }, parts)) << header;
  }

  std::string dir_;
};

const std::string kData8(8, '\x01');

// ---- round trips ----

std::vector<TensorSpec> mixed_specs() {
  return {{"embed.weight", DType::BF16, {16, 8}}, {"norm.weight", DType::F32, {8}},
          {"proj.weight", DType::F16, {3, 5, 7}}, {"mask", DType::U8, {13}},
          {"positions", DType::I64, {4}},         {"scalar", DType::F32, {}},
          {"empty", DType::BF16, {0, 4}},         {"lm_head.weight", DType::BF16, {32, 8}}};
}

TEST_F(SafetensorsTest, RoundTripSingleFile) {
  const auto specs = mixed_specs();
  std::vector<std::string> filled;
  write_checkpoint(dir_ + "/ck", specs,
                   [&](const TensorSpec& s, uint8_t* out) {
                     filled.push_back(s.name);
                     fill_pattern(s, out);
                   },
                   1, {{"format", "pt"}, {"note", "hi"}});
  ASSERT_EQ(filled.size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) EXPECT_EQ(filled[i], specs[i].name);
  EXPECT_FALSE(fs::exists(dir_ + "/ck/model.safetensors.index.json"));

  // The header is padded so that the data section is 8-byte aligned.
  const std::string bytes = read_all(dir_ + "/ck/model.safetensors");
  uint64_t hlen = 0;
  std::memcpy(&hlen, bytes.data(), 8);
  EXPECT_EQ(hlen % 8, 0u);

  Checkpoint ck(dir_ + "/ck");
  ASSERT_EQ(ck.tensors().size(), specs.size());
  size_t expected_total = 0;
  const uint8_t* prev_end = nullptr;
  for (const auto& s : specs) {
    const TensorInfo& t = ck.get(s.name);
    EXPECT_EQ(t.dtype, s.dtype);
    EXPECT_EQ(t.shape, s.shape);
    expect_pattern(t, s);
    // Offsets are contiguous in the given order.
    if (prev_end) {
      EXPECT_EQ(static_cast<const uint8_t*>(t.data), prev_end) << s.name;
    }
    prev_end = static_cast<const uint8_t*>(t.data) + t.nbytes;
    expected_total += s.nbytes();
  }
  EXPECT_EQ(ck.total_bytes(), expected_total);
  EXPECT_EQ(ck.get("proj.weight").numel(), 105);
  EXPECT_EQ(ck.get("proj.weight").shape_str(), "[3, 5, 7]");
  EXPECT_EQ(ck.get("scalar").numel(), 1);
  EXPECT_EQ(ck.get("scalar").shape_str(), "[]");
  EXPECT_EQ(ck.get("empty").numel(), 0);
  EXPECT_EQ(ck.find("missing"), nullptr);
  EXPECT_TRUE(ThrowsMdError([&] { ck.get("missing"); }, {"'missing'", "not found", "ck"}));

  SafetensorsFile f(dir_ + "/ck/model.safetensors");
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "hi");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.tensors().at("embed.weight").data) % 8, 0u);
}

TEST_F(SafetensorsTest, RoundTripTypedValues) {
  const std::vector<TensorSpec> specs = {{"b", DType::BF16, {5}}, {"h", DType::F16, {5}}};
  write_checkpoint(dir_, specs, [](const TensorSpec& s, uint8_t* out) {
    for (int i = 0; i < 5; ++i) {
      const float v = -1.0f + 0.75f * static_cast<float>(i);
      const uint16_t bits = s.dtype == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
      std::memcpy(out + 2 * i, &bits, 2);
    }
  });
  Checkpoint ck(dir_);
  for (int i = 0; i < 5; ++i) {
    uint16_t b, h;
    std::memcpy(&b, static_cast<const uint8_t*>(ck.get("b").data) + 2 * i, 2);
    std::memcpy(&h, static_cast<const uint8_t*>(ck.get("h").data) + 2 * i, 2);
    EXPECT_EQ(bf16_to_f32(b), -1.0f + 0.75f * i);
    EXPECT_EQ(f16_to_f32(h), -1.0f + 0.75f * i);
  }
}

TEST_F(SafetensorsTest, RoundTripSharded) {
  const auto specs = mixed_specs();
  write_checkpoint(dir_, specs, fill_pattern, 3);
  EXPECT_FALSE(fs::exists(path("model.safetensors")));
  const json index = json::parse(read_all(path("model.safetensors.index.json")));
  const json& wm = index.at("weight_map");
  ASSERT_EQ(wm.size(), specs.size());
  size_t total = 0;
  for (const auto& s : specs) total += s.nbytes();
  EXPECT_EQ(index.at("metadata").at("total_size").get<size_t>(), total);

  std::map<std::string, int> per_shard;
  for (const auto& s : specs) per_shard[wm.at(s.name).get<std::string>()]++;
  ASSERT_EQ(per_shard.size(), 3u);
  for (int k = 1; k <= 3; ++k) {
    const std::string name = fmt::format("model-{:05d}-of-00003.safetensors", k);
    EXPECT_TRUE(fs::exists(path(name))) << name;
    EXPECT_GE(per_shard[name], 1) << name;
    EXPECT_EQ(SafetensorsFile(path(name)).metadata().at("format"), "pt");
  }
  // Shards hold consecutive runs of tensors in the given order.
  for (size_t i = 1; i < specs.size(); ++i) {
    EXPECT_LE(wm.at(specs[i - 1].name).get<std::string>(), wm.at(specs[i].name).get<std::string>());
  }

  Checkpoint ck(dir_);
  ASSERT_EQ(ck.tensors().size(), specs.size());
  for (const auto& s : specs) expect_pattern(ck.get(s.name), s);
  EXPECT_EQ(ck.total_bytes(), total);
}

TEST_F(SafetensorsTest, ShardsAreBalancedAndNeverEmpty) {
  std::vector<TensorSpec> equal;
  for (int i = 0; i < 6; ++i) equal.push_back({fmt::format("t{}", i), DType::F32, {100}});
  write_checkpoint(dir_ + "/eq", equal, fill_pattern, 3);
  const json wm = json::parse(read_all(dir_ + "/eq/model.safetensors.index.json"))["weight_map"];
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(wm[fmt::format("t{}", i)],
              fmt::format("model-{:05d}-of-00003.safetensors", i / 2 + 1));
  }
  // One huge tensor first: the remaining shards still get one tensor each.
  const std::vector<TensorSpec> skewed = {{"big", DType::U8, {100000}},
                                          {"a", DType::U8, {1}},
                                          {"b", DType::U8, {1}},
                                          {"c", DType::U8, {0}}};
  write_checkpoint(dir_ + "/sk", skewed, fill_pattern, 4);
  Checkpoint ck(dir_ + "/sk");
  EXPECT_EQ(ck.tensors().size(), 4u);
  for (int k = 1; k <= 4; ++k) {
    EXPECT_EQ(SafetensorsFile(dir_ + fmt::format("/sk/model-{:05d}-of-00004.safetensors", k))
                  .tensors()
                  .size(),
              1u);
  }
}

TEST_F(SafetensorsTest, RewriteRemovesStaleLayout) {
  const auto specs = mixed_specs();
  write_checkpoint(dir_, specs, fill_pattern, 3);
  write_checkpoint(dir_, specs, fill_pattern, 1);
  EXPECT_FALSE(fs::exists(path("model.safetensors.index.json")));
  EXPECT_FALSE(fs::exists(path("model-00001-of-00003.safetensors")));
  EXPECT_EQ(Checkpoint(dir_).tensors().size(), specs.size());
  write_checkpoint(dir_, specs, fill_pattern, 2);
  EXPECT_FALSE(fs::exists(path("model.safetensors")));
  EXPECT_EQ(Checkpoint(dir_).tensors().size(), specs.size());
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
  }
}

TEST_F(SafetensorsTest, EmptyCheckpointRoundTrips) {
  write_checkpoint(dir_, {}, fill_pattern);
  Checkpoint ck(dir_);
  EXPECT_TRUE(ck.tensors().empty());
  EXPECT_EQ(ck.total_bytes(), 0u);
}

// ---- writer errors ----

TEST_F(SafetensorsTest, WriterRejectsBadArguments) {
  const std::vector<TensorSpec> two = {{"a", DType::U8, {1}}, {"b", DType::U8, {1}}};
  EXPECT_TRUE(ThrowsMdError([&] { write_checkpoint(dir_, two, fill_pattern, 3); },
                            {"cannot split 2 tensors into 3 shards"}));
  EXPECT_TRUE(
      ThrowsMdError([&] { write_checkpoint(dir_, two, fill_pattern, 0); }, {"shard count"}));
  const std::vector<TensorSpec> dup = {{"a", DType::U8, {1}}, {"a", DType::U8, {2}}};
  EXPECT_TRUE(ThrowsMdError([&] { write_checkpoint(dir_, dup, fill_pattern); },
                            {"duplicate tensor name 'a'"}));
  const std::vector<TensorSpec> neg = {{"n", DType::U8, {-1}}};
  EXPECT_TRUE(ThrowsMdError([&] { write_checkpoint(dir_, neg, fill_pattern); }, {"'n'", "[-1]"}));
  const TensorSpec huge{"h", DType::I64, {int64_t{1} << 40, int64_t{1} << 40}};
  EXPECT_TRUE(ThrowsMdError([&] { (void)huge.nbytes(); }, {"'h'", "overflows"}));
  write("afile", "x");
  EXPECT_TRUE(ThrowsMdError([&] { write_checkpoint(path("afile/sub"), two, fill_pattern); },
                            {"cannot create checkpoint directory", "afile/sub"}));
  EXPECT_FALSE(fs::exists(path("model.safetensors")));  // nothing written before the checks
}

TEST_F(SafetensorsTest, WriterPropagatesFillErrorsAndLeavesNoFiles) {
  const std::vector<TensorSpec> specs = {{"a", DType::U8, {4}}, {"b", DType::U8, {4}}};
  EXPECT_THROW(write_checkpoint(dir_ + "/ck", specs,
                                [](const TensorSpec& s, uint8_t*) {
                                  if (s.name == "b") throw std::runtime_error("boom");
                                }),
               std::runtime_error);
  EXPECT_TRUE(fs::is_empty(dir_ + "/ck"));
}

// A file size limit makes write() fail with EFBIG, standing in for a full disk.
TEST_F(SafetensorsTest, WriterReportsIoErrors) {
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  if (old.rlim_cur != RLIM_INFINITY && old.rlim_cur < (4u << 20))
    GTEST_SKIP() << "low RLIMIT_FSIZE";
  const auto old_handler = ::signal(SIGXFSZ, SIG_IGN);  // default action kills the process
  rlimit lim = old;
  lim.rlim_cur = 64 << 10;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  const std::vector<TensorSpec> specs = {{"big", DType::U8, {1 << 20}}};
  const auto result = ThrowsMdError([&] { write_checkpoint(dir_ + "/ck", specs, fill_pattern); },
                                    {"cannot write", "model.safetensors", "File too large"});
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(result);
  EXPECT_TRUE(fs::is_empty(dir_ + "/ck"));
}

// ---- opening files ----

TEST_F(SafetensorsTest, MappedFileErrorsNameThePath) {
  EXPECT_TRUE(ThrowsMdError([&] { MappedFile f(path("nope")); },
                            {"cannot open", path("nope"), "No such file"}));
  EXPECT_TRUE(ThrowsMdError([&] { MappedFile f(dir_); }, {dir_, "is a directory"}));
  const std::string empty = write("empty.safetensors", "");
  EXPECT_TRUE(ThrowsMdError([&] { SafetensorsFile f(empty); }, {empty, "empty"}));
  const std::string ok = write("ok", "hello");
  MappedFile m(ok);
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(std::memcmp(m.data(), "hello", 5), 0);
  EXPECT_EQ(m.path(), ok);
}

TEST_F(SafetensorsTest, FileShorterThanLengthField) {
  const std::string p = write("short.safetensors", std::string("\x05\x00\x00", 3));
  EXPECT_TRUE(ThrowsMdError([&] { SafetensorsFile f(p); }, {p, "3 bytes", "shorter than"}));
}

TEST_F(SafetensorsTest, HeaderLengthZero) {
  const std::string p = write("z.safetensors", make_file("{}", "", 0));
  EXPECT_TRUE(ThrowsMdError([&] { SafetensorsFile f(p); }, {p, "header length is 0"}));
}

TEST_F(SafetensorsTest, HeaderLengthBeyondFile) {
  for (uint64_t len : {uint64_t{3}, uint64_t{1} << 40, ~uint64_t{0}, ~uint64_t{0} - 7}) {
    const std::string p = write("b.safetensors", make_file("{}", "", len));
    EXPECT_TRUE(ThrowsMdError([&] { SafetensorsFile f(p); },
                              {p, fmt::format("header length {} goes beyond", len)}));
  }
}

TEST_F(SafetensorsTest, HeaderNotJson) {
  ExpectBad(R"({"w": {"dtype": "F32",)", "", {"header", "invalid JSON"});
  ExpectBad("{} trailing", "", {"invalid JSON"});
  ExpectBad(std::string("{\"a\0\":1}", 8), "", {"invalid JSON"});
  ExpectBad("{\"\xff\xfe\":1}", "", {"invalid JSON"});  // not UTF-8
}

TEST_F(SafetensorsTest, HeaderNotObject) {
  ExpectBad("[1, 2]", "", {"header must be a JSON object", "array"});
  ExpectBad("42", "", {"header must be a JSON object", "42"});
}

TEST_F(SafetensorsTest, HeaderNestedTooDeep) {
  ExpectBad(std::string(5000, '[') + std::string(5000, ']'), "", {"nested deeper"});
}

TEST_F(SafetensorsTest, UnsupportedDtype) {
  ExpectBad(R"({"w": {"dtype": "F8_E5M2", "shape": [8], "data_offsets": [0, 8]}})", kData8,
            {"unsupported dtype F8_E5M2 for tensor 'w'"});
  ExpectBad(R"({"w": {"dtype": 7, "shape": [8], "data_offsets": [0, 8]}})", kData8,
            {"dtype of tensor 'w' must be a string"});
}

TEST_F(SafetensorsTest, BadShape) {
  const std::string rest = R"(, "data_offsets": [0, 8]}})";
  const std::string pre = R"({"w": {"dtype": "U8", "shape": )";
  ExpectBad(pre + "8" + rest, kData8, {"shape of tensor 'w' must be an array", "8"});
  ExpectBad(pre + "[-8]" + rest, kData8, {"shape of tensor 'w'", "invalid dimension -8"});
  ExpectBad(pre + "[8.0]" + rest, kData8, {"shape of tensor 'w'", "invalid dimension 8.0"});
  ExpectBad(pre + "[\"8\"]" + rest, kData8, {"shape of tensor 'w'", "invalid dimension \"8\""});
  ExpectBad(pre + "[null]" + rest, kData8, {"shape of tensor 'w'", "invalid dimension null"});
  ExpectBad(pre + "[9223372036854775808]" + rest, kData8,
            {"invalid dimension 9223372036854775808"});
  ExpectBad(pre + "[1e400]" + rest, kData8, {"invalid JSON", "1e400"});
}

TEST_F(SafetensorsTest, BadDataOffsets) {
  const std::string pre = R"({"w": {"dtype": "U8", "shape": [8], "data_offsets": )";
  ExpectBad(pre + "[0, 8, 8]}}", kData8, {"data_offsets of tensor 'w' must be [begin, end]"});
  ExpectBad(pre + "[0]}}", kData8, {"data_offsets of tensor 'w' must be [begin, end]"});
  ExpectBad(pre + "{}}}", kData8, {"data_offsets of tensor 'w' must be [begin, end]"});
  ExpectBad(pre + "[-1, 7]}}", kData8, {"data_offsets of tensor 'w' must be non-negative", "-1"});
  ExpectBad(pre + "[0, 8.5]}}", kData8, {"data_offsets of tensor 'w' must be non-negative"});
  ExpectBad(pre + "[8, 0]}}", kData8, {"tensor 'w' have begin 8 > end 0"});
  ExpectBad(pre + "[1, 9]}}", kData8, {"tensor 'w' end at 9, beyond the data section (8 bytes)"});
  ExpectBad(pre + "[0, 18446744073709551615]}}", kData8, {"tensor 'w'", "beyond the data section"});
}

TEST_F(SafetensorsTest, SizeMismatch) {
  ExpectBad(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", kData8,
            {"tensor 'w' has 8 bytes in data_offsets but F32 [3] needs 12 bytes"});
  ExpectBad(R"({"w": {"dtype": "BF16", "shape": [], "data_offsets": [0, 0]}})", kData8,
            {"tensor 'w'", "needs 2 bytes"});
}

TEST_F(SafetensorsTest, SizeOverflow) {
  // 2^32 * 2^32 elements: numel fits in uint64 only modulo 2^64, where it would read as 0.
  ExpectBad(R"({"w": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})",
            kData8, {"shape [4294967296, 4294967296] of tensor 'w' is too large"});
  ExpectBad(R"({"w": {"dtype": "I64", "shape": [2305843009213693952], "data_offsets": [0, 0]}})",
            kData8, {"tensor 'w' is too large"});
  // A zero dimension makes it empty however large the others are.
  const auto c = parse(make_file(
      R"({"w": {"dtype": "I64", "shape": [4294967296, 4294967296, 0], "data_offsets": [8, 8]}})",
      kData8));
  EXPECT_EQ(c.tensors.at("w").numel(), 0);
  EXPECT_EQ(c.tensors.at("w").nbytes, 0u);
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  ExpectBad(R"({"a": {"dtype": "U8", "shape": [6], "data_offsets": [0, 6]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}})",
            kData8, {"tensors 'a' [0, 6) and 'b' [4, 8) overlap"});
  // A range nested inside an earlier, longer one.
  ExpectBad(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                "b": {"dtype": "U8", "shape": [1], "data_offsets": [2, 3]},
                "c": {"dtype": "U8", "shape": [1], "data_offsets": [5, 6]}})",
            kData8, {"'a' [0, 8)", "overlap"});
  // Touching ranges, empty tensors anywhere, holes and trailing bytes are fine.
  const auto c = parse(make_file(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                                     "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]},
                                     "e": {"dtype": "F32", "shape": [0], "data_offsets": [1, 1]},
                                     "f": {"dtype": "U8", "shape": [1], "data_offsets": [6, 7]}})",
                                 kData8));
  EXPECT_EQ(c.tensors.size(), 4u);
}

TEST_F(SafetensorsTest, DuplicateKeys) {
  ExpectBad(R"({"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                "w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})",
            kData8, {"duplicate key 'w'"});
  ExpectBad(R"({"w": {"dtype": "U8", "dtype": "F32", "shape": [8], "data_offsets": [0, 8]}})",
            kData8, {"duplicate key 'dtype'"});
  ExpectBad(R"({"__metadata__": {"k": "a", "k": "b"}})", "", {"duplicate key 'k'"});
  // Equal keys in different objects are not duplicates.
  EXPECT_EQ(parse(make_file(R"({"__metadata__": {"dtype": "x"},
                                "dtype": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}})",
                            kData8))
                .tensors.size(),
            1u);
}

TEST_F(SafetensorsTest, BadMetadata) {
  ExpectBad(R"({"__metadata__": {"format": "pt", "epoch": 3}})", "",
            {"__metadata__ value of 'epoch' must be a string", "3"});
  ExpectBad(R"({"__metadata__": {"nested": {}}})", "", {"value of 'nested'", "object"});
  ExpectBad(R"({"__metadata__": ["pt"]})", "", {"__metadata__ must be an object"});
}

TEST_F(SafetensorsTest, BadTensorEntry) {
  ExpectBad(R"({"w": [1]})", "", {"entry for tensor 'w' must be a JSON object"});
  ExpectBad(R"({"w": {"shape": [8], "data_offsets": [0, 8]}})", kData8,
            {"tensor 'w' has no \"dtype\""});
  ExpectBad(R"({"w": {"dtype": "U8", "data_offsets": [0, 8]}})", kData8,
            {"tensor 'w' has no \"shape\""});
  ExpectBad(R"({"w": {"dtype": "U8", "shape": [8]}})", kData8,
            {"tensor 'w' has no \"data_offsets\""});
  ExpectBad(R"({"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8], "align": 64}})", kData8,
            {"unexpected field 'align' for tensor 'w'"});
  ExpectBad(R"({"": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}})", kData8,
            {"empty tensor name"});
}

TEST_F(SafetensorsTest, MessagesStayOnOneLine) {
  ExpectBad(R"({"a\nb": {"dtype": "X\r", "shape": [8], "data_offsets": [0, 8]}})", kData8,
            {"unsupported dtype X\\x0d for tensor 'a\\x0ab'"});
  const std::string long_name(100000, 'n');
  const std::string p = write("long.safetensors", make_file("{\"" + long_name + "\": 1}"));
  try {
    SafetensorsFile f(p);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_LT(std::strlen(e.what()), 1000u);
  }
}

TEST_F(SafetensorsTest, HeaderPaddingAndEmptyHeaderObject) {
  const auto c = parse(make_file(
      R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"__metadata__":{"a":"b"}}    )",
      kData8));
  ASSERT_EQ(c.tensors.size(), 1u);
  EXPECT_EQ(c.metadata.at("a"), "b");
  EXPECT_EQ(c.tensors.at("w").file, "mem");
  EXPECT_TRUE(parse(make_file("{}")).tensors.empty());
}

// ---- checkpoints ----

TEST_F(SafetensorsTest, CheckpointDirectoryErrors) {
  EXPECT_TRUE(
      ThrowsMdError([&] { Checkpoint c(path("nope")); }, {path("nope"), "not a directory"}));
  const std::string f = write("file", "x");
  EXPECT_TRUE(ThrowsMdError([&] { Checkpoint c(f); }, {f, "not a directory"}));
  write("empty/config.json", "{}");
  EXPECT_TRUE(ThrowsMdError([&] { Checkpoint c(path("empty")); },
                            {path("empty"), "has no model.safetensors"}));
}

TEST_F(SafetensorsTest, CheckpointWithoutIndexLoadsAllFiles) {
  const std::vector<TensorSpec> a = {{"a", DType::U8, {3}}}, b = {{"b", DType::F32, {2}}};
  write_checkpoint(path("tmp_a"), a, fill_pattern);
  write_checkpoint(path("tmp_b"), b, fill_pattern);
  write("ck/part-a.safetensors", read_all(path("tmp_a/model.safetensors")));
  write("ck/part-b.safetensors", read_all(path("tmp_b/model.safetensors")));
  write("ck/notes.txt", "not a tensor file");
  Checkpoint ck(path("ck"));
  ASSERT_EQ(ck.tensors().size(), 2u);
  expect_pattern(ck.get("a"), a[0]);
  expect_pattern(ck.get("b"), b[0]);
  EXPECT_EQ(ck.get("b").file, path("ck/part-b.safetensors"));

  write("ck/part-c.safetensors", read_all(path("tmp_a/model.safetensors")));
  EXPECT_TRUE(ThrowsMdError(
      [&] { Checkpoint c(path("ck")); },
      {"tensor 'a' is present in two shards", "part-a.safetensors", "part-c.safetensors"}));
  // A bad file is reported by name.
  write("ck/part-c.safetensors", "junk");
  EXPECT_TRUE(ThrowsMdError([&] { Checkpoint c(path("ck")); }, {"part-c.safetensors", "shorter"}));
}

class SafetensorsIndexTest : public SafetensorsTest {
 protected:
  void SetUp() override {
    SafetensorsTest::SetUp();
    specs_ = {{"a", DType::U8, {10}}, {"b", DType::U8, {10}}, {"c", DType::U8, {10}}};
    write_checkpoint(dir_, specs_, fill_pattern, 3);
    index_ = json::parse(read_all(path("model.safetensors.index.json")));
  }
  void WriteIndex() { write("model.safetensors.index.json", index_.dump()); }
  ::testing::AssertionResult Fails(const std::vector<std::string>& parts) {
    WriteIndex();
    auto with_path = parts;
    with_path.push_back(path("model.safetensors.index.json"));
    return ThrowsMdError([&] { Checkpoint c(dir_); }, with_path);
  }

  std::vector<TensorSpec> specs_;
  json index_;
};

const char* const kShard1 = "model-00001-of-00003.safetensors";
const char* const kShard2 = "model-00002-of-00003.safetensors";

TEST_F(SafetensorsIndexTest, MissingShard) {
  fs::remove(path(kShard2));
  EXPECT_TRUE(Fails({"shard " + path(kShard2) + " is missing"}));
}

TEST_F(SafetensorsIndexTest, TensorAbsentFromItsShard) {
  index_["weight_map"]["a"] = kShard2;
  EXPECT_TRUE(Fails({"tensor 'a' is listed in shard " + std::string(kShard2) + " but absent"}));
  index_["weight_map"]["ghost"] = kShard1;
  index_["weight_map"]["a"] = kShard1;
  EXPECT_TRUE(Fails({"tensor 'ghost' is listed in shard", "absent"}));
}

TEST_F(SafetensorsIndexTest, TensorInTwoShards) {
  write_checkpoint(path("other"), {{"a", DType::U8, {1}}}, fill_pattern);
  fs::copy_file(path("other/model.safetensors"), path("extra.safetensors"));
  index_["weight_map"]["z"] = "extra.safetensors";
  WriteIndex();
  EXPECT_TRUE(ThrowsMdError([&] { Checkpoint c(dir_); },
                            {"tensor 'a' is present in two shards", kShard1, "extra.safetensors"}));
}

TEST_F(SafetensorsIndexTest, UnsafeShardNames) {
  for (const char* bad : {"../model-00001-of-00003.safetensors", "sub/x.safetensors", "..", "",
                          "/etc/passwd", "a\\b"}) {
    index_["weight_map"]["a"] = bad;
    EXPECT_TRUE(Fails({"is not a plain file name", "tensor 'a'"})) << bad;
  }
}

TEST_F(SafetensorsIndexTest, MalformedIndex) {
  write("model.safetensors.index.json", "{\"weight_map\": ");
  EXPECT_TRUE(ThrowsMdError([&] { Checkpoint c(dir_); }, {"index.json", "invalid JSON"}));
  write("model.safetensors.index.json", R"({"weight_map": {"a": "x", "a": "y"}})");
  EXPECT_TRUE(ThrowsMdError([&] { Checkpoint c(dir_); }, {"duplicate key 'a'"}));
  index_ = json::array();
  EXPECT_TRUE(Fails({"must be a JSON object"}));
  index_ = {{"metadata", json::object()}};
  EXPECT_TRUE(Fails({"no \"weight_map\""}));
  index_ = {{"weight_map", json::array()}};
  EXPECT_TRUE(Fails({"\"weight_map\" must be an object"}));
  index_ = {{"weight_map", json::object()}};
  EXPECT_TRUE(Fails({"\"weight_map\" is empty"}));
  index_ = {{"weight_map", {{"a", 5}}}};
  EXPECT_TRUE(Fails({"weight_map entry of tensor 'a' must be a file name"}));
  index_ = {{"weight_map", {{"a", kShard1}}}, {"metadata", 3}};
  EXPECT_TRUE(Fails({"\"metadata\" must be an object"}));
}

TEST_F(SafetensorsIndexTest, IndexWinsOverLooseFiles) {
  // A stray file not named by the index is not loaded.
  write("stray.safetensors", "junk");
  Checkpoint ck(dir_);
  EXPECT_EQ(ck.tensors().size(), 3u);
  for (const auto& s : specs_) expect_pattern(ck.get(s.name), s);
}

// ---- robustness ----

// A small valid file: metadata, three tensors, a data section.
std::string fuzz_seed() {
  json h = json::object();
  h["__metadata__"] = {{"format", "pt"}};
  h["a"] = {{"dtype", "BF16"}, {"shape", {2, 3}}, {"data_offsets", {0, 12}}};
  h["b"] = {{"dtype", "U8"}, {"shape", {5}}, {"data_offsets", {12, 17}}};
  h["c"] = {{"dtype", "I64"}, {"shape", json::array()}, {"data_offsets", {24, 32}}};
  std::string data(32, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  return make_file(h.dump(), data);
}

// The length field, or 0 for a file too short to have one.
template <typename Bytes>
uint64_t header_len(const Bytes& f) {
  uint64_t n = 0;
  if (f.size() < 8) return 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(f[i]);
  return n;
}

// Replaces the header text, keeping the data section and fixing the length field.
std::string with_header(const std::string& f, const std::string& header) {
  const uint64_t n = header_len(f);
  return le64(header.size()) + header + f.substr(std::min<uint64_t>(f.size(), 8 + n));
}

json interesting_value(Rng& rng) {
  static const json kValues[] = {-1,
                                 0,
                                 1,
                                 2,
                                 3,
                                 5,
                                 7,
                                 12,
                                 17,
                                 24,
                                 32,
                                 33,
                                 int64_t{1} << 31,
                                 int64_t{1} << 32,
                                 uint64_t{1} << 63,
                                 ~uint64_t{0},
                                 1.5,
                                 "x",
                                 "F32",
                                 "BF16",
                                 "U8",
                                 "F8_E4M3",
                                 nullptr,
                                 true,
                                 json::array(),
                                 json::object(),
                                 json::array({0}),
                                 json::array({0, 0}),
                                 json::array({1, 2, 3}),
                                 json::array({12, 17}),
                                 json::array({0, 12})};
  return kValues[rng.next() % std::size(kValues)];
}

std::string mutate_once(const std::string& f, Rng& rng) {
  std::string out = f;
  const uint64_t n = header_len(f);
  const bool header_ok = f.size() >= 8 && n > 0 && n <= f.size() - 8;
  const std::string header = header_ok ? f.substr(8, n) : "";
  switch (rng.next() % 12) {
    case 0:  // flip a bit of the length field
      if (out.size() >= 8) out[rng.next() % 8] ^= static_cast<char>(1 << (rng.next() % 8));
      break;
    case 1:  // length field slightly off
      return le64(n + rng.next() % 33 - 16) + (f.size() >= 8 ? f.substr(8) : "");
    case 2:  // random bytes in the header
      for (int k = 0, m = 1 + rng.next() % 4; k < m && header_ok; ++k) {
        out[8 + rng.next() % n] = static_cast<char>(rng.next());
      }
      break;
    case 3:  // truncation
      out.resize(rng.next() % (f.size() + 1));
      break;
    case 4: {  // JSON punctuation or digit in place of a header character
      static const char kChars[] = "{}[],:\"0123456789-.eE _\\";
      if (header_ok) out[8 + rng.next() % n] = kChars[rng.next() % (sizeof(kChars) - 1)];
      break;
    }
    case 5: {  // delete or duplicate a span of header text
      if (!header_ok) break;
      std::string h = header;
      const size_t pos = rng.next() % h.size(), len = 1 + rng.next() % 16;
      if (rng.next() % 2) {
        h.erase(pos, len);
      } else {
        h.insert(pos, h.substr(pos, len));
      }
      return with_header(f, h);
    }
    case 6:
    case 7:
    case 8: {  // structural edit of a parsed header
      json h = json::parse(header, nullptr, false);
      if (!h.is_object() || h.empty()) break;
      auto it = h.begin();
      std::advance(it, rng.next() % h.size());
      json& entry = it.value();
      static const char* const kFields[] = {"dtype",        "shape",        "shape",
                                            "data_offsets", "data_offsets", "extra"};
      const char* field = kFields[rng.next() % std::size(kFields)];
      const uint64_t r = rng.next() % 4;
      if (!entry.is_object()) {
        entry = interesting_value(rng);
      } else if (r == 0) {
        entry.erase(field);
      } else if (r == 1 && entry.contains(field) && entry[field].is_array() &&
                 !entry[field].empty()) {
        entry[field][rng.next() % entry[field].size()] = interesting_value(rng);
      } else {
        entry[field] = interesting_value(rng);
      }
      return with_header(f, h.dump());
    }
    case 9:
    case 10: {  // move a tensor, keeping its size: often valid, sometimes overlapping
      json h = json::parse(header, nullptr, false);
      if (!h.is_object() || h.empty()) break;
      auto it = h.begin();
      std::advance(it, rng.next() % h.size());
      json& entry = it.value();
      if (!entry.is_object() || !entry.contains("data_offsets")) break;
      json& off = entry["data_offsets"];
      if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
          !off[1].is_number_unsigned()) {
        break;
      }
      const uint64_t size = off[1].get<uint64_t>() - off[0].get<uint64_t>();
      const uint64_t begin = rng.next() % 40;
      off = {begin, begin + size};
      return with_header(f, h.dump());
    }
    case 11: {  // a duplicated tensor key, or a changed data section length
      if (header_ok && rng.next() % 2 && header.size() > 2) {
        return with_header(f, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}," +
                                  header.substr(1));
      }
      if (rng.next() % 2) {
        out.append(rng.next() % 16, '\0');
      } else if (out.size() > 0) {
        out.resize(out.size() - 1 - rng.next() % std::min<size_t>(out.size(), 16));
      }
      break;
    }
  }
  return out;
}

volatile unsigned g_sink;  // keeps the reads in check_invariants from being optimized away

// Everything a successful parse promises: tensors inside the data section, sizes consistent with
// shapes, and no overlap. Reading every byte lets ASan catch an out-of-bounds pointer.
void check_invariants(const std::vector<uint8_t>& f, const SafetensorsContents& c) {
  const uint8_t* begin = f.data();
  const uint8_t* data_start = begin + 8 + header_len(f);
  const uint8_t* end = begin + f.size();
  unsigned sum = 0;
  for (const auto& [name, t] : c.tensors) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    ASSERT_TRUE(p >= data_start && p <= end && t.nbytes <= static_cast<size_t>(end - p)) << name;
    ASSERT_EQ(t.nbytes, static_cast<size_t>(t.numel()) * dtype_size(t.dtype)) << name;
    for (size_t i = 0; i < t.nbytes; ++i) sum += p[i];
    for (const auto& [name2, u] : c.tensors) {
      if (name2 <= name || t.nbytes == 0 || u.nbytes == 0) continue;
      const auto* q = static_cast<const uint8_t*>(u.data);
      ASSERT_TRUE(p + t.nbytes <= q || q + u.nbytes <= p) << name << " overlaps " << name2;
    }
  }
  g_sink = sum;
}

TEST_F(SafetensorsTest, FuzzMutationsLoadOrThrowMdError) {
  const std::string seed = fuzz_seed();
  ASSERT_EQ(parse(seed).tensors.size(), 3u);
  Rng rng(20240601);
  int ok = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string f = seed;
    for (int k = 0, m = rng.next() % 4 ? 1 : 2; k < m; ++k) f = mutate_once(f, rng);
    // Heap copies of exact size, so that ASan sees any read past the end.
    const std::vector<uint8_t> buf(f.begin(), f.end());
    try {
      const auto c = parse_safetensors_buffer(buf.data(), buf.size(), "fuzz");
      check_invariants(buf, c);
      ++ok;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iter << ": non-md::Error " << e.what();
    }
    if (iter % 50 == 0) {  // the file path too: mapping, including empty and truncated files
      const std::string p = write("fuzz.safetensors", f);
      try {
        SafetensorsFile sf(p);
        EXPECT_EQ(sf.tensors().size(), parse(f).tensors.size());
      } catch (const Error&) {
      } catch (const std::exception& e) {
        ADD_FAILURE() << "iteration " << iter << ": non-md::Error " << e.what();
      }
    }
    if (HasFailure()) break;
  }
  // Both outcomes must be common, or the mutations are not exercising the validator.
  EXPECT_GT(ok, 100);
  EXPECT_GT(rejected, 1000);
}

}  // namespace
}  // namespace md
