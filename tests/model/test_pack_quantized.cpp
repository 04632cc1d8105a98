// compressed-tensors checkpoints with quantized linears (pack-quantized int4 / int8,
// mxfp4-pack-quantized): `megadecode quantize --scheme` writes one from a bf16 checkpoint and the
// loader (model/binder.h Binder::linear, config.cpp) reads it back to the same bits as
// `--quantize SCHEME` on the original; the packed codes follow compressed-tensors'
// pack_to_int32 definition (checked here from the original bf16 weights, independently of the
// quantizer); the config is the format's; bad configs and tensors are errors naming the problem.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/dist/communicator.h"
#include "megadecode/dist/shard.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cuda/sim.h"
#include "megadecode/model/safetensors.h"
#include "pack_quantized_util.h"
#include "test_util.h"

namespace md {
namespace {

namespace fs = std::filesystem;
using test::golden_dir;
using test::logits_of;
using test::plain;
using test::prompt_of;
using test::write_quantized;
using ::testing::HasSubstr;

TEST(PackQuantized, AWrittenCheckpointLoadsBackToTheSameBitsAsQuantizingAtLoad) {
  struct Case {
    const char* model;
    QuantScheme scheme;
    int group;
  };
  for (const Case& c :
       {Case{"tiny", QuantScheme::kInt4, 32}, Case{"tiny", QuantScheme::kInt4, 0},
        Case{"tiny", QuantScheme::kInt8, 64}, Case{"tiny", QuantScheme::kMxfp4, -1},
        Case{"small", QuantScheme::kInt4, 32}, Case{"small", QuantScheme::kInt8, 0},
        Case{"small", QuantScheme::kMxfp4, -1}, Case{"tiny", QuantScheme::kInt4Asym, 32},
        Case{"small", QuantScheme::kInt4Asym, 0}}) {
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

// int4-asym: `symmetric: false`, and each module's weight_zero_point I32 [ceil(rows / 8), groups]
// packed along the rows (code z + 8 of row 8i + j in bits 4j.. of int32 [i, g]), as vLLM's
// compressed-tensors WNA16 loader reads it. Every zero point and code against the min-max
// observer's definition applied here to the original bf16 weights in float64: lo / hi the group's
// min / max widened to hold 0, s = bf16((hi - lo) / 15) (checked against the written scale),
// z = clamp(round(-8 - lo / s), -8, 7), q = round(clamp(w / s + z, -8, 7)).
TEST(PackQuantized, AsymmetricInt4WritesPackedZeroPoints) {
  test::TempDir d("pack_asym");
  const std::string src = golden_dir("tiny"), out = d / "q";
  write_quantized(src, out, 32, "int4-asym");
  std::ifstream f(out + "/config.json");
  const nlohmann::json c = nlohmann::json::parse(f);
  const nlohmann::json& w = c["quantization_config"]["config_groups"]["group_0"]["weights"];
  EXPECT_EQ(w["symmetric"], false);
  EXPECT_EQ(w["num_bits"], 4);
  EXPECT_EQ(w["group_size"], 32);
  const Checkpoint orig(src), packed(out);
  int modules = 0;
  for (const auto& [name, t] : packed.tensors()) {
    const size_t at = name.rfind(".weight_zero_point");
    if (at == std::string::npos || at + 18 != name.size()) continue;
    const std::string module = name.substr(0, at);
    SCOPED_TRACE(module);
    ++modules;
    const TensorInfo& wt = orig.get(module + ".weight");
    const int64_t rows = wt.shape[0], cols = wt.shape[1], groups = cols / 32;
    ASSERT_EQ(t.dtype, DType::I32);
    ASSERT_EQ(t.shape, (std::vector<int64_t>{(rows + 7) / 8, groups}));
    const auto* wv = static_cast<const bf16*>(wt.data);
    const auto* sv = static_cast<const bf16*>(packed.get(module + ".weight_scale").data);
    const auto* pv = static_cast<const uint32_t*>(packed.get(module + ".weight_packed").data);
    const auto* zv = static_cast<const uint32_t*>(t.data);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        double lo = 0, hi = 0;
        for (int64_t k = 32 * g; k < 32 * (g + 1); ++k) {
          lo = std::min(lo, double(bf16_to_f32(wv[r * cols + k])));
          hi = std::max(hi, double(bf16_to_f32(wv[r * cols + k])));
        }
        double s = round_bf16(float((hi - lo) / 15));
        if (s < FLT_EPSILON) s = FLT_EPSILON;
        ASSERT_EQ(double(bf16_to_f32(sv[r * groups + g])), s) << "row " << r << " group " << g;
        const double z = std::clamp(std::nearbyint(-8 - lo / s), -8.0, 7.0);
        ASSERT_EQ((zv[(r / 8) * groups + g] >> (4 * (r % 8))) & 15, uint32_t(z + 8))
            << "row " << r << " group " << g;
        for (int64_t k = 32 * g; k < 32 * (g + 1); ++k) {
          const double x = double(bf16_to_f32(wv[r * cols + k])) / s + z;
          if (std::fabs(x - std::floor(x) - 0.5) < 1e-6) continue;  // (a tie fp32 may break)
          const uint32_t want = uint32_t(std::nearbyint(std::clamp(x, -8.0, 7.0)) + 8);
          ASSERT_EQ((pv[r * (cols / 8) + k / 8] >> (4 * (k % 8))) & 15, want)
              << "row " << r << " col " << k;
        }
      }
    // A partial last int32 of zero points (rows not a multiple of 8) is padded with zeros.
    if (rows % 8) {
      for (int64_t g = 0; g < groups; ++g)
        EXPECT_EQ(zv[(rows / 8) * groups + g] >> (4 * (rows % 8)), 0u);
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
  EXPECT_THAT(load_with([&](nlohmann::json& c) { weights(c)["actorder"] = "columns"; }),
              HasSubstr("actorder' is \"columns\""));
  // Activation order without the group indices: the missing tensor is named
  // (test_pack_quantized_layouts.cpp runs the layout).
  EXPECT_THAT(load_with([&](nlohmann::json& c) { weights(c)["actorder"] = "group"; }),
              HasSubstr("missing tensor model.layers.0.self_attn.q_proj.weight_g_idx"));
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
