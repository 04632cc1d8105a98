// Load-time quantization (engine/quantize.h: int4, int8, MXFP4) on whole models: the quantized logits against a
// float64-checked reference of the same model with every quantized matrix replaced by its
// dequantized fp32 copy; the CPU executors bit for bit against the reference path; what is and is
// not quantized; bad options.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/engine/quantize.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cpu/int4.h"
#include "megadecode/kernels/cpu/int8.h"
#include "megadecode/kernels/cpu/mxfp4.h"
#include "test_util.h"

namespace md {
namespace {

ModelOptions opts(Precision p, int group, QuantScheme scheme = QuantScheme::kInt4) {
  ModelOptions o;
  o.precision = p;
  o.threads = 1;
  o.pin_threads = false;
  o.quantize.scheme = scheme;
  o.quantize.group = group;
  return o;
}

// Replaces every matrix of w in `format` by its dequantized values as an fp32 matrix (owned by
// w).
int dequantize_all(ModelWeights& w, WeightQuant format) {
  int n = 0;
  auto fix = [&](Mat& m) {
    if (m.quant != format) return;
    auto buf = std::make_shared<std::vector<uint8_t>>(size_t(m.rows * m.cols) * 4);
    auto* out = reinterpret_cast<float*>(buf->data());
    const auto* scales = reinterpret_cast<const bf16*>(m.scales);
    for (int64_t r = 0; r < m.rows; ++r) {
      const uint8_t* codes = m.packed_data() + r * m.code_row_bytes();
      float* o = out + r * m.cols;
      if (m.int4())
        cpu::dequantize_int4_row(codes, scales + r * (m.cols / m.group), m.cols, m.group, o,
                                 m.zero_points ? m.zero_points + r * (m.cols / m.group) : nullptr);
      else if (m.int8())
        cpu::dequantize_int8_row(codes, scales + r * (m.cols / m.group), m.cols, m.group, o);
      else
        cpu::dequantize_mxfp4_row(codes, m.scales + r * m.scale_row_bytes(), m.cols, o);
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
  auto ffn = [&](FfnWeights& f) {
    fix(f.gate);
    fix(f.up);
    fix(f.down);
  };
  for (LayerWeights& L : w.layers) {
    for (Mat* m : {&L.kda.q,    &L.kda.k,   &L.kda.v,           &L.kda.f_a,       &L.kda.f_b,
                   &L.kda.b,    &L.kda.g_a, &L.kda.g_b,         &L.kda.g,         &L.kda.o,
                   &L.mla.q,    &L.mla.q_a, &L.mla.q_b,         &L.mla.g,         &L.mla.kv_a,
                   &L.mla.kv_b, &L.mla.o,   &L.moe.latent_down, &L.moe.latent_up, &L.moe.router})
      fix(*m);
    ffn(L.dense);
    ffn(L.moe.shared);
    for (FfnWeights& e : L.moe.experts) ffn(e);
  }
  fix(w.lm_head);
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

std::vector<int32_t> ids_for(const Model& m, int n) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ids[size_t(i)] = int32_t((i * 37 + 11) % (m.config().vocab_size - 1));
  return ids;
}

// The plan executors (both kinds, batches of 2) against the reference path's logits of m, bit for
// bit, over 6 steps.
void expect_executors_match_reference(Model& m, const std::string& what) {
  const int64_t V = m.config().vocab_size;
  const std::vector<int32_t> ids = ids_for(m, 6);
  const auto want = run(m, ids);
  for (ExecutorKind kind : {ExecutorKind::kMegakernel, ExecutorKind::kOpByOp}) {
    CpuExecutor ex(m, 2, 2, kind);
    SequenceState a = ex.new_sequence(), b = ex.new_sequence();
    std::vector<float> out(2 * size_t(V));
    for (size_t i = 0; i < ids.size(); ++i) {
      std::vector<SequenceState*> seqs = {&a, &b};
      std::vector<int32_t> toks = {ids[i], ids[(i + 3) % ids.size()]};
      ex.step(seqs, toks, out.data());
      ASSERT_EQ(0, std::memcmp(out.data(), want.data() + i * size_t(V), size_t(V) * 4))
          << what << " " << executor_name(kind) << " step " << i;
    }
  }
}

class QuantizeTest : public ::testing::TestWithParam<const char*> {
 protected:
  std::string dir() const { return test::shared_checkpoint(GetParam(), 5); }
};

// In FP32 precision (no bf16 rounding points) the quantized model and its dequantized fp32 twin
// compute the same function with the same weights; they differ only in the fp32 accumulation
// order of each matmul (the quantized kernels' 32-column runs vs the fp32 kernel's lanes), which
// is ~sqrt(K) u relative per output and stays at that order through the layers (norms rescale,
// nothing amplifies it by more than the layer count). So |dlogit| <= 1e-4 * rms(logits) is ~50x
// the expected gap; a wrong scale, group, code or byte order anywhere moves logits by ~rms (the
// check against the bf16 model below shows quantization itself moves them by far more than this
// tolerance). Each scheme, with groups and per-row scales where the scheme has them; the bytes
// after quantization against the format's bits per weight.
TEST_P(QuantizeTest, LogitsMatchTheDequantizedFp32Model) {
  struct Case {
    QuantScheme scheme;
    int group;
    double max_ratio;  // bytes after / before: bits / 16 plus the scales, with margin
  };
  for (const Case& c : {Case{QuantScheme::kInt4, 32, 0.35}, Case{QuantScheme::kInt4, 0, 0.3},
                        Case{QuantScheme::kInt4Asym, 32, 0.35},
                        Case{QuantScheme::kInt4Asym, 0, 0.3}, Case{QuantScheme::kInt8, 32, 0.6},
                        Case{QuantScheme::kInt8, 0, 0.55}, Case{QuantScheme::kMxfp4, -1, 0.3}}) {
    const std::string what =
        std::string(GetParam()) + " " + std::string(quant_scheme_name(c.scheme)) + " group " +
        std::to_string(c.group);
    Model q(dir(), opts(Precision::FP32, c.group, c.scheme));
    const QuantizeReport& rep = q.quantize_report();
    ASSERT_GT(rep.matrices, 0) << what;
    EXPECT_LT(rep.bytes_after, c.max_ratio * rep.bytes_before) << what;
    ModelOptions plain = opts(Precision::FP32, c.group, QuantScheme::kNone);
    Model ref(dir(), plain);
    Model deq(dir(), opts(Precision::FP32, c.group, c.scheme));
    // (K3's routed experts are MXFP4 as loaded: the MXFP4 twin dequantizes them too.)
    const int n = dequantize_all(deq.mutable_weights(), quant_format(c.scheme));
    if (c.scheme == QuantScheme::kMxfp4)
      EXPECT_GE(n, rep.matrices) << what;
    else
      EXPECT_EQ(n, rep.matrices) << what;
    const std::vector<int32_t> ids = ids_for(q, 12);
    const auto yq = run(q, ids), yd = run(deq, ids), yr = run(ref, ids);
    double ss = 0, dmax = 0, qgap = 0;
    for (size_t i = 0; i < yq.size(); ++i) {
      ss += double(yd[i]) * yd[i];
      dmax = std::max(dmax, std::fabs(double(yq[i]) - yd[i]));
      qgap = std::max(qgap, std::fabs(double(yr[i]) - yd[i]));
    }
    const double rms = std::sqrt(ss / double(yq.size()));
    EXPECT_LE(dmax, 1e-4 * rms) << what;
    // Quantization is not a no-op: the bf16 weights give other logits.
    EXPECT_GT(qgap, 100 * 1e-4 * rms) << what;
  }
}

// The plan executors run quantized matrices through the same kernel entry as the reference path,
// so they stay bit-identical to it (BF16 precision, batches of 2), in every format.
TEST_P(QuantizeTest, ExecutorsAreBitIdenticalToTheReferencePath) {
  for (QuantScheme scheme :
       {QuantScheme::kInt4, QuantScheme::kInt4Asym, QuantScheme::kInt8, QuantScheme::kMxfp4}) {
    Model m(dir(), opts(Precision::BF16, scheme == QuantScheme::kMxfp4 ? -1 : 32, scheme));
    expect_executors_match_reference(
        m, std::string(GetParam()) + " " + std::string(quant_scheme_name(scheme)));
  }
}

// --act-quant int8 / int16 (QuantizeOptions::int_act_bits): the int4 / int8 linears run as
// integer dot products (kernels/cpu/qdot.h, tested there against float64) on every CPU path, so
// the plan executors stay bit-identical to the reference path (BF16 precision, batches of 2).
TEST_P(QuantizeTest, Int8ActivationsExecutorsAreBitIdenticalToTheReferencePath) {
  for (int bits : {8, 16})
    for (QuantScheme scheme :
         {QuantScheme::kInt4, QuantScheme::kInt4Asym, QuantScheme::kInt8, QuantScheme::kMxfp4}) {
      ModelOptions o = opts(Precision::BF16, scheme == QuantScheme::kMxfp4 ? -1 : 32, scheme);
      o.quantize.int_act_bits = static_cast<uint8_t>(bits);
      Model m(dir(), o);
      // (K3's MXFP4 experts are marked as well: at least the quantized matrices.)
      ASSERT_GE(m.quantize_report().int_activation_matrices, m.quantize_report().matrices);
      expect_executors_match_reference(m, std::string(GetParam()) + " " +
                                              std::string(quant_scheme_name(scheme)) + " a" +
                                              std::to_string(bits));
    }
}

// What the activations' rounding costs, against what the weights' rounding costs (rms logit gaps,
// FP32 precision so that nothing else differs). int8 activations round each value to within
// 1/254 of its 32-column block's maximum, int4 weights to within 1/15 of their group's, int8
// weights 1/255: so the first gap should be well below the int4 weights' and of the order of the
// int8 weights'. These tiny random-weight models are not linear in the perturbation (a small
// change flips MoE routing choices and moves those positions' logits by a step), so the bounds
// are measured ones with margin rather than derived: measured act/weights 0.64 (Kimi Linear tiny)
// and 0.14 (K3 tiny) for int4, 1.67 and 0.62 for int8, 0.05 and 0.49 for MXFP4 (K3's experts are
// MXFP4 in both of its models, with int8 activations in the second). A kernel whose correction term
// is off by 2x (checked by breaking it on purpose) gives 2.5 / 1.9 and 100: far outside. And the
// flag is not a no-op.
TEST_P(QuantizeTest, Int8ActivationsCostLessThanTheWeightsRounding) {
  struct Case {
    QuantScheme scheme;
    double max_ratio;
  };
  for (const Case& c : {Case{QuantScheme::kInt4, 1.0}, Case{QuantScheme::kInt8, 3.0},
                        Case{QuantScheme::kMxfp4, 1.0}}) {
    Model bf(dir(), opts(Precision::FP32, 32, QuantScheme::kNone));
    Model w(dir(), opts(Precision::FP32, 32, c.scheme));
    ModelOptions o = opts(Precision::FP32, 32, c.scheme);
    o.quantize.int_act_bits = 8;
    Model wa(dir(), o);
    const std::vector<int32_t> ids = ids_for(w, 12);
    const auto yb = run(bf, ids), yw = run(w, ids), ya = run(wa, ids);
    double act = 0, weights = 0;
    for (size_t i = 0; i < yb.size(); ++i) {
      act += (double(ya[i]) - yw[i]) * (double(ya[i]) - yw[i]);
      weights += (double(yw[i]) - yb[i]) * (double(yw[i]) - yb[i]);
    }
    const std::string what = std::string(GetParam()) + " " +
                             std::string(quant_scheme_name(c.scheme)) + " act/weights gap " +
                             std::to_string(std::sqrt(act / weights));
    EXPECT_GT(act, 0.0) << what;
    EXPECT_LT(std::sqrt(act / weights), c.max_ratio) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, QuantizeTest, ::testing::Values("tiny", "k3-tiny"),
                         [](const auto& info) {
                           return std::string(info.param) == "tiny" ? "KimiLinear" : "K3";
                         });

TEST(Quantize, WhatIsQuantized) {
  Model m(test::shared_checkpoint("tiny", 5), opts(Precision::BF16, 32));
  const ModelWeights& w = m.weights();
  EXPECT_FALSE(w.embed.quantized());
  EXPECT_FALSE(w.lm_head.quantized());  // lm_head only with QuantizeOptions::lm_head
  bool any_router = false, kvb = false, proj = true;
  for (const LayerWeights& L : w.layers) {
    any_router |= L.moe.router.quantized();
    kvb |= L.mla.kv_b.quantized();
    if (L.kda.q.data) proj &= L.kda.q.int4() && L.kda.o.int4();
    for (const FfnWeights& e : L.moe.experts) proj &= !e.gate.data || e.gate.int4();
  }
  EXPECT_FALSE(any_router);
  EXPECT_FALSE(kvb);
  EXPECT_TRUE(proj);
  ModelOptions o = opts(Precision::BF16, 32);
  o.quantize.lm_head = true;
  Model h(test::shared_checkpoint("tiny", 5), o);
  EXPECT_TRUE(h.weights().lm_head.int4());
  EXPECT_EQ(h.quantize_report().matrices, m.quantize_report().matrices + 1);
}

// --act-quant int8 marks exactly the int4 / int8 / MXFP4 linears (K3's MXFP4 experts as loaded
// too), not bf16 matrices; without any it is an error saying what to do.
TEST(Quantize, Int8ActivationsMarkTheIntegerLinearsOnly) {
  ModelOptions o = opts(Precision::BF16, 32);
  o.quantize.int_act_bits = 8;
  o.quantize.lm_head = true;
  Model m(test::shared_checkpoint("k3-tiny", 5), o);
  int marked = 0, mxfp4 = 0;
  auto check = [&](const Mat& x) {
    if (!x.data) return;
    EXPECT_EQ(x.int_act_bits, x.int4() || x.int8() || x.mxfp4() ? 8 : 0);
    marked += x.int_act_bits != 0;
    mxfp4 += x.mxfp4();
  };
  const ModelWeights& w = m.weights();
  for (const LayerWeights& L : w.layers) {
    for (const Mat* x : {&L.kda.q, &L.kda.o, &L.mla.kv_b, &L.moe.router, &L.mla.q_a}) check(*x);
    for (const FfnWeights& e : L.moe.experts) check(e.gate), check(e.down);
  }
  check(w.lm_head);
  EXPECT_TRUE(w.lm_head.int_act_bits);
  EXPECT_GT(marked, 0);
  EXPECT_GT(mxfp4, 0);  // K3's routed experts as loaded
  EXPECT_GT(m.quantize_report().int_activation_matrices, m.quantize_report().matrices);
  // K3's MXFP4 experts alone, without --quantize.
  ModelOptions experts = opts(Precision::BF16, 32, QuantScheme::kNone);
  experts.quantize.int_act_bits = 8;
  Model k(test::shared_checkpoint("k3-tiny", 5), experts);
  EXPECT_GT(k.quantize_report().int_activation_matrices, 0);
  EXPECT_TRUE(k.weights().layers.back().moe.experts.empty() ||
              k.weights().layers.back().moe.experts[0].gate.int_act_bits);
  // The CUDA executors (here on the host simulation) refuse it rather than run without it.
  try {
    CudaExecutor cx(k, 1, ExecutorKind::kMegakernel, CudaTarget::kSim);
    ADD_FAILURE() << "a CUDA executor took a model with --act-quant int8";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("int8 / int16 runs with --device cpu"));
  }
  ModelOptions none = opts(Precision::BF16, 32, QuantScheme::kNone);
  none.quantize.int_act_bits = 8;
  try {
    Model x(test::shared_checkpoint("tiny", 5), none);
    ADD_FAILURE() << "--act-quant int8 on a bf16 model loaded";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("no int4, int8 or MXFP4 linear layers"));
  }
}

TEST(Quantize, BadGroupsAreErrorsNamingTheProblem) {
  const std::string dir = test::shared_checkpoint("tiny", 5);
  auto message = [&](int group) {
    try {
      Model m(dir, opts(Precision::BF16, group));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(48).find("multiple of 32"), std::string::npos) << message(48);
  // A group larger than every matrix's columns: names one and its columns.
  const std::string big = message(1 << 16);
  EXPECT_NE(big.find("model.layers.0."), std::string::npos) << big;
  EXPECT_NE(big.find("--quant-group"), std::string::npos) << big;
  // A group that fits some matrices: the others stay bf16 and are reported.
  Model m(dir, opts(Precision::BF16, 128));
  EXPECT_GT(m.quantize_report().matrices, 0);
  EXPECT_GT(m.quantize_report().kept, 0);
  EXPECT_NE(m.quantize_report().first_kept.find("columns"), std::string::npos);
  EXPECT_EQ(parse_quant_scheme("int4"), QuantScheme::kInt4);
  EXPECT_EQ(parse_quant_scheme("int8"), QuantScheme::kInt8);
  EXPECT_EQ(parse_quant_scheme("int4-asym"), QuantScheme::kInt4Asym);
  EXPECT_EQ(quant_scheme_name(QuantScheme::kInt4Asym), "int4-asym");
  EXPECT_EQ(quant_format(QuantScheme::kInt4Asym), WeightQuant::kInt4);
  EXPECT_EQ(parse_quant_scheme("mxfp4"), QuantScheme::kMxfp4);
  EXPECT_FALSE(parse_quant_scheme("int3").has_value());
  // MXFP4's group is the format's.
  try {
    Model x(dir, opts(Precision::BF16, 64, QuantScheme::kMxfp4));
    ADD_FAILURE() << "mxfp4 with group 64 loaded";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("one E8M0 scale per 32 columns"));
  }
}

}  // namespace
}  // namespace md

namespace md {
namespace {

// quant-eval (the accuracy measurement of docs/quantization.md): the model against itself is KL
// 0 and full top-1 agreement; int4 moves the distributions (KL > 0); the JSON carries the
// figures; bad flags are errors.
TEST(QuantEval, MeasuresKlAndTopOneAgainstTheModelAsLoaded) {
  const std::string dir = test::data_dir() + "/data/golden/tiny";
  test::TempDir d("quant_eval");
  auto r = test::run_cli("quant-eval --model " + dir + " --quantize none --positions 24 --json " +
                         (d / "none.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  std::ifstream f0(d / "none.json");
  const nlohmann::json none = nlohmann::json::parse(f0);
  EXPECT_EQ(none["positions"], 24);
  EXPECT_EQ(none["kl_max"].get<double>(), 0.0);
  EXPECT_EQ(none["top1_agreement"].get<double>(), 1.0);
  r = test::run_cli("quant-eval --model " + dir +
                    " --quantize int4 --quant-group 32 --positions 24 --json " + (d / "q.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  std::ifstream f1(d / "q.json");
  const nlohmann::json q = nlohmann::json::parse(f1);
  EXPECT_GT(q["kl_mean"].get<double>(), 0.0);
  EXPECT_LE(q["kl_median"].get<double>(), q["kl_p99"].get<double>());
  EXPECT_LE(q["kl_p99"].get<double>(), q["kl_max"].get<double>());
  EXPECT_GE(q["top1_agreement"].get<double>(), 0.0);
  EXPECT_LE(q["top1_agreement"].get<double>(), 1.0);
  EXPECT_THAT(r.out, ::testing::HasSubstr("KL(bf16 || bf16 int4)"));
  r = test::run_cli("quant-eval --model " + dir +
                    " --quantize int4 --act-quant int8 --positions 24 --json " + (d / "a8.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.err, ::testing::HasSubstr("int8 activations (integer dot products"));
  std::ifstream f2(d / "a8.json");
  const nlohmann::json a8 = nlohmann::json::parse(f2);
  EXPECT_EQ(a8["act_quant"], "int8");
  EXPECT_GT(a8["kl_mean"].get<double>(), 0.0);
  r = test::run_cli("quant-eval --model " + dir +
                    " --quantize int4 --act-quant int16 --positions 24 --json " + (d / "a16.json"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.err, ::testing::HasSubstr("int16 activations (integer dot products"));
  EXPECT_THAT(r.out, ::testing::HasSubstr("int4 + int16 activations"));
  std::ifstream f3(d / "a16.json");
  EXPECT_EQ(nlohmann::json::parse(f3)["act_quant"], "int16");
  r = test::run_cli("quant-eval --model " + dir + " --quantize int4 --act-quant int4");
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.err, ::testing::HasSubstr("--act-quant"));
  r = test::run_cli("quant-eval --model " + dir + " --quantize int4 --text /nonexistent");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, ::testing::HasSubstr("cannot read --text"));
}

}  // namespace
}  // namespace md
