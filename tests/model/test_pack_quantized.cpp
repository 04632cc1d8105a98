// compressed-tensors checkpoints with quantized linears (pack-quantized int4 / int8,
// mxfp4-pack-quantized): `megadecode quantize --scheme` writes one from a bf16 checkpoint and the
// loader (model/binder.h Binder::linear, config.cpp) reads it back to the same bits as
// `--quantize SCHEME` on the original; the packed codes follow compressed-tensors'
// pack_to_int32 definition (checked here from the original bf16 weights, independently of the
// quantizer); the config is the format's; bad configs and tensors are errors naming the problem.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/util.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/dist/communicator.h"
#include "megadecode/dist/shard.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cuda/sim.h"
#include "megadecode/model/safetensors.h"
#include "test_util.h"

namespace md {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

ModelOptions plain(Precision p) {
  ModelOptions o;
  o.precision = p;
  o.threads = 1;
  o.pin_threads = false;
  return o;
}

std::string golden_dir(const std::string& name) {
  return test::data_dir() + "/data/golden/" + name;
}

std::vector<int32_t> prompt_of(const std::string& dir) {
  std::ifstream f(dir + "/golden.json");
  const nlohmann::json g = nlohmann::json::parse(f);
  std::vector<int32_t> ids;
  for (auto& v : g["prompt_ids"]) ids.push_back(v.get<int32_t>());
  return ids;
}

std::vector<float> logits_of(Model& m, const std::vector<int32_t>& prompt) {
  std::vector<float> out(prompt.size() * size_t(m.config().vocab_size));
  SequenceState s = m.new_sequence();
  m.forward(s, prompt, out.data(), /*all_positions=*/true);
  return out;
}

// `megadecode quantize` of a golden model into dir (group -1: the scheme's default).
void write_quantized(const std::string& model, const std::string& dir, int group,
                     const std::string& scheme = "int4") {
  const auto r = test::run_cli("quantize --model " + model + " --out " + dir + " --scheme " +
                               scheme + " --quant-group " + std::to_string(group));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("matrices in " + scheme));
}

TEST(PackQuantized, AWrittenCheckpointLoadsBackToTheSameBitsAsQuantizingAtLoad) {
  struct Case {
    const char* model;
    QuantScheme scheme;
    int group;
  };
  for (const Case& c : {Case{"tiny", QuantScheme::kInt4, 32}, Case{"tiny", QuantScheme::kInt4, 0},
                        Case{"tiny", QuantScheme::kInt8, 64}, Case{"tiny", QuantScheme::kMxfp4, -1},
                        Case{"small", QuantScheme::kInt4, 32}, Case{"small", QuantScheme::kInt8, 0},
                        Case{"small", QuantScheme::kMxfp4, -1}}) {
    {
      const std::string name = c.model, scheme(quant_scheme_name(c.scheme));
      SCOPED_TRACE(name + " " + scheme + " group " + std::to_string(c.group));
      test::TempDir d("pack_quantized");
      const std::string src = golden_dir(name), out = d / "q";
      write_quantized(src, out, c.group, scheme);
      const std::vector<int32_t> prompt = prompt_of(src);
      for (Precision p : {Precision::BF16, Precision::FP32}) {
        ModelOptions at_load = plain(p);
        at_load.quantize.scheme = c.scheme;
        at_load.quantize.group = c.group;
        Model want(src, at_load);
        Model got(out, plain(p));
        ASSERT_GT(want.quantize_report().matrices, 0);
        // Nothing to do at load: it is quantized already, in the same format.
        EXPECT_EQ(got.quantize_report().matrices, 0);
        EXPECT_EQ(got.config().linear_quant, quant_format(c.scheme));
        EXPECT_EQ(got.config().quant_group, effective_quant_group(c.scheme, c.group));
        EXPECT_TRUE(quantized_outside_experts(got.weights()));
        const std::vector<float> a = logits_of(want, prompt), b = logits_of(got, prompt);
        ASSERT_EQ(a.size(), b.size());
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
        // The plan executors read the loaded int4 matrices as they read quantized ones.
        ExecutorOptions eo;
        eo.workers = 2;
        eo.pin = false;
        const int64_t V = got.config().vocab_size;
        std::vector<float> x(static_cast<size_t>(V)), y(static_cast<size_t>(V));
        CpuExecutor ea(want, 1, ExecutorKind::kMegakernel, eo), eb(got, 1, ExecutorKind::kMegakernel, eo);
        SequenceState sa = ea.new_sequence(), sb = eb.new_sequence();
        ea.prefill(sa, prompt, x.data(), 8);
        eb.prefill(sb, prompt, y.data(), 8);
        EXPECT_EQ(std::memcmp(x.data(), y.data(), size_t(V) * 4), 0);
      }
    }
  }
}

