// FP8 e4m3 checkpoints as released: DeepSeek-style (`quant_method: "fp8"`, `weight_scale_inv` F32
// per weight_block_size block, as Kimi K2 ships) and compressed-tensors `float-quantized` (channel
// scales). The test writes them from the tiny golden model with its own e4m3 encoder (nearest value,
// ties to the even mantissa) and checks: every loaded matrix's values against e4m3 x scale
// recomputed from the files (block scales expanded per row); the logits against the same model
// with those matrices dequantized to fp32 (FP32 precision: accumulation order only); both plan
// executors bit-identical to the reference path; bad configs and tensors named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cpu/fp8.h"
#include "megadecode/kernels/cuda/sim.h"
#include "megadecode/model/safetensors.h"
#include "test_util.h"

namespace md {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

double e4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
  return b & 0x80 ? -v : v;
}

// The nearest e4m3 byte to v (|v| <= 448), ties to the even mantissa.
uint8_t to_e4m3(double v) {
  uint8_t best = 0;
  for (int b = 0; b < 0x7f; ++b) {
    const double d = std::fabs(std::fabs(v) - e4m3(uint8_t(b))),
                 db = std::fabs(std::fabs(v) - e4m3(best));
    if (d < db || (d == db && (b & 1) == 0)) best = uint8_t(b);
  }
  return best != 0 && v < 0 ? uint8_t(best | 0x80) : best;
}

// Linear weights the FP8 checkpoint stores as e4m3 (the router and kv_b stay bf16, as megadecode
// reads them; the embedding and lm_head as DeepSeek's releases keep them).
bool fp8_module(const std::string& name, const TensorInfo& t) {
  return t.shape.size() == 2 && name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0 &&
         name.find("embed_tokens") == std::string::npos && name.find("lm_head") == std::string::npos &&
         name.find("block_sparse_moe.gate.") == std::string::npos &&
         name.find("kv_b_proj") == std::string::npos && t.shape[1] % 32 == 0;
}

struct Written {
  std::string dir;
  // module -> its values and per-row expanded scales, as the test computed them
  std::map<std::string, std::pair<std::vector<uint8_t>, std::vector<float>>> mats;
};

