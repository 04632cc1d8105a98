// The DSpark draft against the independent float64 numpy reference
// (tests/golden/dspark/make_dspark_golden.py, data in tests/data/spec/dspark-tiny): context
// updates (a wrap of the ring, rows past the anchor, more rows than the window in one call),
// blocks of 8 rows, Markov-biased greedy drafting.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "megadecode/model/config.h"
#include "megadecode/model/presets.h"
#include "megadecode/spec/draft_model.h"
#include "test_util.h"

namespace md {
namespace {

using nlohmann::json;

struct DraftGolden {
  std::string dir = test::data_dir() + "/data/spec/dspark-tiny";
  json meta;
  std::vector<float> aux, logits;
  int64_t V = 0;

  DraftGolden() {
    std::ifstream f(dir + "/golden.json");
    EXPECT_TRUE(f.good()) << dir;
    meta = json::parse(f);
    V = meta["config"]["vocab"].get<int64_t>();
    aux.resize(meta["aux_rows"].get<size_t>() * meta["aux_width"].get<size_t>());
    std::ifstream a(dir + "/aux.bin", std::ios::binary);
    a.read(reinterpret_cast<char*>(aux.data()), std::streamsize(aux.size() * 4));
    EXPECT_TRUE(a.good()) << "aux.bin";
    size_t n = 0;
    for (const json& s : meta["steps"]) n += 2 * s["block"].get<size_t>() * size_t(V);
    logits.resize(n);
    std::ifstream l(dir + "/logits.bin", std::ios::binary);
    l.read(reinterpret_cast<char*>(logits.data()), std::streamsize(logits.size() * 4));
    EXPECT_TRUE(l.good()) << "logits.bin";
  }

  // A target the draft fits: only hidden, vocabulary and depth are read by the validation.
  ModelConfig target() const {
    ModelConfig t = preset_config("tiny");
    t.hidden_size = meta["config"]["hidden"].get<int64_t>();
    t.vocab_size = V;
    return t;
  }

  struct Step {
    std::vector<int32_t> tokens;
    std::vector<float> base, biased;
  };
  std::vector<Step> ours(Precision p) const {
    ModelOptions o;
    o.precision = p;
    o.threads = 2;
    o.pin_threads = false;
    DraftModel m(dir, target(), o);
    DraftState s = m.new_state();
    std::vector<Step> out;
    size_t at = 0;
    const size_t W = meta["aux_width"].get<size_t>();
    for (const json& st : meta["steps"]) {
      const auto pos = st["context_positions"].get<std::vector<int32_t>>();
      m.update_context(s, std::span(aux.data() + at * W, pos.size() * W), pos);
      at += pos.size();
      const int B = st["block"].get<int>();
      Step r;
      r.tokens.resize(size_t(B));
      r.base.resize(size_t(B) * size_t(V));
      r.biased.resize(r.base.size());
      DraftOutputs d;
      d.base_logits = r.base.data();
      d.biased_logits = r.biased.data();
      m.draft(s, st["anchor_token"].get<int32_t>(), st["anchor_position"].get<int64_t>(), r.tokens,
              d);
      out.push_back(std::move(r));
    }
    return out;
  }

  // The reference's [B][V] base (which = 0) or biased (1) logits of step i.
  const float* ref(size_t i, int which) const {
    size_t off = 0;
    for (size_t k = 0; k < i; ++k) off += 2 * meta["steps"][k]["block"].get<size_t>() * size_t(V);
    return logits.data() + off +
           size_t(which) * meta["steps"][i]["block"].get<size_t>() * size_t(V);
  }

