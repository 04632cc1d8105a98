// bench: decode speed per batch size and executor against the machine's read bandwidth,
// measured in the same run. Executors are interleaved (A B A B ...) repetition by repetition,
// with a bandwidth sample before each repetition, and the megakernel / op-by-op ratio is the
// median of the per-repetition ratios (BENCHMARKS.md "Rules for figures").
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "common.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/exec/executor.h"
#include "megadecode/kernels/cpu/bandwidth.h"
#include "megadecode/kernels/cpu/kda.h"
#include "megadecode/kernels/cpu/matmul.h"
#include "megadecode/model/presets.h"
#include "plot_svg.h"

namespace md::cli {

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double current_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  double pages_total = 0, pages_resident = 0;
  f >> pages_total >> pages_resident;
  return pages_resident * double(sysconf(_SC_PAGESIZE));
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      auto p = line.find(':');
      return p == std::string::npos ? line : line.substr(p + 2);
    }
  return "unknown";
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(sep, i);
    if (j == std::string::npos) j = s.size();
    std::string t = s.substr(i, j - i);
    while (!t.empty() && t.front() == ' ') t.erase(t.begin());
    while (!t.empty() && t.back() == ' ') t.pop_back();
    out.push_back(t);
    i = j + 1;
  }
  return out;
}

