// `megadecode quant-eval`: what load-time quantization does to a model's next-token
// distributions, measured (issue 14: accuracy "measured, not assumed"). The same token stream is
// fed to the model as loaded (bf16) and to the model quantized at load (--quantize ...), teacher
// forced, on the reference path; per position it compares the two softmax distributions:
//   KL(P_ref || P_quant) = sum_i p_i (log p_i - log q_i), in double from the fp32 logits,
//   and whether the top-1 tokens agree.
// Prints (and with --json writes) the mean, median, p99 and max KL and the top-1 agreement, as
// llama.cpp's perplexity tool reports its --kl-divergence statistics.
//
//   megadecode quant-eval --model DIR --quantize int4 [--quant-group 128] [--positions 256]
//                         [--text FILE] [--json FILE]
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <vector>

#include "common.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/engine/model.h"
#include "megadecode/model/config.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace md::cli {

namespace {

// log-softmax of one row, in double.
void log_softmax(const float* x, int64_t n, std::vector<double>& out) {
  out.resize(size_t(n));
  double m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, double(x[i]));
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(double(x[i]) - m);
  const double lse = m + std::log(s);
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = double(x[i]) - lse;
}

// Logits of every position of `ids`, teacher forced on the reference path ([n][vocab]).
std::vector<float> all_logits(const RunFlags& f, const std::vector<int32_t>& ids,
                              std::string* what) {
  LoadedModel lm = load_model(f, /*with_tokenizer=*/false);
  Model& m = *lm.model;
  const int64_t V = m.config().vocab_size;
  for (int32_t id : ids)
    MD_CHECK(id >= 0 && id < V, "quant-eval: token id {} is outside the vocabulary ({})", id, V);
  std::vector<float> logits(ids.size() * size_t(V));
  SequenceState s = m.new_sequence();
  constexpr size_t kChunk = 64;  // prompt rows per forward call
  for (size_t at = 0; at < ids.size(); at += kChunk) {
    const size_t n = std::min(kChunk, ids.size() - at);
    m.forward(s, std::span<const int32_t>(ids.data() + at, n), logits.data() + at * size_t(V),
              /*all_positions=*/true);
  }
  const QuantizeReport& q = m.quantize_report();
  if (what)
    *what = q.matrices ? fmt::format("{} matrices quantized, {:.3f} GB -> {:.3f} GB", q.matrices,
                                     q.bytes_before / 1e9, q.bytes_after / 1e9)
                       : "as loaded";
  return logits;
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(std::lround(p / 100 * double(v.size() - 1))))];
}

}  // namespace

void register_quant_eval(CLI::App& app) {
  struct Opts {
    RunFlags f;
    int positions = 256;
    uint64_t seed = 0;
    std::string text, json, reference_precision;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "quant-eval",
      "KL divergence and top-1 agreement of a load-time quantization against the model as loaded");
  o->f.add(c);
  c->add_option("--positions", o->positions, "positions compared (teacher forced)")
      ->check(CLI::Range(1, 1 << 16));
  c->add_option("--text", o->text,
                "a text file whose tokens are fed (default: random ids from the seed)");
  c->add_option("--seed", o->seed, "the random ids' seed");
  c->add_option("--json", o->json, "also write the figures to this JSON file");
  c->add_option("--reference-precision", o->reference_precision,
                "the reference run's activation precision (default: --precision's); e.g. "
                "--reference-precision fp32 --quantize none measures what bf16 activations alone "
                "do, the scale to read a quantization's figures against")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  c->callback([o] {
    MD_CHECK(o->f.tp * o->f.ep == 1, "quant-eval: runs in one process (no --tp / --ep)");
    // The token stream: the text's ids, or random ids (below min(vocab, 10000): ordinary tokens
    // of any Kimi vocabulary).
    std::vector<int32_t> ids;
    RunFlags plain = o->f;
    plain.quantize = "none";
    plain.act_quant = "none";
    if (!o->reference_precision.empty()) plain.precision = o->reference_precision;
    if (!o->text.empty()) {
      std::ifstream in(o->text, std::ios::binary);
      MD_CHECK(in.good(), "quant-eval: cannot read --text {}", o->text);
      std::stringstream ss;
      ss << in.rdbuf();
      const Tokenizer tok = Tokenizer::load(o->f.model);
      ids = tok.encode_ordinary(ss.str());
      MD_CHECK(ids.size() >= 2, "quant-eval: --text {} holds fewer than 2 tokens", o->text);
      if (ids.size() > size_t(o->positions)) ids.resize(size_t(o->positions));
    } else {
      const int64_t V = load_config_file(o->f.model + "/config.json").vocab_size;
      const uint64_t top = uint64_t(std::min<int64_t>(V, 10000) - 1);
      std::mt19937_64 rng(o->seed);
      for (int i = 0; i < o->positions; ++i) ids.push_back(1 + int32_t(rng() % top));
    }
    std::string before_what, after_what;
    const std::vector<float> ref = all_logits(plain, ids, &before_what);
    const std::vector<float> got = all_logits(o->f, ids, &after_what);
    const size_t n = ids.size(), V = ref.size() / n;
    std::vector<double> kl(n), lp, lq;
    size_t agree = 0;
    for (size_t t = 0; t < n; ++t) {
      const float* a = ref.data() + t * V;
      const float* b = got.data() + t * V;
      log_softmax(a, int64_t(V), lp);
      log_softmax(b, int64_t(V), lq);
      double d = 0;
      for (size_t i = 0; i < V; ++i) d += std::exp(lp[i]) * (lp[i] - lq[i]);
      kl[t] = std::max(d, 0.0);  // (rounding can leave a hair below 0 when P == Q)
      agree += std::max_element(a, a + V) - a == std::max_element(b, b + V) - b;
    }
    double mean = 0;
    for (double d : kl) mean += d;
    mean /= double(n);
    const nlohmann::json j = {{"model", o->f.model},
                              {"quantize", o->f.quantize},
                              {"quant_group", o->f.quantize == "none"
                                                  ? 0
                                                  : effective_quant_group(
                                                        *parse_quant_scheme(o->f.quantize),
                                                        o->f.quant_group)},
                              {"quantize_lm_head", o->f.quant_lm_head},
                              {"act_quant", o->f.act_quant},
                              {"precision", o->f.precision},
                              {"reference_precision", plain.precision},
                              {"positions", n},
                              {"tokens", o->text.empty() ? "random ids" : o->text},
                              {"weights", after_what},
                              {"kl_mean", mean},
                              {"kl_median", percentile(kl, 50)},
                              {"kl_p99", percentile(kl, 99)},
                              {"kl_max", percentile(kl, 100)},
                              {"top1_agreement", double(agree) / double(n)}};
    fmt::print(
        "{} ({}): {} positions; KL({} || {} {}) mean {:.6f} median {:.6f} p99 {:.6f} max {:.6f}; "
        "top-1 agreement {:.2f}%\n",
        o->f.model, after_what, n, plain.precision, o->f.precision,
        o->f.quantize + (o->f.act_quant != "none" ? " + " + o->f.act_quant + " activations" : ""),
        mean, percentile(kl, 50), percentile(kl, 99), percentile(kl, 100),
        100.0 * double(agree) / double(n));
    if (!o->json.empty()) {
      std::ofstream out(o->json);
      MD_CHECK(out.good(), "quant-eval: cannot write --json {}", o->json);
      out << j.dump(2) << "\n";
    }
  });
}

}  // namespace md::cli