// channel: compressed-tensors float-quantized with one BF16 scale per row; else DeepSeek-style
// block scales of 16 rows x 32 columns.
Written write_fp8(const std::string& src, const std::string& dst, bool channel) {
  Written out;
  out.dir = dst;
  const Checkpoint ck(src);
  std::vector<TensorSpec> specs;
  std::map<std::string, std::vector<uint8_t>> data;
  const int64_t br = channel ? 1 : 16, bc = 32;
  for (const auto& [name, t] : ck.tensors()) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    if (!fp8_module(name, t) || t.dtype != DType::BF16) {
      specs.push_back({name, t.dtype, t.shape});
      data[name].assign(p, p + t.nbytes);
      continue;
    }
    const std::string module = name.substr(0, name.size() - 7);
    const int64_t rows = t.shape[0], cols = t.shape[1];
    const int64_t gc = channel ? 1 : cols / bc, gr = (rows + br - 1) / br;
    const auto* w = static_cast<const bf16*>(t.data);
    std::vector<float> block_scale(size_t(gr * gc));
    for (int64_t i = 0; i < gr; ++i)
      for (int64_t j = 0; j < gc; ++j) {
        double amax = 0;
        for (int64_t r = i * br; r < std::min(rows, (i + 1) * br); ++r)
          for (int64_t k = channel ? 0 : j * bc; k < (channel ? cols : (j + 1) * bc); ++k)
            amax = std::max(amax, std::fabs(double(bf16_to_f32(w[r * cols + k]))));
        float s = float(amax / 448.0);
        if (channel) s = bf16_to_f32(f32_to_bf16(s));  // stored as BF16
        block_scale[size_t(i * gc + j)] = s > 0 ? s : 1.0f;
      }
    std::vector<uint8_t> v(size_t(rows * cols));
    std::vector<float> expanded(size_t(rows * (channel ? 1 : cols / bc)));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols; ++k) {
        const float s = block_scale[size_t((r / br) * gc + (channel ? 0 : k / bc))];
        v[size_t(r * cols + k)] = to_e4m3(double(bf16_to_f32(w[r * cols + k])) / s);
        expanded[size_t(r * (channel ? 1 : cols / bc) + (channel ? 0 : k / bc))] = s;
      }
    specs.push_back({name, DType::F8E4M3, t.shape});
    data[name] = v;
    const std::string sname = module + (channel ? ".weight_scale" : ".weight_scale_inv");
    if (channel) {
      specs.push_back({sname, DType::BF16, {rows, 1}});
      std::vector<uint8_t>& b = data[sname];
      b.resize(size_t(rows) * 2);
      for (int64_t r = 0; r < rows; ++r) {
        const bf16 h = f32_to_bf16(block_scale[size_t(r)]);
        std::memcpy(b.data() + r * 2, &h, 2);
      }
    } else {
      specs.push_back({sname, DType::F32, {gr, gc}});
      data[sname].resize(block_scale.size() * 4);
      std::memcpy(data[sname].data(), block_scale.data(), block_scale.size() * 4);
    }
    out.mats[module] = {std::move(v), std::move(expanded)};
  }
  std::stable_sort(specs.begin(), specs.end(), [](const TensorSpec& a, const TensorSpec& b) {
    return dtype_size(a.dtype) > dtype_size(b.dtype);
  });
  fs::create_directories(dst);
  write_checkpoint(dst, specs, [&](const TensorSpec& sp, uint8_t* o) {
    std::memcpy(o, data.at(sp.name).data(), sp.nbytes());
  });
  std::ifstream in(src + "/config.json");
  nlohmann::json c = nlohmann::json::parse(in);
  if (channel) {
    c["quantization_config"] = {
        {"quant_method", "compressed-tensors"},
        {"format", "float-quantized"},
        {"quantization_status", "compressed"},
        {"config_groups",
         {{"group_0",
           {{"targets", {"Linear"}},
            {"weights",
             {{"num_bits", 8}, {"type", "float"}, {"symmetric", true}, {"strategy", "channel"},
              {"dynamic", false}}},
            {"input_activations",
             {{"num_bits", 8}, {"type", "float"}, {"strategy", "token"}, {"dynamic", true}}},
            {"output_activations", nullptr}}}}},
        {"ignore", {"lm_head"}}};
  } else {
    c["quantization_config"] = {{"quant_method", "fp8"},
                                {"fmt", "e4m3"},
                                {"activation_scheme", "dynamic"},
                                {"weight_block_size", {16, 32}}};
  }
  std::ofstream(dst + "/config.json") << c.dump(2);
  for (const auto& e : fs::directory_iterator(src)) {
    const std::string n = e.path().filename().string();
    if (n != "config.json" && e.path().extension() != ".safetensors")
      fs::copy_file(e.path(), fs::path(dst) / n, fs::copy_options::overwrite_existing);
  }
  return out;
}

ModelOptions plain(Precision p) {
  ModelOptions o;
  o.precision = p;
  o.threads = 1;
  o.pin_threads = false;
  return o;
}

// Every FP8 matrix of w replaced by its dequantized fp32 values (owned by w); returns how many.
int dequantize_fp8(ModelWeights& w) {
  int n = 0;
  auto fix = [&](Mat& m) {
    if (m.quant != WeightQuant::kFp8) return;
    auto buf = std::make_shared<std::vector<uint8_t>>(size_t(m.rows * m.cols) * 4);
    auto* out = reinterpret_cast<float*>(buf->data());
    const auto* sc = reinterpret_cast<const float*>(m.scales);
    for (int64_t r = 0; r < m.rows; ++r)
      cpu::dequantize_fp8_row(m.packed_data() + r * m.cols, sc + r * (m.cols / m.group), m.cols,
                              m.group, out + r * m.cols);
    Mat f;
    f.data = out;
    f.dtype = DType::F32;
    f.rows = m.rows;
    f.cols = m.cols;
    m = f;
    w.owned.push_back(buf);
    ++n;
  };
  for (LayerWeights& L : w.layers) {
    for (Mat* m : {&L.kda.q, &L.kda.k, &L.kda.v, &L.kda.f_a, &L.kda.f_b, &L.kda.b, &L.kda.g_a,
                   &L.kda.g_b, &L.kda.g, &L.kda.o, &L.mla.q, &L.mla.q_a, &L.mla.q_b, &L.mla.g,
                   &L.mla.kv_a, &L.mla.o})
      fix(*m);
    for (FfnWeights* f : {&L.dense, &L.moe.shared}) {
      fix(f->gate);
      fix(f->up);
      fix(f->down);
    }
    for (FfnWeights& e : L.moe.experts) {
      fix(e.gate);
      fix(e.up);
      fix(e.down);
    }
  }
  return n;
}