// The config and the tensors are compressed-tensors' pack-quantized format: checked field by
// field, and every packed int32 against pack_to_int32's definition applied to the original bf16
// weights (q = clamp(round_half_even(w / scale), -8, 7); code q + 8 of column 8j + i in bits
// 4i..4i+3 of int32 j), with the written scales.
TEST(PackQuantized, TheCheckpointIsCompressedTensorsFormat) {
  test::TempDir d("pack_format");
  const std::string src = golden_dir("tiny"), out = d / "q";
  write_quantized(src, out, 32);
  std::ifstream f(out + "/config.json");
  const nlohmann::json c = nlohmann::json::parse(f);
  const nlohmann::json& q = c["quantization_config"];
  EXPECT_EQ(q["quant_method"], "compressed-tensors");
  EXPECT_EQ(q["format"], "pack-quantized");
  EXPECT_EQ(q["quantization_status"], "compressed");
  const nlohmann::json& g = q["config_groups"]["group_0"];
  EXPECT_EQ(g["targets"], nlohmann::json::array({"Linear"}));
  EXPECT_EQ(g["weights"]["num_bits"], 4);
  EXPECT_EQ(g["weights"]["type"], "int");
  EXPECT_EQ(g["weights"]["symmetric"], true);
  EXPECT_EQ(g["weights"]["strategy"], "group");
  EXPECT_EQ(g["weights"]["group_size"], 32);
  EXPECT_TRUE(g["input_activations"].is_null());
  const std::vector<std::string> ignore = q["ignore"].get<std::vector<std::string>>();
  EXPECT_THAT(ignore, ::testing::Contains("model.layers.1.block_sparse_moe.gate"));
  EXPECT_THAT(ignore, ::testing::Contains("lm_head"));

  const Checkpoint orig(src), packed(out);
  int modules = 0;
  for (const auto& [name, t] : packed.tensors()) {
    const size_t at = name.rfind(".weight_packed");
    if (at == std::string::npos || at + 14 != name.size()) continue;
    const std::string module = name.substr(0, at);
    SCOPED_TRACE(module);
    ++modules;
    ASSERT_EQ(t.dtype, DType::I32);
    const TensorInfo& w = orig.get(module + ".weight");
    const TensorInfo& s = packed.get(module + ".weight_scale");
    const TensorInfo& sh = packed.get(module + ".weight_shape");
    ASSERT_EQ(sh.dtype, DType::I64);
    const auto* shape = static_cast<const int64_t*>(sh.data);
    ASSERT_EQ(shape[0], w.shape[0]);
    ASSERT_EQ(shape[1], w.shape[1]);
    EXPECT_FALSE(packed.find(module + ".weight"));
    const int64_t rows = w.shape[0], cols = w.shape[1], groups = cols / 32;
    ASSERT_EQ(s.shape, (std::vector<int64_t>{rows, groups}));
    const auto* wv = static_cast<const bf16*>(w.data);
    const auto* sv = static_cast<const bf16*>(s.data);
    const auto* pv = static_cast<const int32_t*>(t.data);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols / 8; ++j) {
        uint32_t want = 0;
        for (int i = 0; i < 8; ++i) {
          const int64_t col = 8 * j + i;
          const float scale = bf16_to_f32(sv[r * groups + col / 32]);
          const float x = bf16_to_f32(wv[r * cols + col]) / scale;
          const int qv = int(std::clamp(std::nearbyint(x), -8.0f, 7.0f));
          want |= uint32_t(qv + 8) << (4 * i);
        }
        ASSERT_EQ(uint32_t(pv[r * (cols / 8) + j]), want) << "row " << r << " int32 " << j;
      }
  }
  EXPECT_GT(modules, 50);
}

