// bench: decode speed at batch 1 against the machine's read bandwidth, measured in the same run.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "common.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/kernels/cpu/bandwidth.h"

namespace md::cli {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Bytes that must cross memory in one decode step at batch 1 with `ctx` cached tokens: every
// non-expert weight (one embedding row), the k routed experts of each MoE layer, the KDA state
// read and written, the conv caches, and the MLA latent cache read.
double decode_bytes(const Model& m, int64_t ctx) {
  const ModelConfig& c = m.config();
  const ModelWeights& w = m.weights();
  double b = double(c.hidden_size) * 2 + double(w.lm_head.bytes()) + 4.0 * c.hidden_size;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    if (c.attn_kind[l] == AttnKind::KDA) {
      const KdaWeights& k = L.kda;
      for (const Mat* x : {&k.q, &k.k, &k.v, &k.f_a, &k.f_b, &k.b, &k.g_a, &k.g_b, &k.o})
        b += double(x->bytes());
      b += 2.0 * 4 * double(c.kda_num_heads) * c.kda_head_dim * c.kda_head_dim;
      b += 2.0 * 4 * 3 * double(c.kda_dim()) * (c.kda_conv_size - 1);
    } else {
      const MlaWeights& a = L.mla;
      for (const Mat* x : {&a.q, &a.kv_a, &a.kv_b, &a.o}) b += double(x->bytes());
      b += 4.0 * double(c.mla_cache_width()) * double(ctx + 1);
    }
    if (c.ffn_kind[l] == FfnKind::Dense) {
      b += double(L.dense.bytes());
    } else {
      b += double(L.moe.router.bytes());
      b += double(L.moe.experts[0].bytes()) * c.num_experts_per_token;
      if (L.moe.has_shared) b += double(L.moe.shared.bytes());
    }
  }
  return b;
}

// Current resident set (pages of the mapped checkpoint that were touched count). Sampled after
// each repetition, when the bandwidth probe's buffer has been freed, so the figure is the
// model's own footprint.
double current_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  double pages_total = 0, pages_resident = 0;
  f >> pages_total >> pages_resident;
  return pages_resident * double(sysconf(_SC_PAGESIZE));
}

}  // namespace

void register_bench(CLI::App& app) {
  struct Opts {
    RunFlags f;
    int steps = 16, reps = 5, context = 16;
    std::string json;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("bench", "decode tokens/s at batch 1 vs measured read bandwidth");
  o->f.add(c);
  c->add_option("--steps", o->steps, "decode steps per repetition")->check(CLI::Range(1, 100000));
  c->add_option("--reps", o->reps, "repetitions (bandwidth measured before each)")
      ->check(CLI::Range(1, 1000));
  c->add_option("--context", o->context, "prompt tokens prefilled before decoding")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--json", o->json, "also write the results as JSON to this file");
  c->callback([o] {
    Model m(o->f.model, o->f.options());
    const ModelConfig& cfg = m.config();
    const int64_t V = cfg.vocab_size;
    SequenceState s = m.new_sequence();
    std::vector<int32_t> prompt(size_t(o->context));
    Rng rng(7);
    for (auto& id : prompt) id = int32_t(rng.next() % uint64_t(std::max<int64_t>(V - 256, 1)));
    std::vector<float> logits(static_cast<size_t>(V));
    m.forward(s, prompt, logits.data(), false);
    auto next_token = [&] {
      return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    };
    for (int i = 0; i < 3; ++i) {  // warm-up: touch the weights, settle the threads
      int32_t t = next_token();
      m.forward(s, std::span(&t, 1), logits.data(), false);
    }
    const int64_t ctx_mid = s.pos + int64_t(o->reps) * o->steps / 2;
    const double bytes = decode_bytes(m, ctx_mid);
    std::vector<double> step_ms, bw;
    double rss = current_rss_bytes();
    for (int r = 0; r < o->reps; ++r) {
      bw.push_back(cpu::measure_read_bandwidth_gbps(m.pool(), size_t(1) << 29, 1));
      for (int i = 0; i < o->steps; ++i) {
        int32_t t = next_token();
        double t0 = now_seconds();
        m.forward(s, std::span(&t, 1), logits.data(), false);
        step_ms.push_back((now_seconds() - t0) * 1e3);
      }
      rss = std::max(rss, current_rss_bytes());
    }
    const double ms = median(step_ms), gbw = median(bw);
    const double gbps = bytes / (ms * 1e-3) / 1e9;
    const double weights = double(m.checkpoint().total_bytes());
    std::printf("model %s, %d threads, precision %s, context %lld..%lld\n", o->f.model.c_str(),
                m.pool().size(), o->f.precision.c_str(), (long long)o->context,
                (long long)s.pos);
    std::printf("%-6s %10s %10s %12s %10s %12s %8s\n", "batch", "ms/step", "tok/s", "bytes/step",
                "GB/s", "read GB/s", "% bw");
    std::printf("%-6d %10.3f %10.2f %12s %10.2f %12.2f %7.1f%%\n", 1, ms, 1e3 / ms,
                human_bytes(bytes).c_str(), gbps, gbw, 100.0 * gbps / gbw);
    std::printf("bandwidth samples (GB/s):");
    for (double b : bw) std::printf(" %.1f", b);
    std::printf("\npeak RSS while decoding %s = %.3fx of weights (%s) + sequence state (%s)\n",
                human_bytes(rss).c_str(), rss / (weights + double(s.bytes())),
                human_bytes(weights).c_str(), human_bytes(double(s.bytes())).c_str());
    if (!o->json.empty()) {
      nlohmann::json j = {
          {"model", o->f.model},
          {"threads", m.pool().size()},
          {"precision", o->f.precision},
          {"read_bandwidth_gbps", gbw},
          {"bandwidth_samples_gbps", bw},
          {"results",
           {{{"batch", 1},
             {"executor", "reference"},
             {"ms_per_step", ms},
             {"tokens_per_s", 1e3 / ms},
             {"bytes_per_step", bytes},
             {"gbps", gbps},
             {"pct_of_bandwidth", 100.0 * gbps / gbw}}}},
          {"peak_rss_bytes", rss},
          {"weight_bytes", weights},
      };
      std::ofstream f(o->json);
      f << j.dump(2) << "\n";
      MD_CHECK(f.good(), "cannot write {}", o->json);
    }
  });
}

}  // namespace md::cli