std::vector<float> run(Model& m, const std::vector<int32_t>& ids) {
  const int64_t V = m.config().vocab_size;
  std::vector<float> out(ids.size() * size_t(V));
  SequenceState s = m.new_sequence();
  for (size_t i = 0; i < ids.size(); ++i)
    m.forward(s, std::span(ids.data() + i, 1), out.data() + i * size_t(V), false);
  return out;
}

TEST(Fp8Checkpoint, LoadsAsReleasedAndMatchesItsDequantizedModel) {
  const std::string src = test::data_dir() + "/data/golden/tiny";
  for (bool channel : {false, true}) {
    SCOPED_TRACE(channel ? "float-quantized, channel scales" : "fp8, 16 x 32 block scales");
    test::TempDir d("fp8");
    const Written wr = write_fp8(src, d / "fp8", channel);
    ASSERT_GT(wr.mats.size(), 20u);
    Model q(wr.dir, plain(Precision::FP32));
    EXPECT_EQ(q.config().linear_quant, WeightQuant::kFp8);
    EXPECT_TRUE(quantized_outside_experts(q.weights()));
    // Layer 0's attention and every expert of layer 1, against the test's own values and scales.
    const ModelWeights& w = q.weights();
    auto check = [&](const Mat& m, const std::string& module) {
      const auto it = wr.mats.find(module);
      ASSERT_NE(it, wr.mats.end()) << module;
      ASSERT_EQ(m.quant, WeightQuant::kFp8) << module;
      std::vector<float> row(size_t(m.cols));
      const auto* sc = reinterpret_cast<const float*>(m.scales);
      const int64_t ng = m.cols / m.group, tg = channel ? 1 : m.cols / 32;
      for (int64_t r = 0; r < m.rows; ++r) {
        cpu::dequantize_fp8_row(m.packed_data() + r * m.cols, sc + r * ng, m.cols, m.group,
                                row.data());
        for (int64_t k = 0; k < m.cols; ++k) {
          const double want =
              e4m3(it->second.first[size_t(r * m.cols + k)]) *
              double(it->second.second[size_t(r * tg + (channel ? 0 : k / 32))]);
          ASSERT_EQ(double(row[size_t(k)]), double(float(want))) << module << " " << r << "," << k;
        }
      }
    };
    const std::string l0 = "model.layers.0.self_attn.", l1 = "model.layers.1.block_sparse_moe.";
    check(w.layers[0].kda.q, l0 + "q_proj");
    check(w.layers[0].kda.o, l0 + "o_proj");
    for (size_t e = 0; e < w.layers[1].moe.experts.size(); ++e)
      check(w.layers[1].moe.experts[e].down, l1 + "experts." + std::to_string(e) + ".w2");
    EXPECT_FALSE(w.layers[1].moe.router.quantized());
    // Logits against the dequantized twin (FP32: the same function, fp32 accumulation orders).
    Model deq(wr.dir, plain(Precision::FP32));
    EXPECT_EQ(dequantize_fp8(deq.mutable_weights()), int(wr.mats.size()));
    std::vector<int32_t> ids;
    for (int i = 0; i < 10; ++i) ids.push_back(int32_t((i * 37 + 11) % 1000));
    const auto yq = run(q, ids), yd = run(deq, ids);
    double ss = 0, dmax = 0;
    for (size_t i = 0; i < yq.size(); ++i) {
      ss += double(yd[i]) * yd[i];
      dmax = std::max(dmax, std::fabs(double(yq[i]) - yd[i]));
    }
    EXPECT_LE(dmax, 1e-4 * std::sqrt(ss / double(yq.size())));
    // The CUDA executors (on the simulation) against the reference path: the same FP8 values in
    // another fp32 summation order (test_cuda_quantized.cpp's bound), and bit for bit with each
    // other.
    {
      cuda::sim::Config saved = cuda::sim::config();
      cuda::sim::config().sm_count = 3;
      const int64_t V = q.config().vocab_size;
      std::vector<std::vector<float>> outs;
      for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
        CudaExecutor ex(q, 1, kind, CudaTarget::kSim);
        SequenceState s = ex.new_sequence();
        std::vector<float> got(ids.size() * size_t(V));
        for (size_t i = 0; i < ids.size(); ++i) {
          SequenceState* seqs[] = {&s};
          ex.step(seqs, std::span(&ids[i], 1), got.data() + i * size_t(V));
          double scale = 0, err = 0;
          for (int64_t j = 0; j < V; ++j) {
            const size_t k = i * size_t(V) + size_t(j);
            scale = std::max(scale, double(std::fabs(yq[k])));
            err = std::max(err, double(std::fabs(got[k] - yq[k])));
          }
          EXPECT_LE(err, 1e-4 * scale) << executor_name(kind) << " on the CUDA simulation, step " << i;
        }
        outs.push_back(std::move(got));
      }
      EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * 4));
      cuda::sim::config() = saved;
    }
    // Both plan executors bit-identical to the reference path (BF16, batch 2).
    Model b(wr.dir, plain(Precision::BF16));
    const auto want = run(b, ids);
    const int64_t V = b.config().vocab_size;
    for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
      CpuExecutor ex(b, 2, 2, kind);
      SequenceState s0 = ex.new_sequence(), s1 = ex.new_sequence();
      std::vector<float> out(2 * size_t(V));
      for (size_t i = 0; i < ids.size(); ++i) {
        std::vector<SequenceState*> seqs = {&s0, &s1};
        std::vector<int32_t> toks = {ids[i], ids[(i + 3) % ids.size()]};
        ex.step(seqs, toks, out.data());
        ASSERT_EQ(0, std::memcmp(out.data(), want.data() + i * size_t(V), size_t(V) * 4))
            << executor_name(kind) << " step " << i;
      }
    }
  }
}