// A preset's random checkpoint in a temporary directory (RAM-backed /dev/shm when it has room),
// removed when the bench ends, also on error.
struct TempCheckpoint {
  std::string dir;
  ~TempCheckpoint() {
    if (!dir.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  }
  void make(const std::string& preset, uint64_t seed) {
    const ModelConfig cfg = preset_config(preset);
    const double bytes = model_sizes(cfg).total_bytes;
    std::string base;
    struct statvfs st {};
    if (statvfs("/dev/shm", &st) == 0 && double(st.f_bavail) * double(st.f_frsize) > 2.5 * bytes)
      base = "/dev/shm";
    else if (const char* t = std::getenv("TMPDIR"); t && *t)
      base = t;
    else
      base = "/tmp";
    std::string tmpl = base + "/md_bench_" + preset + "_XXXXXX";
    MD_CHECK(mkdtemp(tmpl.data()) != nullptr, "cannot create a temporary directory in {}", base);
    dir = tmpl;
    ThreadPool pool(0, false);
    make_random_checkpoint(cfg, dir, seed, 1, pool, isatty(2));
  }
};

// One executor under test: a plan executor, or the reference path one sequence at a time.
struct Runner {
  std::string name;
  std::unique_ptr<Executor> ex;  // null: reference
};

int64_t argmax(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

class Progress {
 public:
  Progress(double total) : total_(total), tty_(isatty(2)) {}
  void update(double done, const std::string& what) {
    if (!tty_) return;
    const int width = 30, fill = int(width * std::min(done / total_, 1.0));
    std::fprintf(stderr, "\r[%s%s] %3.0f%% %-40s", std::string(size_t(fill), '#').c_str(),
                 std::string(size_t(width - fill), ' ').c_str(), 100.0 * done / total_,
                 what.c_str());
    std::fflush(stderr);
  }
  void done() {
    if (tty_) std::fprintf(stderr, "\r%80s\r", "");
  }

 private:
  double total_;
  bool tty_;
};

}  // namespace

void register_bench(CLI::App& app) {
  struct Opts {
    RunFlags f;
    std::string preset;
    uint64_t seed = 1;
    std::string batches = "1";
    std::string executors = "megakernel,opbyop,reference";
    int steps = 16, reps = 5, context = 16, workers = 0;
    std::string json, plot;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "bench", "decode tokens/s per batch size and executor vs the measured read bandwidth");
  o->f.add(c, /*model_required=*/false);
  c->add_option("--preset", o->preset,
                "bench a preset's random checkpoint (built in a temporary directory, deleted "
                "after) instead of --model");
  c->add_option("--seed", o->seed, "seed of the --preset checkpoint");
  c->add_option("--batch", o->batches, "comma-separated batch sizes, e.g. 1,2,4,8");
  c->add_option("--executor", o->executors,
                "comma-separated executors: megakernel, opbyop, reference");
  c->add_option("--workers", o->workers, "executor workers (0: one per CPU)")
      ->check(CLI::Range(0, 4096));
  c->add_option("--steps", o->steps, "timed decode steps per executor and repetition")
      ->check(CLI::Range(1, 100000));
  c->add_option("--reps", o->reps, "interleaved repetitions (bandwidth measured before each)")
      ->check(CLI::Range(1, 1000));
  c->add_option("--context", o->context, "prompt tokens prefilled per sequence before decoding")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--json", o->json, "also write the results as JSON to this file");
  c->add_option("--plot", o->plot, "also write an SVG plot of tokens/s vs batch size");
  c->callback([o] {
    MD_CHECK(o->f.model.empty() != o->preset.empty(),
             "bench: give exactly one of --model or "
             "--preset");
    std::vector<int> batches;
    for (const std::string& t : split(o->batches, ',')) {
      char* end = nullptr;
      const long v = std::strtol(t.c_str(), &end, 10);
      MD_CHECK(!t.empty() && end && *end == '\0' && v >= 1 && v <= 1024,
               "--batch: '{}' is not a batch size in 1..1024", t);
      batches.push_back(int(v));
    }
    std::vector<std::string> names = split(o->executors, ',');
    for (const std::string& n : names)
      MD_CHECK(n == "megakernel" || n == "opbyop" || n == "reference",
               "--executor: unknown executor '{}' (megakernel, opbyop, reference)", n);
    TempCheckpoint tmp;
    std::string dir = o->f.model;
    if (!o->preset.empty()) {
      tmp.make(o->preset, o->seed);
      dir = tmp.dir;
    }
    const int W = o->workers > 0 ? o->workers : online_cpus();
    RunFlags rf = o->f;
    rf.model = dir;
    if (rf.threads == 0) rf.threads = W;
    LoadedModel lm = load_model(rf, /*with_tokenizer=*/false);
    Model& m = *lm.model;
    const ModelConfig& cfg = m.config();
    const int64_t V = cfg.vocab_size;
    const int maxb = *std::max_element(batches.begin(), batches.end());
    std::vector<Runner> runners;
    for (const std::string& n : names) {
      Runner r;
      r.name = n;
      if (n != "reference") {
        ExecutorOptions eo;
        eo.workers = W;
        r.ex = make_executor(m, parse_executor_kind(n), maxb, eo);
      }
      runners.push_back(std::move(r));
    }
    const size_t E = runners.size();

    struct Cell {
      std::vector<double> ms;  // per repetition
      double bytes = 0;
      int n = 0;
    };
    std::map<std::pair<int, size_t>, Cell> cells;
    std::vector<double> bw;
    double rss = current_rss_bytes();
    int64_t max_pos = 0;
    Progress progress(double(batches.size()) * o->reps * double(E));
    double done = 0;
    Rng rng(7);
    for (int B : batches) {
      // B sequences prefilled with `context` random tokens; decode continues greedily.
      std::vector<SequenceState> seqs;
      std::vector<int32_t> tokens(static_cast<size_t>(B));
      std::vector<float> logits(size_t(B) * size_t(V));
      for (int b = 0; b < B; ++b) {
        progress.update(done, fmt::format("batch {}: prefill {}/{}", B, b + 1, B));
        SequenceState s = m.new_sequence();
        std::vector<int32_t> prompt(static_cast<size_t>(o->context));
        for (auto& id : prompt) id = int32_t(rng.next() % uint64_t(std::max<int64_t>(V - 256, 1)));
        m.forward(s, prompt, logits.data(), false);
        tokens[size_t(b)] = int32_t(argmax(logits.data(), V));
        seqs.push_back(std::move(s));
      }
      // Every timed block starts from this snapshot, so each executor and repetition decodes
      // the same tokens at the same positions (context .. context + steps).
      const std::vector<SequenceState> snapshot = seqs;
      const std::vector<int32_t> first_tokens = tokens;
      auto restore = [&] {
        for (size_t b = 0; b < seqs.size(); ++b) seqs[b] = snapshot[b];
        tokens = first_tokens;
      };
      std::vector<SequenceState*> ptrs;
      for (auto& s : seqs) ptrs.push_back(&s);
      // One step of a runner (timed part only: the argmax that picks the next tokens is not).
      auto step = [&](Runner& r, double* seconds, double* bytes) {
        std::vector<int64_t> pos;
        for (auto* s : ptrs) pos.push_back(s->pos);
        const double t0 = now_seconds();
        if (r.ex) {
          r.ex->step(ptrs, tokens, logits.data());
        } else {
          for (int b = 0; b < B; ++b)
            m.forward(*ptrs[size_t(b)], std::span(&tokens[size_t(b)], 1),
                      logits.data() + size_t(b) * size_t(V), false);
        }
        if (seconds) *seconds += now_seconds() - t0;
        if (bytes) {
          if (r.ex) {
            *bytes += r.ex->last_step_stats().total();
          } else {
            // One forward per sequence: each reads every weight it uses.
            int moe = 0;
            for (FfnKind k : cfg.ffn_kind) moe += k == FfnKind::MoE;
            for (int64_t p : pos)
              *bytes +=
                  decode_step_bytes(m, std::span(&p, 1), cfg.num_experts_per_token * moe).total();
          }
        }
        for (int b = 0; b < B; ++b)
          tokens[size_t(b)] = int32_t(argmax(logits.data() + size_t(b) * size_t(V), V));
      };
      for (Runner& r : runners) {  // warm-up: plans compiled, weights and caches touched
        restore();
        for (int i = 0; i < 2; ++i) step(r, nullptr, nullptr);
      }
      for (int rep = 0; rep < o->reps; ++rep) {
        progress.update(done, fmt::format("batch {}: read bandwidth", B));
        bw.push_back(cpu::measure_read_bandwidth_gbps(m.pool(), size_t(1) << 29, 1));
        for (size_t e = 0; e < E; ++e) {
          Runner& r = runners[e];
          progress.update(done, fmt::format("batch {}: {} rep {}/{}", B, r.name, rep + 1, o->reps));
          // Let the previous runner's idle threads stop spinning, then one untimed step (on a
          // scratch copy) to wake this runner's threads.
          restore();
          std::this_thread::sleep_for(std::chrono::milliseconds(3));
          step(r, nullptr, nullptr);
          restore();
          double secs = 0, bytes = 0;
          for (int i = 0; i < o->steps; ++i) step(r, &secs, &bytes);
          for (auto* s : ptrs) max_pos = std::max(max_pos, s->pos);
          Cell& cell = cells[{B, e}];
          cell.ms.push_back(secs / o->steps * 1e3);
          cell.bytes += bytes;
          cell.n += o->steps;
          done += 1;
        }
        rss = std::max(rss, current_rss_bytes());
      }
    }
    progress.done();
    cpu::release_bandwidth_buffer();

    const double gbw = median(bw);
    std::printf(
        "model %s, %d workers (reference path: %d threads), precision %s, matmul %s, "
        "positions %d..%lld (every timed block restarts from the prefilled context)\n",
        o->preset.empty() ? o->f.model.c_str() : ("preset " + o->preset).c_str(), W,
        m.pool().size(), o->f.precision.c_str(), cpu::matmul_isa(), o->context, (long long)max_pos);
    std::printf("machine: %s, %d CPUs; read bandwidth median %.1f GB/s (samples:",
                cpu_model().c_str(), online_cpus(), gbw);
    for (double b : bw) std::printf(" %.1f", b);
    std::printf(")\n%d timed steps x %d interleaved repetitions per executor and batch\n\n",
                o->steps, o->reps);
    std::printf("%-6s %-11s %10s %10s %12s %9s %7s\n", "batch", "executor", "ms/step", "tok/s",
                "bytes/step", "GB/s", "% bw");
    nlohmann::json results = nlohmann::json::array(), ratios = nlohmann::json::object();
    std::vector<PlotSeries> series(E);
    for (size_t e = 0; e < E; ++e) series[e].name = runners[e].name;
    for (int B : batches) {
      size_t mk = E, ob = E;
      for (size_t e = 0; e < E; ++e) {
        const Cell& cell = cells[{B, e}];
        const double ms = median(cell.ms), bytes = cell.bytes / std::max(cell.n, 1);
        const double gbps = bytes / (ms * 1e-3) / 1e9, tps = B * 1e3 / ms;
        std::printf("%-6d %-11s %10.3f %10.1f %12s %9.2f %6.1f%%\n", B, runners[e].name.c_str(), ms,
                    tps, human_bytes(bytes).c_str(), gbps, 100.0 * gbps / gbw);
        results.push_back({{"batch", B},
                           {"executor", runners[e].name},
                           {"ms_per_step", ms},
                           {"ms_per_step_reps", cell.ms},
                           {"tokens_per_s", tps},
                           {"bytes_per_step", bytes},
                           {"gbps", gbps},
                           {"pct_of_bandwidth", 100.0 * gbps / gbw}});
        series[e].points.emplace_back(B, tps);
        if (runners[e].name == "megakernel") mk = e;
        if (runners[e].name == "opbyop") ob = e;
      }
      if (mk < E && ob < E) {
        std::vector<double> r;
        const auto& a = cells[{B, mk}].ms;
        const auto& b = cells[{B, ob}].ms;
        for (size_t i = 0; i < a.size() && i < b.size(); ++i) r.push_back(b[i] / a[i]);
        const double ratio = median(r);
        ratios[std::to_string(B)] = ratio;
        std::printf("%-6s megakernel / opbyop speed: %.3fx (median of %zu interleaved reps)\n", "",
                    ratio, r.size());
      }
    }
    const double weights = double(m.checkpoint().total_bytes());
    std::printf("peak RSS while decoding %s (weights %s)\n", human_bytes(rss).c_str(),
                human_bytes(weights).c_str());
    if (!o->json.empty()) {
      const std::time_t now = std::time(nullptr);
      char date[64];
      std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
      nlohmann::json j = {
          {"machine",
           {{"cpu_model", cpu_model()},
            {"cores", online_cpus()},
            {"matmul_isa", cpu::matmul_isa()},
            {"kda_isa", cpu::kda_isa()}}},
          {"date", date},
          {"model", o->preset.empty() ? o->f.model : "preset:" + o->preset},
          {"precision", o->f.precision},
          {"workers", W},
          {"reference_threads", m.pool().size()},
          {"context", o->context},
          {"steps", o->steps},
          {"reps", o->reps},
          {"read_bandwidth_gbps", gbw},
          {"bandwidth_samples_gbps", bw},
          {"results", results},
          {"ratio_megakernel_over_opbyop", ratios},
          {"peak_rss_bytes", rss},
          {"weight_bytes", weights},
      };
      std::ofstream f(o->json);
      f << j.dump(2) << "\n";
      MD_CHECK(f.good(), "cannot write {}", o->json);
    }
    if (!o->plot.empty()) {
      std::ofstream f(o->plot);
      f << line_plot_svg(
          fmt::format(
              "decode throughput, {} ({} workers)",
              o->preset.empty() ? std::filesystem::path(o->f.model).filename().string() : o->preset,
              W),
          "batch size", "tokens / s", series, true);
      MD_CHECK(f.good(), "cannot write {}", o->plot);
    }
  });
}

}  // namespace md::cli