  static double rel_rms(const float* a, const float* b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t j = 0; j < n; ++j) {
      num += double(a[j] - b[j]) * (a[j] - b[j]);
      den += double(b[j]) * b[j];
    }
    return std::sqrt(num / den);
  }
};

TEST(DraftGolden, DataIsWhatTheTestAssumes) {
  DraftGolden g;
  EXPECT_EQ(g.meta["steps"].size(), 3u);
  // Every slot's float64 margin is comfortable (> 2 ulps + 2 sqrt(2) x the emulation's max
  // change, with room: the generator's selection), the Markov bias changes some picks, and each
  // wrong semantics the generator tried moves the logits by far more than the bf16 tolerance.
  EXPECT_GE(g.meta["markov_bias_changes"].get<int>(), 3);
  for (const auto& [name, v] : g.meta["ablations_base_rel_rms"].items())
    EXPECT_GT(v.get<double>(), 0.2) << name;
  for (const json& s : g.meta["steps"]) EXPECT_GT(s["min_margin"].get<double>(), 0.3);
}

// fp32 activations against float64: unit roundoff 2^-24; each output is the end of a chain of
// ~40 ops (fc, norm, k/v, 2 layers of q/k/v, attention, o, MLP, lm_head, bias) of sums no longer
// than 128, each off by ~sqrt(128) 2^-24 = 7e-7 relative, so ~sqrt(40) x 7e-7 = 4e-6 of the logit
// scale (linear worst case 3e-5). We require RMS(diff) <= 1e-4 RMS(reference) per row, and every
// token equal (margins >= 0.4, errors ~1e-5).
TEST(DraftGolden, Fp32MatchesFloat64) {
  DraftGolden g;
  const auto ours = g.ours(Precision::FP32);
  double worst = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    const json& st = g.meta["steps"][i];
    EXPECT_EQ(ours[i].tokens, st["tokens"].get<std::vector<int32_t>>()) << "step " << i;
    for (int r = 0; r < st["block"].get<int>(); ++r)
      for (int which : {0, 1}) {
        const float* mine = (which ? ours[i].biased : ours[i].base).data() + r * g.V;
        const double d = DraftGolden::rel_rms(mine, g.ref(i, which) + r * g.V, g.V);
        worst = std::max(worst, d);
        EXPECT_LT(d, 1e-4) << "step " << i << " row " << r << (which ? " biased" : " base");
      }
  }
  std::printf("[ draft fp32 ] max relative RMS distance to float64 %.3g\n", worst);
}

// bf16 activations against float64, with the rule of the other goldens (tests/engine/
// test_golden_k3.cpp): golden.json holds, per row, n = RMS(emulated - float64) / RMS(float64),
// the emulation being the reference itself rounded to bf16 at this engine's rounding points.
// Our BF16 mode is another realisation of the same rounding process (same points, other last-ulp
// outcomes where summation order differs), so we require
//     RMS(ours - float64) / RMS(float64) < sqrt(2) n + 2^-9
// (sqrt(2): two independent realisations of noise of one size; the floor: the RMS of rounding the
// logits themselves is 2^-9 / sqrt(3)). n is 0.5-0.8% here; the ablations move the logits by 40%
// or more. Tokens: every slot's float64 margin exceeds 2 ulps of its top logit plus 2 sqrt(2) x
// the emulation's max |logit change| (checked by DataIsWhatTheTestAssumes' generator), so every
// token must agree, which also keeps every later slot's Markov bias comparable.
TEST(DraftGolden, Bf16WithinTheReferencesOwnBf16Noise) {
  DraftGolden g;
  const auto ours = g.ours(Precision::BF16);
  const double floor_tol = std::ldexp(1.0, -9);
  double worst_ratio = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    const json& st = g.meta["steps"][i];
    ASSERT_EQ(ours[i].tokens, st["tokens"].get<std::vector<int32_t>>()) << "step " << i;
    for (int r = 0; r < st["block"].get<int>(); ++r)
      for (int which : {0, 1}) {
        const double noise =
            st[which ? "bf16_rel_rms_biased" : "bf16_rel_rms_base"][size_t(r)].get<double>();
        const double tol = std::sqrt(2.0) * noise + floor_tol;
        const float* mine = (which ? ours[i].biased : ours[i].base).data() + r * g.V;
        const double d = DraftGolden::rel_rms(mine, g.ref(i, which) + r * g.V, g.V);
        worst_ratio = std::max(worst_ratio, d / tol);
        EXPECT_LT(d, tol) << "step " << i << " row " << r << (which ? " biased" : " base")
                          << " (reference's bf16 noise " << noise << ")";
      }
  }
  std::printf("[ draft bf16 ] max distance / bound %.3g\n", worst_ratio);
}

}  // namespace
}  // namespace md