TEST(Fp8Checkpoint, BadConfigsAndTensorsAreErrorsNamingTheProblem) {
  const std::string src = test::data_dir() + "/data/golden/tiny";
  test::TempDir d("fp8_bad");
  const Written wr = write_fp8(src, d / "fp8", false);
  const std::string cfg_path = wr.dir + "/config.json";
  std::ifstream f(cfg_path);
  const nlohmann::json good = nlohmann::json::parse(f);
  auto load_with = [&](const std::function<void(nlohmann::json&)>& edit) -> std::string {
    nlohmann::json c = good;
    edit(c["quantization_config"]);
    std::ofstream(cfg_path) << c.dump();
    try {
      Model m(wr.dir, plain(Precision::BF16));
    } catch (const Error& e) {
      return e.what();
    }
    return "(loaded)";
  };
  EXPECT_THAT(load_with([](nlohmann::json& q) { q["fmt"] = "e5m2"; }), HasSubstr("only e4m3"));
  EXPECT_THAT(load_with([](nlohmann::json& q) { q["activation_scheme"] = "static"; }),
              HasSubstr("static activation scales"));
  EXPECT_THAT(load_with([](nlohmann::json& q) { q["weight_block_size"] = {16, 48}; }),
              HasSubstr("positive multiple of 32"));
  EXPECT_THAT(load_with([](nlohmann::json& q) { q.erase("weight_block_size"); }),
              HasSubstr("weight_block_size"));
  // Blocks of 8 rows: the F32 scale tensors hold 16-row blocks.
  EXPECT_THAT(load_with([](nlohmann::json& q) { q["weight_block_size"] = {8, 32}; }),
              HasSubstr("weight_scale_inv"));
  // A module listed as not converted must be bf16.
  EXPECT_THAT(load_with([](nlohmann::json& q) {
                q["modules_to_not_convert"] = {"model.layers.0.self_attn.q_proj"};
              }),
              HasSubstr("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_EQ(load_with([](nlohmann::json&) {}), "(loaded)");
  // A NaN byte in a weight.
  {
    const Checkpoint ck(wr.dir);
    const TensorInfo& t = ck.get("model.layers.0.self_attn.q_proj.weight");
    ASSERT_EQ(t.dtype, DType::F8E4M3);
  }
  std::vector<TensorSpec> specs;
  std::map<std::string, std::vector<uint8_t>> data;
  {
    const Checkpoint ck(wr.dir);
    for (const auto& [name, t] : ck.tensors()) {
      specs.push_back({name, t.dtype, t.shape});
      const auto* p = static_cast<const uint8_t*>(t.data);
      data[name].assign(p, p + t.nbytes);
    }
  }
  data["model.layers.0.self_attn.q_proj.weight"][5] = 0x7f;
  std::stable_sort(specs.begin(), specs.end(), [](const TensorSpec& a, const TensorSpec& b) {
    return dtype_size(a.dtype) > dtype_size(b.dtype);
  });
  fs::remove(wr.dir + "/model.safetensors");
  write_checkpoint(wr.dir, specs, [&](const TensorSpec& sp, uint8_t* o) {
    std::memcpy(o, data.at(sp.name).data(), sp.nbytes());
  });
  EXPECT_THAT(load_with([](nlohmann::json&) {}), HasSubstr("byte 5 is 0x7f, NaN in e4m3"));
}

}  // namespace
}  // namespace md
