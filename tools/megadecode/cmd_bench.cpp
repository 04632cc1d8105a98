// bench: the CLI over the benchmark module (bench/bench.h): decode speed per batch size and
// executor against the read bandwidth measured in the same run, prompt prefill through the plan,
// and the verify step's cost; printed as a table, optionally as JSON and an SVG plot.
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
#include "megadecode/bench/bench.h"
#include "megadecode/exec/executor.h"
#include "megadecode/kernels/cpu/bandwidth.h"
#include "megadecode/kernels/cpu/kda.h"
#include "megadecode/kernels/cpu/matmul.h"
#include "megadecode/model/presets.h"
#include "megadecode/spec/speculative.h"
#include "plot_svg.h"

namespace md::cli {

namespace {

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

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char date[64];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return date;
}

}  // namespace

void register_bench(CLI::App& app) {
  struct Opts {
    RunFlags f;
    std::string preset;
    uint64_t seed = 1;
    std::string batches = "1";
    std::string executors = "megakernel,opbyop,reference";
    std::string what = "decode";
    int steps = 16, reps = 5, context = 16, workers = 0;
    bool profile = false;
    int prompt = 512, verify_rows = 8, mixed_chunk = 16;
    std::string chunks = "8,16,32,64";
    std::string json, plot;
    std::string speculative, fixed_lengths, draft_on = "executor";
    int num_draft_tokens = 0, ngram_max = 3;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "bench",
      "decode tokens/s per batch size and executor vs the measured read bandwidth; "
      "prefill and verify steps through the plan");
  o->f.add(c, /*model_required=*/false);
  c->add_option("--preset", o->preset,
                "bench a preset's random checkpoint instead of --model: built in a temporary "
                "directory (deleted after), or, for a decode bench of only CUDA executors "
                "(--device cuda or cuda-sim, no reference), generated in device memory");
  c->add_option("--seed", o->seed, "seed of the --preset checkpoint");
  auto* what_opt = c->add_option(
      "--what", o->what,
      "comma-separated: decode (batch sizes x executors), prefill (a --prompt-token "
      "prompt through the plan in --chunks rows per step vs the reference prefill), "
      "verify (a --verify-rows step of one sequence vs a decode step), mixed (each "
      "--batch of decode rows beside a --mixed-chunk prefill chunk in one step vs two "
      "steps), collectives (under mpirun with --tp/--ep: the latency of each message "
      "a decode step of each --batch sends)");
  CLI::Option* batch_opt = c->add_option(
      "--batch", o->batches, "decode (and speculative): comma-separated batch sizes, e.g. 1,2,4,8");
  c->add_option("--executor", o->executors,
                "comma-separated executors: megakernel, opbyop, reference");
  c->add_option("--workers", o->workers,
                "executor workers (0: one per CPU; on a CUDA device, one block per SM)")
      ->check(CLI::Range(0, 4096));
  c->add_option("--steps", o->steps, "timed steps per executor and repetition")
      ->check(CLI::Range(1, 100000));
  c->add_option("--reps", o->reps, "interleaved repetitions (bandwidth measured before each)")
      ->check(CLI::Range(1, 1000));
  c->add_flag("--profile", o->profile,
              "decode and mixed: time every tile and print, per op, the workers' run and wait time "
              "per step (two clock reads a tile)");
  c->add_option("--context", o->context, "prompt tokens prefilled per sequence before decoding")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--prompt", o->prompt, "prefill: prompt tokens")->check(CLI::Range(1, 1 << 20));
  c->add_option("--chunks", o->chunks, "prefill: comma-separated token rows per plan step");
  c->add_option("--verify-rows", o->verify_rows, "verify: rows of the step (anchor + drafts)")
      ->check(CLI::Range(2, 16));
  c->add_option("--mixed-chunk", o->mixed_chunk, "mixed: prefill rows beside the decode rows")
      ->check(CLI::Range(1, 64));
  c->add_option("--speculative", o->speculative,
                "speculative decoding bench (instead of decode, unless --what is given): ngram, "
                "a DSpark draft checkpoint directory, or oracle (the agreeing draft: plain "
                "greedy decoding's own continuation, recorded first); greedy speculative steps "
                "of one sequence against plain batch-1 decode steps of the same executors, "
                "interleaved");
  c->add_option("--num-draft-tokens", o->num_draft_tokens,
                "speculative: tokens drafted a step, 1..15 (default: 7 with a draft model, 4 "
                "with ngram)")
      ->check(CLI::Range(1, kMaxDraftTokens));
  c->add_option("--fixed-acceptance-length", o->fixed_lengths,
                "speculative: comma-separated fixed acceptance lengths (drafts accepted a step, "
                "0..K), one row each; default: the model's own acceptance");
  c->add_option("--draft-on", o->draft_on,
                "speculative: where a DSpark draft runs, executor (its draft plan) or host");
  c->add_option("--ngram-max", o->ngram_max, "speculative ngram: longest n-gram looked up")
      ->check(CLI::Range(1, 16));
  c->add_option("--json", o->json, "also write the results as JSON to this file");
  c->add_option("--plot", o->plot, "also write an SVG plot of decode tokens/s vs batch size");
  c->callback([o, what_opt, batch_opt] {
    MD_CHECK(o->f.model.empty() != o->preset.empty(),
             "bench: give exactly one of --model or --preset");
    const bool speculative = !o->speculative.empty();
    MD_CHECK(speculative || (o->num_draft_tokens == 0 && o->fixed_lengths.empty()),
             "bench: --num-draft-tokens and --fixed-acceptance-length need --speculative");
    if (speculative) {
      MD_CHECK(o->speculative == "ngram" || o->speculative == "oracle" ||
                   std::filesystem::is_directory(o->speculative),
               "--speculative '{}': expected ngram, oracle or a draft checkpoint directory",
               o->speculative);
      if (what_opt->count() == 0) o->what.clear();
      MD_CHECK(o->draft_on == "executor" || o->draft_on == "host",
               "--draft-on '{}': expected executor or host", o->draft_on);
    }
    const int K = o->num_draft_tokens > 0 ? o->num_draft_tokens : o->speculative == "ngram" ? 4 : 7;
    const std::vector<int> fixed_lengths =
        o->fixed_lengths.empty() ? std::vector<int>{}
                                 : parse_ints("--fixed-acceptance-length", o->fixed_lengths, 0, K);
    const std::vector<int> batches = parse_ints("--batch", o->batches, 1, 1024);
    const std::vector<int> chunks = parse_ints("--chunks", o->chunks, 1, 64);
    std::vector<std::string> names = split(o->executors, ',');
    for (const std::string& n : names)
      MD_CHECK(n == "megakernel" || n == "opbyop" || n == "reference",
               "--executor: unknown executor '{}' (megakernel, opbyop, reference)", n);
    std::vector<std::string> plan_names;
    for (const std::string& n : names)
      if (n != "reference") plan_names.push_back(n);
    bool decode = false, prefill = false, verify = false, mixed = false, collectives = false;
    for (const std::string& w :
         o->what.empty() ? std::vector<std::string>{} : split(o->what, ',')) {
      MD_CHECK(
          w == "decode" || w == "prefill" || w == "verify" || w == "mixed" || w == "collectives",
          "--what: unknown benchmark '{}' (decode, prefill, verify, mixed, collectives)", w);
      decode |= w == "decode";
      prefill |= w == "prefill";
      verify |= w == "verify";
      mixed |= w == "mixed";
      collectives |= w == "collectives";
    }
    MD_CHECK(!(prefill || verify || mixed || speculative) || !plan_names.empty(),
             "bench: prefill, verify, mixed and speculative need a plan executor (megakernel or "
             "opbyop)");
    // A preset decoded only by CUDA executors gets its random weights generated on the device
    // (nothing written or uploaded: the ~100 GB geometries load in seconds); otherwise make-model
    // writes its checkpoint for the host paths.
    const bool device_weights = !o->preset.empty() && o->f.device_kind() != DeviceKind::kCpu &&
                                !prefill && !verify && !mixed && !speculative &&
                                std::find(names.begin(), names.end(), "reference") == names.end();
    TempCheckpoint tmp;
    std::string dir = o->f.model;
    if (!o->preset.empty() && !device_weights) {
      tmp.make(o->preset, o->seed);
      dir = tmp.dir;
    }
    const int W = o->workers > 0 ? o->workers : cpus_per_rank(o->f.tp * o->f.ep);
    // The decode and speculative benches' executors: W on the CPU; on a CUDA device, 0 unless
    // --workers is given (one block per SM; W counts host CPUs, not SMs).
    const bool on_cpu = o->f.device_kind() == DeviceKind::kCpu;
    const int plan_workers = on_cpu || o->workers > 0 ? W : 0;
    RunFlags rf = o->f;
    rf.model = dir;
    if (rf.threads == 0) rf.threads = W;
    // The decode bench keeps each batch's prefilled snapshot and the reference path's working
    // copies in the model's pool: two sequences per batch row.
    // (The mixed bench keeps batch + 1 there.)
    rf.states.max_sequences = std::max(rf.states.max_sequences,
                                       2 * *std::max_element(batches.begin(), batches.end()) + 1);
    LoadedModel lm;
    if (device_weights) {
      lm.model = std::make_unique<Model>(preset_config(o->preset), o->seed, rf.options());
      print_quantize_report(*lm.model);
    } else
      lm = load_model(rf, /*with_tokenizer=*/false);
    Model& m = *lm.model;
    if (m.shard().sharded() && std::find(names.begin(), names.end(), "reference") != names.end()) {
      // A distributed rank runs plan executors only (the reference path is whole-model).
      names.erase(std::find(names.begin(), names.end(), "reference"));
      MD_CHECK(!names.empty(), "bench: with --tp/--ep give --executor megakernel and/or opbyop");
    }
    const bench::Machine mach = bench::this_machine();
    const std::string model_name = o->preset.empty() ? o->f.model : "preset " + o->preset;
    Progress progress(1.0);
    auto on_progress = [&](double f, const std::string& what) { progress.update(f, what); };
    nlohmann::json j = {
        {"machine",
         {{"cpu_model", mach.cpu_model},
          {"cores", mach.cores},
          {"matmul_isa", mach.matmul_isa},
          {"kda_isa", mach.kda_isa}}},
        {"date", utc_now()},
        {"model", o->preset.empty() ? o->f.model : "preset:" + o->preset},
        {"precision", o->f.precision},
        {"workers", W},
        {"reference_threads", m.pool().size()},
        {"device", o->f.device},
    };
    if (plan_workers > 0)
      std::printf("model %s, %d workers (reference path: %d threads), precision %s, matmul %s\n",
                  model_name.c_str(), W, m.pool().size(), o->f.precision.c_str(),
                  mach.matmul_isa.c_str());
    else
      std::printf(
          "model %s, one block per SM of the device (reference path: %d threads), "
          "precision %s\n",
          model_name.c_str(), m.pool().size(), o->f.precision.c_str());
    std::printf("machine: %s, %d CPUs\n", mach.cpu_model.c_str(), mach.cores);
    if (device_weights)
      std::printf("weights: preset %s, seed %llu, generated on the device (make-model's bytes)\n",
                  o->preset.c_str(), (unsigned long long)o->seed);
    j["weights_generated_on_device"] = device_weights;
    if (decode) {
      bench::DecodeOptions d;
      d.batches = batches;
      d.executors = names;
      d.steps = o->steps;
      d.reps = o->reps;
      d.context = o->context;
      d.workers = plan_workers;
      d.device = o->f.device_kind();
      d.progress = on_progress;
      d.profile = o->profile;
      const bench::DecodeResult r = bench::run_decode(m, d);
      progress.done();
      j["device_name"] = r.device;
      j["workers"] = r.workers;
      if (m.weights_on_host()) {
        // After the timed steps, so the pages they read are in (model/mapped_file.h).
        const Checkpoint& ck = m.checkpoint();
        const double huge = double(ck.huge_page_bytes()), all = double(ck.file_bytes());
        std::printf("\nweights: %s %s, %.1f%% of them on 2 MiB pages\n", human_bytes(all).c_str(),
                    rf.no_mmap ? "copied into memory (--no-mmap)" : "mapped from the files",
                    all > 0 ? 100.0 * huge / all : 0.0);
        j["weights_load"] = rf.no_mmap ? "copy" : "mmap";
        j["weights_huge_page_fraction"] = all > 0 ? huge / all : 0.0;
      }
      std::printf(
          "\n== decode: positions %d..%lld (every timed block restarts from the prefilled "
          "context); read bandwidth median %.1f GB/s (samples:",
          o->context, (long long)r.max_pos, r.bandwidth_gbps);
      for (double b : r.bandwidth_samples_gbps) std::printf(" %.1f", b);
      std::printf(")\n%d timed steps x %d interleaved repetitions per executor and batch\n",
                  o->steps, o->reps);
      if (d.device != DeviceKind::kCpu)
        std::printf(
            "plan executors on --device %s (%s, %d blocks); the bandwidth is the device's%s\n",
            std::string(device_kind_name(d.device)).c_str(), r.device.c_str(), r.workers,
            d.device == DeviceKind::kCudaSim
                ? " (the simulation: host memory and CPU timings, not a GPU's)"
                : "");
      const bool dist = m.shard().sharded();
      if (dist)
        std::printf(
            "distributed: %s; bytes/step are this rank's (it holds %s of weights), "
            "coll ms: its time inside the collectives per step\n",
            dist::describe_shard(m.shard()).c_str(), human_bytes(m.shard_bytes().held()).c_str());
      std::printf("\n");
      std::printf("%-6s %-11s %10s %10s %12s %9s %7s%s\n", "batch", "executor", "ms/step", "tok/s",
                  "bytes/step", "GB/s", "% bw", dist ? "  coll ms  calls" : "");
      nlohmann::json results = nlohmann::json::array(), ratios = nlohmann::json::object();
      std::vector<PlotSeries> series(names.size());
      for (size_t e = 0; e < names.size(); ++e) series[e].name = names[e];
      for (size_t i = 0; i < r.cells.size(); ++i) {
        const bench::DecodeCell& cl = r.cells[i];
        std::printf("%-6d %-11s %10.3f %10.1f %12s %9.2f %6.1f%%", cl.batch, cl.executor.c_str(),
                    cl.ms, cl.tokens_per_s, human_bytes(cl.bytes).c_str(), cl.gbps,
                    cl.pct_of_bandwidth);
        if (dist) std::printf(" %8.3f %6.0f", cl.collective_ms, cl.collective_calls);
        std::printf("\n");
        results.push_back({{"batch", cl.batch},
                           {"executor", cl.executor},
                           {"ms_per_step", cl.ms},
                           {"ms_per_step_reps", cl.ms_reps},
                           {"tokens_per_s", cl.tokens_per_s},
                           {"bytes_per_step", cl.bytes},
                           {"gbps", cl.gbps},
                           {"pct_of_bandwidth", cl.pct_of_bandwidth},
                           {"collective_ms_per_step", cl.collective_ms},
                           {"collective_calls_per_step", cl.collective_calls}});
        series[i % names.size()].points.emplace_back(cl.batch, cl.tokens_per_s);
        const bool last_of_batch = i + 1 == r.cells.size() || r.cells[i + 1].batch != cl.batch;
        if (last_of_batch && r.megakernel_over_opbyop.count(cl.batch)) {
          const double ratio = r.megakernel_over_opbyop.at(cl.batch);
          ratios[std::to_string(cl.batch)] = ratio;
          std::printf("%-6s megakernel / opbyop speed: %.3fx (median of %d interleaved reps)\n", "",
                      ratio, o->reps);
        }
      }
      for (size_t i = 0; i < r.cells.size(); ++i) {
        const bench::DecodeCell& cl = r.cells[i];
        if (cl.run_ms_by_op.empty()) continue;
        std::printf(
            "\nprofile, batch %d, %s: ms per step, summed over the workers\n%-16s %9s %9s\n",
            cl.batch, cl.executor.c_str(), "op", "run", "wait");
        nlohmann::json prof = nlohmann::json::object();
        for (size_t k = 0; k < cl.run_ms_by_op.size(); ++k) {
          if (cl.run_ms_by_op[k] == 0 && cl.wait_ms_by_op[k] == 0) continue;
          const std::string op(plan::op_name(plan::Op(k)));
          std::printf("%-16s %9.3f %9.3f\n", op.c_str(), cl.run_ms_by_op[k], cl.wait_ms_by_op[k]);
          prof[op] = {{"run_ms", cl.run_ms_by_op[k]}, {"wait_ms", cl.wait_ms_by_op[k]}};
        }
        results[i]["profile_ms_per_step"] = prof;
      }
      const double weights = double(m.checkpoint().total_bytes());
      std::printf("peak RSS while decoding %s (weights %s)\n",
                  human_bytes(r.peak_rss_bytes).c_str(), human_bytes(weights).c_str());
      j["context"] = o->context;
      j["steps"] = o->steps;
      j["reps"] = o->reps;
      j["read_bandwidth_gbps"] = r.bandwidth_gbps;
      j["bandwidth_samples_gbps"] = r.bandwidth_samples_gbps;
      j["results"] = results;
      j["ratio_megakernel_over_opbyop"] = ratios;
      j["peak_rss_bytes"] = r.peak_rss_bytes;
      j["weight_bytes"] = weights;
      if (!o->plot.empty()) {
        std::ofstream f(o->plot);
        f << line_plot_svg(
            fmt::format("decode throughput, {} ({} workers)",
                        o->preset.empty() ? std::filesystem::path(o->f.model).filename().string()
                                          : o->preset,
                        W),
            "batch size", "tokens / s", series, true);
        MD_CHECK(f.good(), "cannot write {}", o->plot);
      }
    }
    if (collectives) {
      bench::CollectiveOptions co;
      co.batches = batches;
      const std::vector<bench::CollectiveCell> cells = bench::run_collectives(m, co);
      std::printf("\n== collectives: %s over %s, %d calls each after a barrier\n",
                  dist::describe_shard(m.shard()).c_str(),
                  std::string(m.communicator()->backend()).c_str(), co.iters);
      std::printf("%-6s %-36s %12s %10s %10s\n", "batch", "message", "bytes/rank", "us p50",
                  "us p90");
      nlohmann::json rows = nlohmann::json::array();
      for (const bench::CollectiveCell& cl : cells) {
        std::printf("%-6d %-36s %12s %10.1f %10.1f\n", cl.batch, cl.what.c_str(),
                    human_bytes(cl.bytes).c_str(), cl.us_median, cl.us_p90);
        rows.push_back({{"batch", cl.batch},
                        {"what", cl.what},
                        {"bytes", cl.bytes},
                        {"us_median", cl.us_median},
                        {"us_p90", cl.us_p90}});
      }
      j["collectives"] = rows;
    }
    if (prefill) {
      bench::PrefillOptions p;
      p.prompt = o->prompt;
      p.chunks = chunks;
      p.executors = plan_names;
      p.reference = std::find(names.begin(), names.end(), "reference") != names.end();
      p.reps = o->reps;
      p.workers = W;
      p.progress = on_progress;
      const bench::PrefillResult r = bench::run_prefill(m, p);
      progress.done();
      std::printf(
          "\n== prefill: a %d-token prompt, %d reps (median); %.4f GFLOP per token; "
          "bf16 GEMM rate of this machine %.1f GFLOP/s (L2-resident, 16 rows)\n\n",
          o->prompt, o->reps, r.flops_per_token / 1e9, r.bf16_peak_gflops);
      std::printf("%-11s %6s %10s %10s %9s %7s %9s\n", "executor", "chunk", "s", "tok/s", "GFLOP/s",
                  "% peak", "vs ref");
      nlohmann::json cells = nlohmann::json::array();
      for (const bench::PrefillCell& cl : r.cells) {
        std::printf("%-11s %6s %10.3f %10.1f %9.1f %6.1f%% %8.2fx\n", cl.executor.c_str(),
                    cl.chunk ? std::to_string(cl.chunk).c_str() : "-", cl.seconds, cl.tokens_per_s,
                    cl.gflops, 100.0 * cl.gflops / r.bf16_peak_gflops, cl.over_reference);
        cells.push_back({{"executor", cl.executor},
                         {"chunk", cl.chunk},
                         {"seconds", cl.seconds},
                         {"seconds_reps", cl.seconds_reps},
                         {"tokens_per_s", cl.tokens_per_s},
                         {"gflops", cl.gflops},
                         {"speed_over_reference", cl.over_reference}});
      }
      std::printf("fastest chunk (%s): %d rows\n", plan_names[0].c_str(), r.best_chunk);
      j["prefill"] = {{"prompt", o->prompt},
                      {"reps", o->reps},
                      {"flops_per_token", r.flops_per_token},
                      {"bf16_peak_gflops", r.bf16_peak_gflops},
                      {"best_chunk", r.best_chunk},
                      {"results", cells}};
    }
    if (verify) {
      bench::VerifyOptions v;
      v.rows = o->verify_rows;
      v.context = o->context;
      v.steps = o->steps;
      v.reps = o->reps;
      v.workers = W;
      v.executors = plan_names;
      v.progress = on_progress;
      const bench::VerifyResult r = bench::run_verify(m, v);
      progress.done();
      std::printf(
          "\n== verify: one sequence at position %d, a %d-row step kept for a commit vs "
          "a decode step; read bandwidth median %.1f GB/s\n\n",
          o->context, r.rows, r.bandwidth_gbps);
      std::printf("%-11s %12s %12s %12s %14s\n", "executor", "decode ms", "verify ms", "commit ms",
                  "verify/decode");
      nlohmann::json cells = nlohmann::json::array();
      for (const bench::VerifyCell& cl : r.cells) {
        std::printf("%-11s %12.3f %12.3f %12.3f %13.2fx\n", cl.executor.c_str(), cl.decode_ms,
                    cl.verify_ms, cl.commit_ms, cl.verify_over_decode);
        cells.push_back({{"executor", cl.executor},
                         {"decode_ms", cl.decode_ms},
                         {"verify_ms", cl.verify_ms},
                         {"commit_ms", cl.commit_ms},
                         {"verify_over_decode", cl.verify_over_decode}});
      }
      j["verify"] = {{"rows", r.rows},
                     {"context", o->context},
                     {"read_bandwidth_gbps", r.bandwidth_gbps},
                     {"results", cells}};
    }
    if (mixed) {
      nlohmann::json all = nlohmann::json::array();
      for (int B : batches) {
        bench::MixedOptions x;
        x.batch = B;
        x.chunk = o->mixed_chunk;
        x.context = o->context;
        x.steps = o->steps;
        x.reps = o->reps;
        x.workers = plan_workers;
        x.executors = plan_names;
        x.progress = on_progress;
        x.profile = o->profile;
        const bench::MixedResult r = bench::run_mixed(m, x);
        progress.done();
        std::printf(
            "\n== mixed: %d decode rows + a %d-row prefill chunk at position %d, one step vs "
            "two; read bandwidth median %.1f GB/s\n\n",
            r.batch, r.chunk, o->context, r.bandwidth_gbps);
        std::printf("%-11s %12s %14s %16s\n", "executor", "mixed ms", "separate ms",
                    "separate/mixed");
        for (const bench::MixedCell& cl : r.cells) {
          std::printf("%-11s %12.3f %14.3f %15.2fx\n", cl.executor.c_str(), cl.mixed_ms,
                      cl.separate_ms, cl.separate_over_mixed);
          all.push_back({{"batch", r.batch},
                         {"chunk", r.chunk},
                         {"executor", cl.executor},
                         {"mixed_ms", cl.mixed_ms},
                         {"separate_ms", cl.separate_ms},
                         {"separate_over_mixed", cl.separate_over_mixed}});
        }
        for (const bench::MixedCell& cl : r.cells) {
          if (cl.mixed_run_ms_by_op.empty()) continue;
          std::printf(
              "\nprofile, %s: ms per step summed over the workers, the mixed step and the two "
              "separate steps\n%-16s %9s %9s %12s %12s\n",
              cl.executor.c_str(), "op", "mixed run", "wait", "separate run", "wait");
          for (size_t k = 0; k < cl.mixed_run_ms_by_op.size(); ++k) {
            if (cl.mixed_run_ms_by_op[k] == 0 && cl.mixed_wait_ms_by_op[k] == 0 &&
                cl.separate_run_ms_by_op[k] == 0 && cl.separate_wait_ms_by_op[k] == 0)
              continue;
            std::printf("%-16s %9.3f %9.3f %12.3f %12.3f\n",
                        std::string(plan::op_name(plan::Op(k))).c_str(), cl.mixed_run_ms_by_op[k],
                        cl.mixed_wait_ms_by_op[k], cl.separate_run_ms_by_op[k],
                        cl.separate_wait_ms_by_op[k]);
          }
        }
      }
      j["mixed"] = {{"context", o->context}, {"results", all}};
    }
    if (speculative) {
      SpeculativeFlags sf;
      const bool oracle = o->speculative == "oracle";
      sf.speculative = oracle ? std::string("ngram") : o->speculative;
      sf.num_draft_tokens = K;
      sf.ngram_max = o->ngram_max;
      sf.draft_on = o->draft_on;
      LoadedDrafter ld = load_drafter(sf, m);
      bench::SpeculativeBenchOptions x;
      x.num_draft_tokens = K;
      x.fixed_lengths = fixed_lengths;
      x.oracle = oracle;
      if (batch_opt->count() > 0) x.batches = batches;
      x.steps = o->steps;
      x.reps = o->reps;
      x.context = o->context;
      x.workers = W;
      x.executors = plan_names;
      x.device = o->f.device_kind();
      x.progress = on_progress;
      const bench::SpeculativeBenchResult r = bench::run_speculative(
          m, [&](Executor* ex) { return ld.make(ex); }, x);
      progress.done();
      std::printf(
          "\n== speculative: %s drafter%s, K = %d drafts (verify steps of %d rows a sequence), "
          "greedy, sequences from position %d (times per batched step, tok/s summed); %d steps "
          "x %d reps (medians); plain = decode steps of the same executor at the same batch in "
          "the same reps; read bandwidth median %.1f GB/s\n\n",
          r.drafter.c_str(),
          ld.model ? (o->draft_on == "host" ? " on the host" : " on the executor") : "",
          r.num_draft_tokens, r.num_draft_tokens + 1, o->context, o->steps, o->reps,
          r.bandwidth_gbps);
      std::printf("%-11s %5s %6s %9s %9s %9s %9s %9s %10s %9s %10s %8s\n", "executor", "batch",
                  "fixed", "ms/step", "draft ms", "verify ms", "acc/step", "tok/step", "tok/s",
                  "plain ms", "plain tok/s", "speedup");
      nlohmann::json cells = nlohmann::json::array();
      for (const bench::SpeculativeCell& cl : r.cells) {
        std::printf("%-11s %5d %6s %9.3f %9.3f %9.3f %9.2f %9.2f %10.1f %9.3f %10.1f %7.2fx\n",
                    cl.executor.c_str(), cl.batch,
                    cl.fixed < 0 ? "-" : std::to_string(cl.fixed).c_str(), cl.step_ms, cl.draft_ms,
                    cl.verify_ms, cl.accepted_per_step, cl.tokens_per_step, cl.tokens_per_s,
                    cl.plain_ms, cl.plain_tokens_per_s, cl.speedup);
        cells.push_back({{"executor", cl.executor},
                         {"batch", cl.batch},
                         {"fixed_acceptance_length", cl.fixed},
                         {"ms_per_step", cl.step_ms},
                         {"draft_ms_per_step", cl.draft_ms},
                         {"verify_ms_per_step", cl.verify_ms},
                         {"accepted_per_step", cl.accepted_per_step},
                         {"tokens_per_step", cl.tokens_per_step},
                         {"tokens_per_s", cl.tokens_per_s},
                         {"plain_ms_per_step", cl.plain_ms},
                         {"plain_tokens_per_s", cl.plain_tokens_per_s},
                         {"speedup_over_plain", cl.speedup}});
      }
      j["speculative"] = {{"drafter", r.drafter},
                          {"draft_on", ld.model ? o->draft_on : std::string("-")},
                          {"num_draft_tokens", r.num_draft_tokens},
                          {"context", o->context},
                          {"steps", o->steps},
                          {"reps", o->reps},
                          {"read_bandwidth_gbps", r.bandwidth_gbps},
                          {"results", cells}};
    }
    if (!o->json.empty()) {
      std::ofstream f(o->json);
      f << j.dump(2) << "\n";
      MD_CHECK(f.good(), "cannot write {}", o->json);
    }
  });
}

}  // namespace md::cli
