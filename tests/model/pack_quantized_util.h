// Helpers of the pack-quantized checkpoint tests (test_pack_quantized.cpp,
// test_pack_quantized_layouts.cpp): golden models, `megadecode quantize`, rewriting a
// checkpoint's config and tensors, logits through the reference path.
#pragma once
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megadecode/engine/model.h"
#include "megadecode/model/safetensors.h"
#include "test_util.h"

namespace md::test {

inline ModelOptions plain(Precision p) {
  ModelOptions o;
  o.precision = p;
  o.threads = 1;
  o.pin_threads = false;
  return o;
}

inline std::string golden_dir(const std::string& name) {
  return test::data_dir() + "/data/golden/" + name;
}

inline std::vector<int32_t> prompt_of(const std::string& dir) {
  std::ifstream f(dir + "/golden.json");
  const nlohmann::json g = nlohmann::json::parse(f);
  std::vector<int32_t> ids;
  for (auto& v : g["prompt_ids"]) ids.push_back(v.get<int32_t>());
  return ids;
}

inline std::vector<float> logits_of(Model& m, const std::vector<int32_t>& prompt) {
  std::vector<float> out(prompt.size() * size_t(m.config().vocab_size));
  SequenceState s = m.new_sequence();
  m.forward(s, prompt, out.data(), /*all_positions=*/true);
  return out;
}

// `megadecode quantize` of a golden model into dir (group -1: the scheme's default).
inline void write_quantized(const std::string& model, const std::string& dir, int group,
                            const std::string& scheme = "int4") {
  const auto r = test::run_cli("quantize --model " + model + " --out " + dir + " --scheme " +
                               scheme + " --quant-group " + std::to_string(group));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, ::testing::HasSubstr("matrices in " + scheme));
}

// A copy of the checkpoint in `src` at `dst` with config.json edited and its tensors rewritten:
// each of src's tensors goes through `tensor` (which may add, replace or drop: it returns the
// specs and fills them), every other file copied.
inline void rewrite_checkpoint(
    const std::string& src, const std::string& dst,
    const std::function<void(nlohmann::json&)>& edit_config,
    const std::function<void(const std::string&, const TensorInfo&, std::vector<TensorSpec>&,
                             std::map<std::string, std::vector<uint8_t>>&)>& tensor) {
  const Checkpoint ck(src);
  std::vector<TensorSpec> specs;
  std::map<std::string, std::vector<uint8_t>> data;
  for (const auto& [name, t] : ck.tensors()) tensor(name, t, specs, data);
  std::stable_sort(specs.begin(), specs.end(), [](const TensorSpec& a, const TensorSpec& b) {
    return dtype_size(a.dtype) > dtype_size(b.dtype);
  });
  std::filesystem::create_directories(dst);
  write_checkpoint(dst, specs, [&](const TensorSpec& sp, uint8_t* out) {
    const std::vector<uint8_t>& v = data.at(sp.name);
    std::memcpy(out, v.data(), v.size());
  });
  std::ifstream in(src + "/config.json");
  nlohmann::json c = nlohmann::json::parse(in);
  edit_config(c);
  std::ofstream(dst + "/config.json") << c.dump(2);
  for (const auto& e : std::filesystem::directory_iterator(src)) {
    const std::string n = e.path().filename().string();
    if (n != "config.json" && e.path().extension() != ".safetensors" &&
        n != "model.safetensors.index.json")
      std::filesystem::copy_file(e.path(), std::filesystem::path(dst) / n,
                                 std::filesystem::copy_options::overwrite_existing);
  }
}

// The largest |y - ref| over the rms of ref.
inline double max_gap(const std::vector<float>& y, const std::vector<float>& ref) {
  double ss = 0, d = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    ss += double(ref[i]) * ref[i];
    d = std::max(d, std::fabs(double(y[i]) - ref[i]));
  }
  return d / std::sqrt(ss / double(y.size()));
}

}  // namespace md::test
