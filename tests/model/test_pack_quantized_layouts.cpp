// pack-quantized checkpoints in the layouts beyond the plain symmetric one, as GPTQ / AWQ tools
// release them: zero points (asymmetric int4) and activation-ordered groups (`actorder: group`,
// weight_g_idx). Each is written here from a `megadecode quantize` checkpoint of a golden model,
// loaded, and run against its dequantized twin: the same model with every such matrix replaced
// by its fp32 values decoded in this test from the file's bits and the format's definition. In
// FP32 precision the two differ only in each matmul's fp32 summation order, bounded as in
// test_quantize.cpp (|dlogit| <= 1e-4 rms); the plan executors are bit-identical to the
// reference path (BF16, batch 2).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/engine/model.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cuda/sim.h"
#include "megadecode/model/safetensors.h"
#include "pack_quantized_util.h"
#include "test_util.h"

namespace md {
namespace {

using test::golden_dir;
using test::logits_of;
using test::max_gap;
using test::plain;
using test::prompt_of;
using test::rewrite_checkpoint;
using test::write_quantized;
using ::testing::HasSubstr;

using TensorData = std::map<std::string, std::vector<uint8_t>>;

bool is_packed(const std::string& n) {
  return n.size() > 14 && n.compare(n.size() - 14, 14, ".weight_packed") == 0;
}
void copy_tensor(const std::string& name, const TensorInfo& t, std::vector<TensorSpec>& specs,
                 TensorData& data) {
  specs.push_back({name, t.dtype, t.shape});
  const auto* p = static_cast<const uint8_t*>(t.data);
  data[name].assign(p, p + t.nbytes);
}

// Replaces every matrix of m that `applies` to by the fp32 values value(m, module, r, k) (module:
// the checkpoint's name, without ".weight"); returns how many. tiny's linears: KDA and MLA
// attention, the dense FFN of layer 0, the shared and routed experts.
int replace_with_fp32(
    Model& model, const std::function<bool(const Mat&)>& applies,
    const std::function<float(const Mat&, const std::string&, int64_t, int64_t)>& value) {
  ModelWeights& w = model.mutable_weights();
  int n = 0;
  auto fix = [&](Mat& m, const std::string& module) {
    if (!m.data || !applies(m)) return;
    auto buf = std::make_shared<std::vector<uint8_t>>(size_t(m.rows * m.cols) * 4);
    auto* out = reinterpret_cast<float*>(buf->data());
    for (int64_t r = 0; r < m.rows; ++r)
      for (int64_t k = 0; k < m.cols; ++k) out[r * m.cols + k] = value(m, module, r, k);
    Mat f;
    f.data = out;
    f.dtype = DType::F32;
    f.rows = m.rows;
    f.cols = m.cols;
    m = f;
    w.owned.push_back(buf);
    ++n;
  };
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
  return n;
}

// The file's 4-bit code of column k of row r of `module` (pack_to_int32: the little-endian bytes
// hold two codes each, low nibble first).
int file_code(const Model& m, const std::string& module, int64_t r, int64_t k, int64_t cols) {
  const auto* p = static_cast<const uint8_t*>(m.checkpoint().find(module + ".weight_packed")->data);
  const uint8_t byte = p[r * (cols / 2) + k / 2];
  return k % 2 ? byte >> 4 : byte & 15;
}
float file_scale(const Model& m, const std::string& module, int64_t r, int64_t g, int64_t groups) {
  const auto* s = static_cast<const bf16*>(m.checkpoint().find(module + ".weight_scale")->data);
  return bf16_to_f32(s[r * groups + g]);
}

// Token by token through the reference path.
std::vector<float> stepwise(Model& m, const std::vector<int32_t>& prompt) {
  const int64_t V = m.config().vocab_size;
  std::vector<float> y(prompt.size() * size_t(V));
  SequenceState st = m.new_sequence();
  for (size_t i = 0; i < prompt.size(); ++i)
    m.forward(st, std::span(prompt.data() + i, 1), y.data() + i * size_t(V), false);
  return y;
}

// Both CPU plan executors bit for bit with the reference path (batch 2: the prompt and the
// prompt shifted by 3).
void expect_cpu_executors_match(Model& b, const std::vector<int32_t>& prompt) {
  const std::vector<float> want = stepwise(b, prompt);
  const int64_t V = b.config().vocab_size;
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
TEST(PackQuantizedLayouts, AsymmetricInt4RunsAsInt4WithZeroPointsAndMatchesItsDequantizedTwin) {
  test::TempDir d("pack_asym");
  const std::string src = golden_dir("tiny"), sym = d / "sym", asym = d / "asym";
  write_quantized(src, sym, 32);
  Rng rng(17);
  std::map<std::string, std::vector<uint8_t>> zcodes;  // module -> [rows, groups] codes 0..15
  rewrite_checkpoint(
      sym, asym,
      [](nlohmann::json& c) {
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = false;
      },
      [&](const std::string& name, const TensorInfo& t, std::vector<TensorSpec>& specs,
          TensorData& data) {
        copy_tensor(name, t, specs, data);
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
  EXPECT_EQ(replace_with_fp32(
                dq, [](const Mat& m) { return m.zero_points != nullptr; },
                [&](const Mat& m, const std::string& module, int64_t r, int64_t k) {
                  const int64_t groups = m.cols / m.group;
                  const int zc = zcodes.at(module)[size_t(r * groups + k / m.group)];
                  return float(file_code(dq, module, r, k, m.cols) - zc) *
                         file_scale(dq, module, r, k / m.group, groups);
                }),
            int(zcodes.size()));  // every asymmetric matrix
  const std::vector<int32_t> prompt = prompt_of(src);
  const std::vector<float> ya = logits_of(a, prompt), yd = logits_of(dq, prompt);
  ASSERT_EQ(ya.size(), yd.size());
  EXPECT_LE(max_gap(ya, yd), 1e-4);
  // The zero points matter: the symmetric checkpoint's logits differ by far more.
  Model s(sym, plain(Precision::FP32));
  EXPECT_GT(max_gap(logits_of(s, prompt), yd), 1e-2);

  const int64_t V = a.config().vocab_size;
  // The CUDA executors on the simulation (FP32: the same weights as int8 codes, another fp32
  // summation order: test_cuda_quantized.cpp's 1e-4 of the logits' scale), bit for bit with each
  // other.
  {
    const std::vector<float> want = stepwise(a, prompt);
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
  expect_cpu_executors_match(b, prompt);
}

// Activation-ordered groups (compressed-tensors `actorder: "group"`, GPTQ's desc_act):
// weight_g_idx I32 [cols] gives each column's group, and W[r][k] = (c[r][k] - 8) *
// scale[r][g_idx[k]]. The loader sorts the columns by group (the kernels gather the vectors
// the same way). Written here from the symmetric checkpoint: the same codes and scales, a random
// g_idx with `group` columns in every group. Also: "weight" / "static" (groups left contiguous)
// load as the plain layout; a g_idx that overfills a group or is missing is an error naming it;
// the CUDA executors refuse it.
TEST(PackQuantizedLayouts, ActivationOrderedGroupsMatchTheirDequantizedTwin) {
  test::TempDir d("pack_actorder");
  const std::string src = golden_dir("tiny"), sym = d / "sym", ao = d / "ao";
  write_quantized(src, sym, 32);
  Rng rng(29);
  std::map<std::string, std::vector<int32_t>> gidx;  // module -> [cols] group of each column
  auto write_ao = [&](const std::string& dst,
                      const std::function<void(std::vector<int32_t>&)>& bend) {
    rewrite_checkpoint(
        sym, dst,
        [](nlohmann::json& c) {
          c["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group";
        },
        [&](const std::string& name, const TensorInfo& t, std::vector<TensorSpec>& specs,
            TensorData& data) {
          copy_tensor(name, t, specs, data);
          if (!is_packed(name)) return;
          const std::string module = name.substr(0, name.size() - 14);
          const int64_t cols = t.shape[1] * 8;
          std::vector<int32_t>& g = gidx[module];
          g.resize(size_t(cols));
          for (int64_t k = 0; k < cols; ++k) g[size_t(k)] = int32_t(k / 32);
          for (int64_t k = cols - 1; k > 0; --k)
            std::swap(g[size_t(k)], g[size_t(rng.next() % uint64_t(k + 1))]);
          bend(g);
          const std::string gn = module + ".weight_g_idx";
          specs.push_back({gn, DType::I32, {cols}});
          data[gn].resize(size_t(cols) * 4);
          std::memcpy(data[gn].data(), g.data(), size_t(cols) * 4);
        });
  };
  write_ao(ao, [](std::vector<int32_t>&) {});
  Model a(ao, plain(Precision::FP32));
  EXPECT_TRUE(a.config().quant_actorder);
  {
    const std::string module = "model.layers.0.self_attn.q_proj";
    const Mat& q = a.weights().layers[0].kda.q;
    EXPECT_TRUE(q.int4());
    ASSERT_NE(q.col_perm, nullptr);
    EXPECT_NE(q.data, a.checkpoint().find(module + ".weight_packed")->data);  // sorted copy
    // Stored column j is file column col_perm[j], in group j / 32, ascending within a group.
    const std::vector<int32_t>& g = gidx.at(module);
    for (int64_t j = 0; j < q.cols; ++j) {
      ASSERT_EQ(g[size_t(q.col_perm[j])], j / 32) << j;
      if (j % 32) {
        ASSERT_LT(q.col_perm[j - 1], q.col_perm[j]) << j;
      }
      const uint8_t byte = q.packed_data()[j / 2];
      ASSERT_EQ(j % 2 ? byte >> 4 : byte & 15, file_code(a, module, 0, q.col_perm[j], q.cols));
    }
  }
  Model dq(ao, plain(Precision::FP32));
  EXPECT_EQ(replace_with_fp32(
                dq, [](const Mat& m) { return m.col_perm != nullptr; },
                [&](const Mat& m, const std::string& module, int64_t r, int64_t k) {
                  const int32_t g = gidx.at(module)[size_t(k)];
                  return float(file_code(dq, module, r, k, m.cols) - 8) *
                         file_scale(dq, module, r, g, m.cols / m.group);
                }),
            int(gidx.size()));
  const std::vector<int32_t> prompt = prompt_of(src);
  const std::vector<float> ya = logits_of(a, prompt), yd = logits_of(dq, prompt);
  EXPECT_LE(max_gap(ya, yd), 1e-4);
  // The group indices matter: the plain layout of the same codes gives other logits.
  Model s(sym, plain(Precision::FP32));
  EXPECT_GT(max_gap(logits_of(s, prompt), yd), 1e-2);
  Model b(ao, plain(Precision::BF16));
  expect_cpu_executors_match(b, prompt);
  // The CUDA tiles read consecutive groups: refused, naming the layout.
  {
    std::string err;
    try {
      CudaExecutor ex(b, 1, ExecutorKind::kMegakernel, CudaTarget::kSim);
    } catch (const Error& e) {
      err = e.what();
    }
    EXPECT_THAT(err, HasSubstr("activation-ordered groups"));
  }

  // "weight" and its alias "static" keep the groups contiguous: the plain layout's bits.
  for (const char* alias : {"weight", "static"}) {
    const std::string dst = d / alias;
    rewrite_checkpoint(
        sym, dst,
        [&](nlohmann::json& c) {
          c["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = alias;
        },
        copy_tensor);
    Model w(dst, plain(Precision::FP32));
    EXPECT_FALSE(w.config().quant_actorder) << alias;
    const std::vector<float> yw = logits_of(w, prompt), ys = logits_of(s, prompt);
    EXPECT_EQ(0, std::memcmp(yw.data(), ys.data(), yw.size() * 4)) << alias;
  }
  // Bad group indices: a group with too many columns, an index outside the groups; a missing
  // weight_g_idx.
  auto error_of = [](const std::string& dir) {
    try {
      Model m(dir, plain(Precision::BF16));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  write_ao(d / "full", [](std::vector<int32_t>& g) { g[0] = g[1] == 0 ? 1 : 0; });
  EXPECT_THAT(error_of(d / "full"), HasSubstr("columns (every group needs exactly 32)"));
  write_ao(d / "out", [](std::vector<int32_t>& g) { g[5] = 1000; });
  EXPECT_THAT(error_of(d / "out"), HasSubstr("is in group 1000"));
  rewrite_checkpoint(
      sym, d / "missing",
      [](nlohmann::json& c) {
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group";
      },
      copy_tensor);
  EXPECT_THAT(error_of(d / "missing"), HasSubstr("weight_g_idx"));
}

}  // namespace
}  // namespace md
