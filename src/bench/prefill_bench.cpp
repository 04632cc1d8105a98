// Prompt prefill through the plan (chunks of token rows) against the reference path's one-call
// prefill, with the machine's bf16 dot-product rate for scale; and the cost of a multi-row
// verify step against a decode step (bench.h).
#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/bench/bench.h"
#include "megadecode/exec/executor.h"
#include "megadecode/kernels/cpu/bandwidth.h"
#include "megadecode/kernels/cpu/matmul.h"

namespace md::bench {

namespace {

std::vector<int32_t> random_ids(const Model& m, int n, uint64_t seed) {
  Rng rng(seed);
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = int32_t(rng.next() % uint64_t(std::max<int64_t>(V - 256, 1)));
  return ids;
}

// The bf16 GEMM rate of every pool thread at once on its own L2-resident weight block
// (256 rows x 1024, 512 KiB) and 16 activation rows, as prefill's row blocks run it.
double bf16_gemm_peak_gflops(ThreadPool& pool) {
  constexpr int64_t kRows = 256, kK = 1024, kB = 16;
  const int T = pool.size();
  std::vector<std::vector<bf16>> w(size_t(T), std::vector<bf16>(size_t(kRows * kK)));
  std::vector<std::vector<float>> x(size_t(T), std::vector<float>(size_t(kB * kK)));
  std::vector<std::vector<float>> y(size_t(T), std::vector<float>(size_t(kB * kRows)));
  Rng rng(3);
  for (int t = 0; t < T; ++t) {
    for (auto& v : w[size_t(t)]) v = f32_to_bf16(float(rng.uniform()) - 0.5f);
    for (auto& v : x[size_t(t)]) v = round_bf16(float(rng.uniform()) - 0.5f);
  }
  std::vector<double> rate(static_cast<size_t>(T), 0.0);
  pool.run([&](int t, int) {
    auto once = [&] {
      cpu::matmul_bf16(w[size_t(t)].data(), kK, 0, kRows, x[size_t(t)].data(), int(kB), kK,
                       y[size_t(t)].data(), kRows, true);
    };
    once();
    int iters = 0;
    const double t0 = now_seconds();
    double t1 = t0;
    while (t1 - t0 < 0.3) {
      once();
      ++iters;
      t1 = now_seconds();
    }
    rate[size_t(t)] = 2.0 * kRows * kK * kB * iters / (t1 - t0) / 1e9;
  });
  double sum = 0;
  for (double r : rate) sum += r;
  return sum;
}

// 2 x the matmul weights one token multiplies: non-expert projections and top-k experts, the
// embedding lookup and lm_head excluded (prefill computes lm_head for the last row only).
double prefill_flops_per_token(const ModelConfig& c) {
  const ModelSizes s = model_sizes(c);
  return 2.0 * (double(s.active_params) - 2.0 * double(c.vocab_size) * double(c.hidden_size));
}

}  // namespace

PrefillResult run_prefill(Model& m, const PrefillOptions& o) {
  MD_CHECK(o.prompt >= 1 && o.reps >= 1, "bench: prefill prompt and reps must be >= 1");
  MD_CHECK(!o.chunks.empty(), "bench: no prefill chunk sizes");
  const int64_t V = m.config().vocab_size;
  const int W = o.workers > 0 ? o.workers : default_cpu_workers(m);
  PrefillResult res;
  res.flops_per_token = prefill_flops_per_token(m.config());
  std::vector<std::unique_ptr<Executor>> ex;
  for (const std::string& n : o.executors) {
    ExecutorOptions eo;
    eo.workers = W;
    eo.states = m.options().states;
    ex.push_back(make_executor(m, parse_executor_kind(n), 1, eo));
  }
  // Cells: [reference,] then executor x chunk.
  std::vector<PrefillCell> cells;
  if (o.reference) cells.push_back(PrefillCell{"reference", 0, {}, 0, 0, 0, 0});
  for (const std::string& n : o.executors)
    for (int ch : o.chunks) cells.push_back(PrefillCell{n, ch, {}, 0, 0, 0, 0});
  const std::vector<int32_t> ids = random_ids(m, o.prompt, 11);
  std::vector<float> logits(static_cast<size_t>(V));
  auto run = [&](const PrefillCell& c) {
    if (c.executor == "reference") {
      SequenceState s = m.new_sequence();
      const double t0 = now_seconds();
      m.forward(s, ids, logits.data(), false);
      return now_seconds() - t0;
    }
    const size_t e =
        size_t(std::find(o.executors.begin(), o.executors.end(), c.executor) - o.executors.begin());
    SequenceState s = ex[e]->new_sequence();
    const double t0 = now_seconds();
    ex[e]->prefill(s, ids, logits.data(), c.chunk);
    return now_seconds() - t0;
  };
  const double total = double(o.reps + 1) * double(cells.size());
  double done = 0;
  for (int rep = -1; rep < o.reps; ++rep)  // rep -1: warm-up (plans compiled, pages touched)
    for (PrefillCell& c : cells) {
      if (o.progress)
        o.progress(done / total,
                   fmt::format("prefill {} {} rep {}/{}", c.executor, c.chunk, rep + 1, o.reps));
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      const double s = run(c);
      if (rep >= 0) c.seconds_reps.push_back(s);
      done += 1;
    }
  for (PrefillCell& c : cells) {
    c.seconds = median(c.seconds_reps);
    c.tokens_per_s = o.prompt / c.seconds;
    c.gflops = res.flops_per_token * o.prompt / c.seconds / 1e9;
    if (o.reference) {
      std::vector<double> r;
      for (size_t i = 0; i < c.seconds_reps.size(); ++i)
        r.push_back(cells[0].seconds_reps[i] / c.seconds_reps[i]);
      c.over_reference = median(r);
    }
  }
  double best = 0;
  for (const PrefillCell& c : cells)
    if (!o.executors.empty() && c.executor == o.executors[0] && (best == 0 || c.seconds < best)) {
      best = c.seconds;
      res.best_chunk = c.chunk;
    }
  res.cells = std::move(cells);
  res.bf16_peak_gflops = bf16_gemm_peak_gflops(m.pool());
  return res;
}

VerifyResult run_verify(Model& m, const VerifyOptions& o) {
  MD_CHECK(o.rows >= 2 && o.rows <= 16, "bench: --verify rows {} is outside 2..16", o.rows);
  MD_CHECK(o.steps >= 1 && o.reps >= 1 && o.context >= 1, "bench: steps, reps, context >= 1");
  const int64_t V = m.config().vocab_size;
  const int W = o.workers > 0 ? o.workers : default_cpu_workers(m);
  VerifyResult res;
  res.rows = o.rows;
  SequenceState base = m.new_sequence();
  std::vector<float> logits(size_t(o.rows) * size_t(V));
  m.forward(base, random_ids(m, o.context, 5), logits.data(), false);
  const std::vector<int32_t> draft = random_ids(m, o.rows, 6);
  std::vector<double> bw;
  const double total = double(o.reps) * double(o.executors.size());
  double done = 0;
  for (const std::string& n : o.executors) {
    ExecutorOptions eo;
    eo.workers = W;
    eo.states = m.options().states;
    std::unique_ptr<Executor> ex = make_executor(m, parse_executor_kind(n), 1, eo);
    StepOptions keep;
    keep.keep_for_commit = true;
    std::vector<double> dec, ver, com, ratio;
    // Each block starts from a copy of the prefilled base in the executor's pool.
    SequenceState s = ex->new_sequence();
    auto decode_block = [&] {
      s.copy_from(base);
      SequenceState* p = &s;
      double t = 0;
      for (int i = 0; i < o.steps; ++i) {
        const double t0 = now_seconds();
        ex->step(std::span(&p, 1), std::span(&draft[size_t(i % o.rows)], 1), logits.data());
        t += now_seconds() - t0;
      }
      return t / o.steps * 1e3;
    };
    auto verify_block = [&](double* commit_ms) {
      s.copy_from(base);
      const StepSeq q{&s, draft, LogitRows::kAll};
      double t = 0, tc = 0;
      for (int i = 0; i < o.steps; ++i) {
        const double t0 = now_seconds();
        ex->step(std::span(&q, 1), logits.data(), nullptr, {}, keep);
        const double t1 = now_seconds();
        ex->commit(s, o.rows / 2);
        tc += now_seconds() - t1;
        t += t1 - t0;
      }
      *commit_ms = tc / o.steps * 1e3;
      return t / o.steps * 1e3;
    };
    double c = 0;
    decode_block();  // warm-up: both plans compiled
    verify_block(&c);
    for (int rep = 0; rep < o.reps; ++rep) {
      if (o.progress)
        o.progress(done / total, fmt::format("verify {} rep {}/{}", n, rep + 1, o.reps));
      bw.push_back(cpu::measure_read_bandwidth_gbps(m.pool(), size_t(1) << 29, 1));
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      const double d = decode_block();
      const double v = verify_block(&c);
      dec.push_back(d);
      ver.push_back(v);
      com.push_back(c);
      ratio.push_back(v / d);
      done += 1;
    }
    res.cells.push_back(VerifyCell{n, median(dec), median(ver), median(com), median(ratio)});
  }
  cpu::release_bandwidth_buffer();
  res.bandwidth_gbps = median(bw);
  return res;
}

}  // namespace md::bench