// int8 (pack-quantized, 8 bits) and MXFP4 (mxfp4-pack-quantized) checkpoints: the config fields,
// and every code against the format's definition applied to the original bf16 weights, written
// out here independently of the quantizers: int8 q = clamp(round_half_even(w / s), -128, 127)
// with s = bf16(max|w| / 127.5), byte i of int32 j = q + 128 of column 4j + i; MXFP4 scale
// e + 125 where 2^e is max|w| rounded to a power of two (1.75 * 2^k and up round up), code = the
// nearest e2m1 magnitude of w / 2^(e - 2) (ties to the even code, > 5 saturating to 6) with the
// sign in bit 3 (none on zero), low nibble first.
TEST(PackQuantized, Int8AndMxfp4CheckpointsAreTheFormat) {
  const std::string src = golden_dir("tiny");
  const Checkpoint orig(src);
  {
    test::TempDir d("int8_format");
    const std::string out = d / "q";
    write_quantized(src, out, 64, "int8");
    std::ifstream f(out + "/config.json");
    const nlohmann::json q = nlohmann::json::parse(f)["quantization_config"];
    EXPECT_EQ(q["format"], "pack-quantized");
    EXPECT_EQ(q["config_groups"]["group_0"]["weights"]["num_bits"], 8);
    EXPECT_EQ(q["config_groups"]["group_0"]["weights"]["type"], "int");
    EXPECT_EQ(q["config_groups"]["group_0"]["weights"]["group_size"], 64);
    const Checkpoint packed(out);
    int modules = 0;
    for (const auto& [name, t] : packed.tensors()) {
      const size_t at = name.rfind(".weight_packed");
      if (at == std::string::npos || at + 14 != name.size()) continue;
      const std::string module = name.substr(0, at);
      SCOPED_TRACE(module);
      ++modules;
      const TensorInfo& w = orig.get(module + ".weight");
      const TensorInfo& s = packed.get(module + ".weight_scale");
      const int64_t rows = w.shape[0], cols = w.shape[1], groups = cols / 64;
      ASSERT_EQ(t.dtype, DType::I32);
      ASSERT_EQ(t.shape, (std::vector<int64_t>{rows, cols / 4}));
      ASSERT_EQ(s.shape, (std::vector<int64_t>{rows, groups}));
      const auto* wv = static_cast<const bf16*>(w.data);
      const auto* sv = static_cast<const bf16*>(s.data);
      const auto* pv = static_cast<const int32_t*>(t.data);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          double amax = 0;
          for (int64_t k = g * 64; k < g * 64 + 64; ++k)
            amax = std::max(amax, std::fabs(double(bf16_to_f32(wv[r * cols + k]))));
          ASSERT_EQ(bf16_to_f32(sv[r * groups + g]), round_bf16(float(amax / 127.5)));
        }
        for (int64_t j = 0; j < cols / 4; ++j) {
          uint32_t want = 0;
          for (int i = 0; i < 4; ++i) {
            const int64_t col = 4 * j + i;
            const float x = bf16_to_f32(wv[r * cols + col]) / bf16_to_f32(sv[r * groups + col / 64]);
            const int qv = int(std::clamp(std::nearbyint(x), -128.0f, 127.0f));
            want |= uint32_t(qv + 128) << (8 * i);
          }
          ASSERT_EQ(uint32_t(pv[r * (cols / 4) + j]), want) << "row " << r << " int32 " << j;
        }
      }
    }
    EXPECT_GT(modules, 50);
  }
  {
    test::TempDir d("mxfp4_format");
    const std::string out = d / "q";
    write_quantized(src, out, -1, "mxfp4");
    std::ifstream f(out + "/config.json");
    const nlohmann::json q = nlohmann::json::parse(f)["quantization_config"];
    EXPECT_EQ(q["format"], "mxfp4-pack-quantized");
    const nlohmann::json& w = q["config_groups"]["group_0"]["weights"];
    EXPECT_EQ(w["num_bits"], 4);
    EXPECT_EQ(w["type"], "float");
    EXPECT_EQ(w["group_size"], 32);
    EXPECT_EQ(w["scale_dtype"], "torch.uint8");
    const double grid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    const Checkpoint packed(out);
    int modules = 0;
    for (const auto& [name, t] : packed.tensors()) {
      const size_t at = name.rfind(".weight_packed");
      if (at == std::string::npos || at + 14 != name.size()) continue;
      const std::string module = name.substr(0, at);
      SCOPED_TRACE(module);
      ++modules;
      const TensorInfo& wt = orig.get(module + ".weight");
      const TensorInfo& s = packed.get(module + ".weight_scale");
      EXPECT_FALSE(packed.find(module + ".weight_shape"));
      const int64_t rows = wt.shape[0], cols = wt.shape[1];
      ASSERT_EQ(t.dtype, DType::U8);
      ASSERT_EQ(s.dtype, DType::U8);
      ASSERT_EQ(t.shape, (std::vector<int64_t>{rows, cols / 2}));
      ASSERT_EQ(s.shape, (std::vector<int64_t>{rows, cols / 32}));
      const auto* wv = static_cast<const bf16*>(wt.data);
      const auto* sv = static_cast<const uint8_t*>(s.data);
      const auto* pv = static_cast<const uint8_t*>(t.data);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < cols / 32; ++g) {
          double amax = 0;
          for (int64_t k = g * 32; k < g * 32 + 32; ++k)
            amax = std::max(amax, std::fabs(double(bf16_to_f32(wv[r * cols + k]))));
          ASSERT_GT(amax, 0);  // (random weights)
          int e = int(std::floor(std::log2(amax)));
          if (amax / std::ldexp(1.0, e) >= 1.75) ++e;
          const int scale = e + 125;
          ASSERT_EQ(int(sv[r * (cols / 32) + g]), scale) << "row " << r << " group " << g;
          for (int64_t k = g * 32; k < g * 32 + 32; ++k) {
            const double v = double(bf16_to_f32(wv[r * cols + k])) / std::ldexp(1.0, scale - 127);
            int best = 0;
            for (int m = 1; m < 8; ++m) {
              const double dm = std::fabs(std::fabs(v) - grid[m]),
                           db = std::fabs(std::fabs(v) - grid[best]);
              if (dm < db || (dm == db && m % 2 == 0)) best = m;
            }
            const int want = best != 0 && v < 0 ? best | 8 : best;
            const uint8_t byte = pv[r * (cols / 2) + k / 2];
            ASSERT_EQ(k % 2 ? byte >> 4 : byte & 15, want) << "row " << r << " col " << k;
          }
        }
    }
    EXPECT_GT(modules, 50);
  }
}

