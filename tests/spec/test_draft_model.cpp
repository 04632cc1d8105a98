// The DSpark draft: loading and validating checkpoints, make-model --draft-for, the forward's
// semantics (ring, masks, Markov bias), and the target's aux hidden-state capture.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "megadecode/base/error.h"
#include "megadecode/base/xoshiro.h"
#include "megadecode/engine/model.h"
#include "megadecode/model/config.h"
#include "megadecode/model/presets.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/spec/draft_model.h"
#include "test_util.h"

namespace md {
namespace {

namespace fs = std::filesystem;

ModelOptions opts(Precision p = Precision::BF16) {
  ModelOptions o;
  o.precision = p;
  o.threads = 2;
  o.pin_threads = false;
  return o;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A random draft for a preset's target, written once per test into `dir`.
DraftConfig write_draft(const std::string& dir, const ModelConfig& target, uint64_t seed = 1) {
  const DraftConfig d = draft_config_for_target(target);
  ThreadPool pool(2, false);
  make_random_draft(d, dir, seed, pool);
  return d;
}

// Rewrites the draft's safetensors from `specs` (zero bytes), keeping its config.json.
void rewrite_tensors(const std::string& dir, const std::vector<TensorSpec>& specs) {
  fs::remove(fs::path(dir) / "model.safetensors");
  write_checkpoint(dir, specs,
                   [](const TensorSpec& t, uint8_t* out) { std::memset(out, 0, t.nbytes()); });
}

std::vector<float> random_aux(const DraftConfig& c, int rows, uint64_t seed) {
  Xoshiro256 rng(seed);
  std::vector<float> v(size_t(rows) * size_t(c.context_width()));
  for (float& x : v) x = round_bf16(float(rng.uniform(-2.0, 2.0)));
  return v;
}

TEST(DraftModel, LoadsARandomDraftForKimiLinearAndK3Targets) {
  for (const char* preset : {"tiny", "k3-tiny"}) {
    test::TempDir d("draft");
    const ModelConfig target = preset_config(preset);
    const DraftConfig c = write_draft(d.path(), target);
    DraftModel m(d.path(), target, opts());
    EXPECT_EQ(m.config().aux_layer_ids, c.aux_layer_ids) << preset;
    EXPECT_EQ(m.config().hidden_size, target.hidden_size);
    EXPECT_EQ(int(m.weights().layers.size()), 5);
    // Against another target: the mismatch is named.
    const ModelConfig other = preset_config("small");
    EXPECT_NE(error_of([&] {
                DraftModel(d.path(), other, opts());
              }).find("hidden size 64 does not match the target's 128"),
              std::string::npos);
    ModelConfig shallow = target;
    shallow.num_layers = 2;
    EXPECT_NE(error_of([&] {
                DraftModel(d.path(), shallow, opts());
              }).find("out of range for a target of 2 layers"),
              std::string::npos);
  }
}

TEST(DraftModel, MissingMisshapedAndExtraTensorsAreNamed) {
  test::TempDir d("draft");
  const ModelConfig target = preset_config("tiny");
  const DraftConfig c = write_draft(d.path(), target);
  const std::vector<TensorSpec> good = expected_draft_tensors(c);
  ASSERT_EQ(good.size(), size_t(7 + 11 * c.num_layers));

  std::vector<TensorSpec> specs = good;
  specs.erase(std::find_if(specs.begin(), specs.end(), [](const TensorSpec& t) {
    return t.name == "layers.3.self_attn.k_norm.weight";
  }));
  rewrite_tensors(d.path(), specs);
  EXPECT_NE(error_of([&] {
              DraftModel(d.path(), target, opts());
            }).find("missing tensor layers.3.self_attn.k_norm.weight"),
            std::string::npos);

  specs = good;
  for (TensorSpec& t : specs)
    if (t.name == "fc.weight") t.shape = {c.hidden_size, c.hidden_size};
  rewrite_tensors(d.path(), specs);
  EXPECT_NE(error_of([&] { DraftModel(d.path(), target, opts()); }).find("tensor fc.weight in"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { DraftModel(d.path(), target, opts()); }).find("does not match the config"),
      std::string::npos);

  specs = good;
  specs.push_back(TensorSpec{"layers.9.mlp.gate_proj.weight", DType::BF16, {4, 4}});
  rewrite_tensors(d.path(), specs);
  EXPECT_NE(error_of([&] { DraftModel(d.path(), target, opts()); })
                .find("unexpected tensor(s) not used by the architecture: "
                      "layers.9.mlp.gate_proj.weight"),
            std::string::npos);

  specs = good;
  for (TensorSpec& t : specs)
    if (t.name == "lm_head.weight") t.dtype = DType::F16;
  rewrite_tensors(d.path(), specs);
  EXPECT_NE(error_of([&] { DraftModel(d.path(), target, opts()); }).find("lm_head.weight"),
            std::string::npos);

  // A bad config value.
  rewrite_tensors(d.path(), good);
  nlohmann::json j = draft_config_to_json(c);
  j["markov_rank"] = 0;
  std::ofstream(fs::path(d.path()) / "config.json") << j.dump();
  EXPECT_NE(error_of([&] { DraftModel(d.path(), target, opts()); }).find("'markov_rank'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DraftModel(d / "nowhere", target, opts()); }).find("does not exist"),
            std::string::npos);
}

TEST(DraftModel, MakeModelWritesADraftForATargetCheckpoint) {
  const std::string target = test::shared_checkpoint("tiny", 1);
  test::TempDir d("draftcli");
  auto r = test::run_cli("make-model --draft-for " + target + " --out " + (d / "draft") +
                         " --seed 7 --draft-layers 2 --aux-layers 1,3");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("DSpark draft"), std::string::npos) << r.out;
  DraftModel m(d / "draft", load_config_file(target + "/config.json"), opts());
  EXPECT_EQ(m.config().num_layers, 2);
  EXPECT_EQ(m.config().aux_layer_ids, (std::vector<int>{1, 3}));
  // The defaults, and the errors.
  r = test::run_cli("make-model --draft-for " + target + " --out " + (d / "d2"));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(DraftModel(d / "d2", load_config_file(target + "/config.json"), opts())
                .config()
                .aux_layer_ids,
            default_aux_layer_ids(4));
  r = test::run_cli("make-model --draft-for " + target + " --out " + (d / "d2"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("already holds a checkpoint"), std::string::npos) << r.err;
  r = test::run_cli("make-model --draft-for " + target + " --out " + (d / "d3") +
                    " --aux-layers 1,4");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("aux layer id 4 is out of range for a target of 4 layers"),
            std::string::npos)
      << r.err;
  r = test::run_cli("make-model --draft-for " + (d / "nowhere") + " --out " + (d / "d4"));
  EXPECT_NE(r.status, 0);
  r = test::run_cli("make-model --out " + (d / "d5"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("give --preset or --draft-for"), std::string::npos) << r.err;
}

struct Drafted {
  std::vector<int32_t> tokens;
  std::vector<float> base, biased;
};

Drafted run_draft(const DraftModel& m, const DraftState& s, int32_t anchor, int64_t pos, int B) {
  Drafted d;
  d.tokens.resize(size_t(B));
  d.base.resize(size_t(B) * size_t(m.config().vocab_size));
  d.biased.resize(d.base.size());
  DraftOutputs out;
  out.base_logits = d.base.data();
  out.biased_logits = d.biased.data();
  m.draft(s, anchor, pos, d.tokens, out);
  return d;
}

class DraftForward : public ::testing::Test {
 protected:
  void SetUp() override {
    target_ = preset_config("tiny");
    write_draft(dir_.path(), target_, 3);
  }
  test::TempDir dir_{"draftfwd"};
  ModelConfig target_;
};

TEST_F(DraftForward, OnlyPositionsBeforeTheAnchorWithinTheWindowAreSeen) {
  DraftModel m(dir_.path(), target_, opts());
  const DraftConfig& c = m.config();
  DraftState s = m.new_state();
  std::vector<int32_t> pos(12);
  for (int i = 0; i < 12; ++i) pos[size_t(i)] = i;
  m.update_context(s, random_aux(c, 12, 1), pos);
  EXPECT_EQ(s.rows_written, 12);
  const Drafted a = run_draft(m, s, 5, 12, 8);
  // Deterministic, and tokens are the argmax of the biased logits (lowest id on ties).
  const Drafted again = run_draft(m, s, 5, 12, 8);
  EXPECT_EQ(a.tokens, again.tokens);
  EXPECT_EQ(a.biased, again.biased);
  const int64_t V = c.vocab_size;
  for (int r = 0; r < 8; ++r) {
    const float* row = a.biased.data() + r * V;
    EXPECT_EQ(a.tokens[size_t(r)], int32_t(std::max_element(row, row + V) - row)) << r;
  }
  // Rows at or after the anchor (rejected drafts of a verify) change nothing; a row before it
  // does.
  DraftState s2 = s;
  const std::vector<int32_t> later = {12, 13, 14};
  m.update_context(s2, random_aux(c, 3, 2), later);
  EXPECT_EQ(run_draft(m, s2, 5, 12, 8).base, a.base);
  DraftState s3 = s;
  m.update_context(s3, random_aux(c, 1, 3), std::vector<int32_t>{11});
  EXPECT_NE(run_draft(m, s3, 5, 12, 8).base, a.base);
  // A block smaller than 8 computes the same first rows (causal within the block).
  const Drafted small = run_draft(m, s, 5, 12, 3);
  EXPECT_EQ(std::vector<float>(small.base.begin(), small.base.end()),
            std::vector<float>(a.base.begin(), a.base.begin() + 3 * V));
  EXPECT_EQ(std::vector<int32_t>(a.tokens.begin(), a.tokens.begin() + 3), small.tokens);
  // The ring: position p + window takes p's slot, and p falls out of view.
  DraftState r1 = m.new_state(), r2 = m.new_state();
  const int W = c.window;
  const auto aux1 = random_aux(c, 1, 10), aux2 = random_aux(c, 1, 11);
  m.update_context(r1, aux1, std::vector<int32_t>{3});
  m.update_context(r1, aux2, std::vector<int32_t>{3 + W});
  m.update_context(r2, aux2, std::vector<int32_t>{3 + W});
  EXPECT_EQ(r1.positions, r2.positions);
  EXPECT_EQ(run_draft(m, r1, 5, 4 + W, 4).base, run_draft(m, r2, 5, 4 + W, 4).base);
  // Window edge: at anchor W + 3, position 3 is exactly `window` back and still seen.
  DraftState e1 = m.new_state(), e2 = m.new_state();
  m.update_context(e1, aux1, std::vector<int32_t>{3});
  EXPECT_NE(run_draft(m, e1, 5, 3 + W, 2).base, run_draft(m, e2, 5, 3 + W, 2).base);
  EXPECT_EQ(run_draft(m, e1, 5, 4 + W, 2).base, run_draft(m, e2, 5, 4 + W, 2).base);
}

TEST_F(DraftForward, TheMarkovBiasIsW2TimesW1OfThePreviousToken) {
  DraftModel m(dir_.path(), target_, opts(Precision::FP32));
  const DraftConfig& c = m.config();
  DraftState s = m.new_state();
  std::vector<int32_t> pos = {0, 1, 2, 3};
  m.update_context(s, random_aux(c, 4, 5), pos);
  const Drafted a = run_draft(m, s, 17, 4, 8);
  const int64_t V = c.vocab_size;
  const Mat& w1 = m.weights().markov_w1;
  const Mat& w2 = m.weights().markov_w2;
  double worst = 0;
  int changed = 0;
  for (int r = 0; r < 8; ++r) {
    const int32_t prev = r == 0 ? 17 : a.tokens[size_t(r - 1)];
    const bf16* e = w1.bf16_data() + int64_t(prev) * c.markov_rank;
    for (int64_t t = 0; t < V; ++t) {
      double bias = 0;
      for (int j = 0; j < c.markov_rank; ++j)
        bias += double(bf16_to_f32(w2.bf16_data()[t * c.markov_rank + j])) * bf16_to_f32(e[j]);
      const double got = double(a.biased[size_t(r * V + t)]) - a.base[size_t(r * V + t)];
      worst = std::max(worst, std::abs(got - bias));
    }
    const float* b = a.base.data() + r * V;
    changed += a.tokens[size_t(r)] != int32_t(std::max_element(b, b + V) - b);
  }
  EXPECT_LT(worst, 1e-5);
  // The random draft's bias is strong enough to move picks (what make_random_draft aims at).
  std::printf("[ draft ] Markov bias changed %d of 8 picks\n", changed);
}

TEST_F(DraftForward, Bf16IsCloseToFp32AndErrorsAreNamed) {
  DraftModel b(dir_.path(), target_, opts(Precision::BF16));
  DraftModel f(dir_.path(), target_, opts(Precision::FP32));
  const DraftConfig& c = b.config();
  DraftState sb = b.new_state(), sf = f.new_state();
  std::vector<int32_t> pos(20);
  for (int i = 0; i < 20; ++i) pos[size_t(i)] = i;
  const auto aux = random_aux(c, 20, 9);
  b.update_context(sb, aux, pos);
  f.update_context(sf, aux, pos);
  const Drafted x = run_draft(b, sb, 100, 20, 8), y = run_draft(f, sf, 100, 20, 8);
  double num = 0, den = 0;
  for (size_t i = 0; i < x.base.size(); ++i) {
    num += double(x.base[i] - y.base[i]) * (x.base[i] - y.base[i]);
    den += double(y.base[i]) * y.base[i];
  }
  EXPECT_LT(std::sqrt(num / den), 0.05);  // bf16 noise is ~1% (the golden's emulation)
  EXPECT_GT(std::sqrt(num / den), 0.0);   // and the precisions really differ
  std::vector<int32_t> t(8);
  EXPECT_NE(error_of([&] { b.draft(sb, -1, 20, t); }).find("outside the vocabulary"),
            std::string::npos);
  std::vector<int32_t> none;
  EXPECT_NE(error_of([&] { b.draft(sb, 1, 20, none); }).find("0 tokens asked"), std::string::npos);
  std::vector<int32_t> many(17);
  EXPECT_NE(error_of([&] { b.draft(sb, 1, 20, many); }).find("17 tokens asked"), std::string::npos);
  EXPECT_NE(error_of([&] {
              b.update_context(sb, std::vector<float>(5), pos);
            }).find("5 aux values for 20 rows"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              b.update_context(sb, random_aux(c, 1, 1), std::vector<int32_t>{-2});
            }).find("position -2 is negative"),
            std::string::npos);
  DraftState bad;
  EXPECT_NE(error_of([&] { b.draft(bad, 1, 20, t); }).find("not one of this draft"),
            std::string::npos);
  sb.reset();
  EXPECT_EQ(sb.rows_written, 0);
  EXPECT_EQ(std::count(sb.positions.begin(), sb.positions.end(), -1), c.window);
}

// Model::forward's aux capture: the stream entering each listed layer, per token; prefill and
// decode capture the same rows; ids out of range are errors.
TEST(AuxCapture, ReferenceForwardCapturesTheStreamEnteringLayers) {
  for (const char* preset : {"tiny", "k3-tiny"}) {
    Model m(test::shared_checkpoint(preset, 1), opts(Precision::FP32));
    const int64_t D = m.config().hidden_size;
    const std::vector<int> layers = {3, 1};
    const std::vector<int32_t> ids = {5, 9, 200, 31, 7};
    const int T = int(ids.size());
    std::vector<float> pre(size_t(T) * 2 * D), dec(pre.size());
    SequenceState s = m.new_sequence();
    AuxCapture a{layers, pre.data()};
    m.forward(s, ids, nullptr, false, &a);
    SequenceState s2 = m.new_sequence();
    for (int t = 0; t < T; ++t) {
      AuxCapture one{layers, dec.data() + t * 2 * D};
      m.forward(s2, std::span(&ids[size_t(t)], 1), nullptr, false, &one);
    }
    double worst = 0, scale = 0;
    for (size_t i = 0; i < pre.size(); ++i) {
      worst = std::max(worst, double(std::abs(pre[i] - dec[i])));
      scale = std::max(scale, double(std::abs(pre[i])));
    }
    EXPECT_LT(worst, 1e-4 * scale) << preset;  // the chunked KDA prefill vs the recurrence
    // Layer 1's input is (KL) the embedding plus layer 0's outputs: not the embedding itself.
    const bf16* e = static_cast<const bf16*>(m.weights().embed.row(ids[0]));
    double diff = 0;
    for (int64_t j = 0; j < D; ++j) diff += std::abs(pre[size_t(D + j)] - bf16_to_f32(e[j]));
    EXPECT_GT(diff, 1e-3) << preset;
    // The order given is the layout: the same layers listed the other way swap halves.
    std::vector<float> swapped(pre.size());
    SequenceState s3 = m.new_sequence();
    const std::vector<int> other = {1, 3};
    AuxCapture b{other, swapped.data()};
    m.forward(s3, ids, nullptr, false, &b);
    for (int t = 0; t < T; ++t)
      for (int64_t j = 0; j < D; ++j) {
        ASSERT_EQ(swapped[size_t(t * 2 * D + j)], pre[size_t(t * 2 * D + D + j)]);
        ASSERT_EQ(swapped[size_t(t * 2 * D + D + j)], pre[size_t(t * 2 * D + j)]);
      }
    SequenceState s4 = m.new_sequence();
    const std::vector<int> bad = {int(m.config().num_layers)};
    AuxCapture c{bad, swapped.data()};
    EXPECT_NE(error_of([&] { m.forward(s4, ids, nullptr, false, &c); }).find("out of range"),
              std::string::npos);
    EXPECT_EQ(s4.pos, 0);
  }
}

}  // namespace
}  // namespace md