// A copy of the checkpoint in `src` at `dst` with config.json edited and its tensors rewritten:
// each of src's tensors goes through `tensor` (which may add, replace or drop: it returns the
// specs and fills them), every other file copied.
void rewrite_checkpoint(
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
  fs::create_directories(dst);
  write_checkpoint(dst, specs, [&](const TensorSpec& sp, uint8_t* out) {
    const std::vector<uint8_t>& v = data.at(sp.name);
    std::memcpy(out, v.data(), v.size());
  });
  std::ifstream in(src + "/config.json");
  nlohmann::json c = nlohmann::json::parse(in);
  edit_config(c);
  std::ofstream(dst + "/config.json") << c.dump(2);
  for (const auto& e : fs::directory_iterator(src)) {
    const std::string n = e.path().filename().string();
    if (n != "config.json" && e.path().extension() != ".safetensors" &&
        n != "model.safetensors.index.json")
      fs::copy_file(e.path(), fs::path(dst) / n, fs::copy_options::overwrite_existing);
  }
}

// Asymmetric int4 (compressed-tensors pack-quantized with `symmetric: false`, the AWQ layout):
// weight_zero_point I32 [ceil(rows/8), groups] packed along the rows (pack_to_int32 with
// packed_dim 0: z + 8 of row 8i + k in bits 4k of int32 [i, g]); each weight is (q - z) * scale.
// The loader keeps the int4 codes in place and unpacks z (kernels/cpu/int4.h's zero-point
// terms). Its twin is the same model with every such matrix replaced by its fp32 values
// (c - zc) * scale, decoded in this test from the file's codes and the zero points it wrote: in
// FP32 precision the two differ only in each matmul's fp32 summation order, bounded as in
// test_quantize.cpp (|dlogit| <= 1e-4 rms). The plan executors are bit-identical to the
// reference path on it, and the CUDA executors (on the simulation: they upload it as int8 codes
// c - zc + 128) agree within the same bound.
TEST(PackQuantized, AsymmetricInt4RunsAsInt4WithZeroPointsAndMatchesItsDequantizedTwin) {
  test::TempDir d("pack_asym");
  const std::string src = golden_dir("tiny"), sym = d / "sym", asym = d / "asym";
  write_quantized(src, sym, 32);
  Rng rng(17);
  std::map<std::string, std::vector<uint8_t>> zcodes;  // module -> [rows, groups] codes 0..15
  auto is_packed = [](const std::string& n) {
    return n.size() > 14 && n.compare(n.size() - 14, 14, ".weight_packed") == 0;
  };
  auto copy = [](const std::string& name, const TensorInfo& t, std::vector<TensorSpec>& specs,
                 std::map<std::string, std::vector<uint8_t>>& data) {
    specs.push_back({name, t.dtype, t.shape});
    const auto* p = static_cast<const uint8_t*>(t.data);
    data[name].assign(p, p + t.nbytes);
  };
  rewrite_checkpoint(
      sym, asym,
      [](nlohmann::json& c) {
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = false;
      },
      [&](const std::string& name, const TensorInfo& t, std::vector<TensorSpec>& specs,
          std::map<std::string, std::vector<uint8_t>>& data) {
        copy(name, t, specs, data);
        if (!is_packed(name)) return;
        const std::string module = name.substr(0, name.size() - 14);
        const int64_t rows = t.shape[0], groups = t.shape[1] * 8 / 32;
        std::vector<uint8_t>& z = zcodes[module];
        z.resize(size_t(rows * groups));
        for (auto& v : z) v = uint8_t(rng.next() % 16);
        const int64_t zr = (rows + 7) / 8;
        std::vector<uint32_t> packed(size_t(zr * groups), 0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t g = 0; g < groups; ++g)
            packed[size_t((r / 8) * groups + g)] |= uint32_t(z[size_t(r * groups + g)])
                                                    << (4 * (r % 8));
        const std::string zn = module + ".weight_zero_point";
        specs.push_back({zn, DType::I32, {zr, groups}});
        data[zn].resize(packed.size() * 4);
        std::memcpy(data[zn].data(), packed.data(), packed.size() * 4);
      });
  Model a(asym, plain(Precision::FP32));
  EXPECT_TRUE(a.config().quant_asymmetric);
  EXPECT_EQ(a.config().linear_quant, WeightQuant::kInt4);
  {
    const std::string module = "model.layers.0.self_attn.q_proj";  // (tiny's layer 0 is KDA)
    const Mat& q = a.weights().layers[0].kda.q;
    EXPECT_TRUE(q.int4());
    EXPECT_EQ(q.data, a.checkpoint().find(module + ".weight_packed")->data);  // in place
    ASSERT_NE(q.zero_points, nullptr);
    const std::vector<uint8_t>& z = zcodes.at(module);
    for (size_t i = 0; i < z.size(); ++i) ASSERT_EQ(int(q.zero_points[i]), int(z[i]) - 8) << i;
    // A zero point a group more than the symmetric matrix.
    EXPECT_EQ(q.bytes(), size_t(q.rows) * size_t(q.cols / 2 + q.cols / 32 * 3));
  }
  // The dequantized twin: every asymmetric matrix replaced by its fp32 values (c - zc) * scale,
  // decoded here from the file's codes and this test's zero points.
  Model dq(asym, plain(Precision::FP32));
  {
    ModelWeights& w = dq.mutable_weights();
    int n = 0;
    auto fix = [&](Mat& m, const std::string& module) {
      if (!m.zero_points) return;
      const std::vector<uint8_t>& z = zcodes.at(module);
      const int64_t G = m.cols / m.group;
      auto buf = std::make_shared<std::vector<uint8_t>>(size_t(m.rows * m.cols) * 4);
      auto* out = reinterpret_cast<float*>(buf->data());
      const auto* sc = reinterpret_cast<const bf16*>(m.scales);
      for (int64_t r = 0; r < m.rows; ++r)
        for (int64_t k = 0; k < m.cols; ++k) {
          const uint8_t byte = m.packed_data()[r * (m.cols / 2) + k / 2];
          const int c = k % 2 ? byte >> 4 : byte & 15;
          out[r * m.cols + k] =
              float(c - int(z[size_t(r * G + k / m.group)])) * bf16_to_f32(sc[r * G + k / m.group]);
        }
      Mat f;
      f.data = out;
      f.dtype = DType::F32;
      f.rows = m.rows;
      f.cols = m.cols;
      m = f;
      w.owned.push_back(buf);
      ++n;
    };
    // (tiny: KDA and MLA attention, a dense layer 0 FFN and MoE layers; the module names are
    // the checkpoint's.)
    for (size_t l = 0; l < w.layers.size(); ++l) {
      LayerWeights& L = w.layers[l];
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (auto [m, name] : {std::pair{&L.kda.q, "self_attn.q_proj"},
                             {&L.kda.k, "self_attn.k_proj"},
                             {&L.kda.v, "self_attn.v_proj"},
                             {&L.kda.o, "self_attn.o_proj"},
                             {&L.kda.f_a, "self_attn.f_a_proj"},
                             {&L.kda.f_b, "self_attn.f_b_proj"},
                             {&L.kda.g_a, "self_attn.g_a_proj"},
                             {&L.kda.g_b, "self_attn.g_b_proj"},
                             {&L.kda.b, "self_attn.b_proj"},
                             {&L.mla.q, "self_attn.q_proj"},
                             {&L.mla.kv_a, "self_attn.kv_a_proj_with_mqa"},
                             {&L.mla.o, "self_attn.o_proj"},
                             {&L.dense.gate, "mlp.gate_proj"},
                             {&L.dense.up, "mlp.up_proj"},
                             {&L.dense.down, "mlp.down_proj"},
                             {&L.moe.shared.gate, "block_sparse_moe.shared_experts.gate_proj"},
                             {&L.moe.shared.up, "block_sparse_moe.shared_experts.up_proj"},
                             {&L.moe.shared.down, "block_sparse_moe.shared_experts.down_proj"}})
        fix(*m, p + name);
      for (size_t e = 0; e < L.moe.experts.size(); ++e) {
        const std::string ep = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
        fix(L.moe.experts[e].gate, ep + "w1");
        fix(L.moe.experts[e].down, ep + "w2");
        fix(L.moe.experts[e].up, ep + "w3");
      }
    }
    EXPECT_EQ(n, int(zcodes.size()));  // every asymmetric matrix
  }
  const std::vector<int32_t> prompt = prompt_of(src);
  auto max_gap = [](const std::vector<float>& y, const std::vector<float>& ref) {
    double ss = 0, d = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      ss += double(ref[i]) * ref[i];
      d = std::max(d, std::fabs(double(y[i]) - ref[i]));
    }
    return d / std::sqrt(ss / double(y.size()));  // in units of the reference's rms
  };
  const std::vector<float> ya = logits_of(a, prompt), yd = logits_of(dq, prompt);
  ASSERT_EQ(ya.size(), yd.size());
  EXPECT_LE(max_gap(ya, yd), 1e-4);
  // The zero points matter: the symmetric checkpoint's logits differ by far more.
  Model s(sym, plain(Precision::FP32));
  EXPECT_GT(max_gap(logits_of(s, prompt), yd), 1e-2);

  // Token by token through the reference path (Model::forward).
  auto stepwise = [&](Model& m) {
    std::vector<float> y(prompt.size() * size_t(m.config().vocab_size));
    SequenceState st = m.new_sequence();
    for (size_t i = 0; i < prompt.size(); ++i)
      m.forward(st, std::span(prompt.data() + i, 1), y.data() + i * size_t(m.config().vocab_size),
                false);
    return y;
  };
  const int64_t V = a.config().vocab_size;
  // The CUDA executors on the simulation (FP32: the same weights as int8 codes, another fp32
  // summation order: test_cuda_quantized.cpp's 1e-4 of the logits' scale), bit for bit with each
  // other.
  {
    const std::vector<float> want = stepwise(a);
    cuda::sim::Config saved = cuda::sim::config();
    cuda::sim::config().sm_count = 3;
    std::vector<std::vector<float>> outs;
    for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
      CudaExecutor ex(a, 1, kind, CudaTarget::kSim);
      SequenceState st = ex.new_sequence();
      std::vector<float> got(prompt.size() * size_t(V));
      for (size_t i = 0; i < prompt.size(); ++i) {
        SequenceState* seqs[] = {&st};
        ex.step(seqs, std::span(&prompt[i], 1), got.data() + i * size_t(V));
        double scale = 0, err = 0;
        for (int64_t j = 0; j < V; ++j) {
          const size_t k = i * size_t(V) + size_t(j);
          scale = std::max(scale, double(std::fabs(want[k])));
          err = std::max(err, double(std::fabs(got[k] - want[k])));
        }
        EXPECT_LE(err, 1e-4 * scale)
            << executor_name(kind) << " on the CUDA simulation, step " << i;
      }
      outs.push_back(std::move(got));
    }
    EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * 4));
    cuda::sim::config() = saved;
  }
  // BF16: both CPU plan executors bit for bit with the reference path (batch 2).
  Model b(asym, plain(Precision::BF16));
  const std::vector<float> want = stepwise(b);
  for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
    CpuExecutor ex(b, 2, 2, kind);
    SequenceState s0 = ex.new_sequence(), s1 = ex.new_sequence();
    std::vector<float> out(2 * size_t(V));
    for (size_t i = 0; i < prompt.size(); ++i) {
      std::vector<SequenceState*> seqs = {&s0, &s1};
      std::vector<int32_t> toks = {prompt[i], prompt[(i + 3) % prompt.size()]};
      ex.step(seqs, toks, out.data());
      ASSERT_EQ(0, std::memcmp(out.data(), want.data() + i * size_t(V), size_t(V) * 4))
          << executor_name(kind) << " step " << i;
    }
  }

  // Errors: asymmetric 8-bit, a zero point tensor of the wrong shape, zero points in a symmetric
  // checkpoint.
  auto error_of = [](const std::string& dir) -> std::string {
    try {
      Model m(dir, plain(Precision::BF16));
    } catch (const Error& err) {
      return err.what();
    }
    return "(loaded)";
  };
  const std::string cfg = asym + "/config.json";
  std::ifstream in(cfg);
  const nlohmann::json good = nlohmann::json::parse(in);
  nlohmann::json bad = good;
  bad["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8;
  std::ofstream(cfg) << bad.dump();
  EXPECT_THAT(error_of(asym), HasSubstr("asymmetric 8-bit"));
  bad = good;
  bad["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = true;
  std::ofstream(cfg) << bad.dump();
  EXPECT_THAT(error_of(asym), HasSubstr("weight_zero_point is present, but the config says symmetric"));
  std::ofstream(cfg) << good.dump();
  EXPECT_EQ(error_of(asym), "(loaded)");
  EXPECT_THAT(error_of(sym + "/../nonexistent"), HasSubstr("does not exist"));
}

TEST(PackQuantized, BadConfigsAndTensorsAreErrorsNamingTheProblem) {
  test::TempDir d("pack_bad");
  const std::string src = golden_dir("tiny"), out = d / "q";
  write_quantized(src, out, 32);
  const std::string cfg_path = out + "/config.json";
  std::ifstream f(cfg_path);
  const nlohmann::json good = nlohmann::json::parse(f);
  auto load_with = [&](const std::function<void(nlohmann::json&)>& edit) -> std::string {
    nlohmann::json c = good;
    edit(c);
    std::ofstream(cfg_path) << c.dump();
    try {
      Model m(out, plain(Precision::BF16));
    } catch (const Error& e) {
      return e.what();
    }
    return "(loaded)";
  };
  auto weights = [](nlohmann::json& c) -> nlohmann::json& {
    return c["quantization_config"]["config_groups"]["group_0"]["weights"];
  };
  // Asymmetric without zero points: the missing tensor is named.
  EXPECT_THAT(load_with([&](nlohmann::json& c) { weights(c)["symmetric"] = false; }),
              HasSubstr("missing tensor model.layers.0.self_attn.q_proj.weight_zero_point"));
  EXPECT_THAT(load_with([&](nlohmann::json& c) { weights(c)["num_bits"] = 2; }),
              HasSubstr("num_bits' is 2"));
  // 8 bits with the 4-bit tensors: the packed tensor's shape is named.
  EXPECT_THAT(load_with([&](nlohmann::json& c) { weights(c)["num_bits"] = 8; }),
              HasSubstr("weight_packed"));
  EXPECT_THAT(load_with([&](nlohmann::json& c) { weights(c)["group_size"] = 48; }),
              HasSubstr("multiple of 32"));
  EXPECT_THAT(load_with([&](nlohmann::json& c) { weights(c)["group_size"] = 64; }),
              HasSubstr("weight_scale"));  // the tensors hold groups of 32
  EXPECT_THAT(load_with([&](nlohmann::json& c) { weights(c)["strategy"] = "tensor"; }),
              HasSubstr("strategy"));
  EXPECT_THAT(load_with([&](nlohmann::json& c) { weights(c)["actorder"] = "group"; }),
              HasSubstr("activation-ordered"));
  EXPECT_THAT(load_with([&](nlohmann::json& c) {
                c["quantization_config"]["format"] = "naive-quantized";
              }),
              HasSubstr("unsupported quantization_config.format 'naive-quantized'"));
  // The ignore list decides which linears are int4: one it no longer names must be packed.
  auto without = [&](const std::string& module) {
    return [module](nlohmann::json& c) {
      auto& ig = c["quantization_config"]["ignore"];
      nlohmann::json kept = nlohmann::json::array();
      for (auto& e : ig)
        if (e != module) kept.push_back(e);
      ig = kept;
    };
  };
  EXPECT_THAT(load_with(without("model.layers.1.block_sparse_moe.gate")),
              HasSubstr("quantizes model.layers.1.block_sparse_moe.gate, which megadecode reads "
                        "as bf16"));
  EXPECT_THAT(load_with(without("lm_head")), HasSubstr("missing tensor lm_head.weight_packed"));
  EXPECT_EQ(load_with([](nlohmann::json&) {}), "(loaded)");
  // The CUDA executors run the checkpoint as loaded (here on the simulation, FP32 precision): a
  // step's logits within the fp32-reordering bound of the reference path (test_cuda_quantized.cpp).
  {
    Model m(out, plain(Precision::FP32));
    cuda::sim::Config saved = cuda::sim::config();
    cuda::sim::config().sm_count = 3;
    CudaExecutor ex(m, 1, ExecutorKind::kMegakernel, CudaTarget::kSim, ExecutorOptions{});
    const int64_t V = m.config().vocab_size;
    std::vector<float> got(static_cast<size_t>(V)), want(static_cast<size_t>(V));
    SequenceState r = m.new_sequence(), s = ex.new_sequence();
    for (int32_t tok : {5, 77, 3}) {
      m.forward(r, std::span(&tok, 1), want.data(), false);
      SequenceState* seqs[] = {&s};
      ex.step(seqs, std::span(&tok, 1), got.data());
      double scale = 0, err = 0;
      for (int64_t i = 0; i < V; ++i) {
        scale = std::max(scale, double(std::fabs(want[size_t(i)])));
        err = std::max(err, double(std::fabs(got[size_t(i)] - want[size_t(i)])));
      }
      EXPECT_LE(err, 1e-4 * scale) << "the CUDA simulation, token " << tok;
    }
    cuda::sim::config() = saved;
  }
  // What cannot run it yet says so: a distributed rank.
  dist::Shard shard;
  shard.layout = {2, 1};
  shard.rank = 0;
  const auto comm = dist::local_communicator();
  EXPECT_THROW(
      {
        try {
          Model part(out, plain(Precision::BF16), shard, comm.get());
        } catch (const Error& e) {
          EXPECT_THAT(e.what(), HasSubstr("does not run distributed"));
          throw;
        }
      },
      Error);
  // Re-quantizing a quantized checkpoint is refused.
  const auto r = test::run_cli("quantize --model " + out + " --out " + (d / "again"));
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("already quantized"));
}

}  // namespace
}  // namespace md
