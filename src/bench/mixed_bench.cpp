// A mixed step (decode rows of several sequences beside one sequence's prefill chunk, what a
// continuously batching server runs) against the same work as two steps: a decode step of the
// batch, then the chunk alone (bench.h).
#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/bench/bench.h"
#include "megadecode/exec/executor.h"
#include "megadecode/kernels/cpu/bandwidth.h"

namespace md::bench {

MixedResult run_mixed(Model& m, const MixedOptions& o) {
  MD_CHECK(o.batch >= 1 && o.batch <= 256, "bench: mixed batch {} is outside 1..256", o.batch);
  MD_CHECK(o.chunk >= 1 && o.chunk <= plan::kMaxRows, "bench: mixed chunk {} is outside 1..{}",
           o.chunk, plan::kMaxRows);
  MD_CHECK(o.steps >= 1 && o.reps >= 1 && o.context >= 1, "bench: steps, reps, context >= 1");
  const int64_t V = m.config().vocab_size;
  const int B = o.batch, W = o.workers > 0 ? o.workers : default_cpu_workers(m);
  Rng rng(17);
  auto ids = [&](int n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& id : v) id = int32_t(rng.next() % uint64_t(std::max<int64_t>(V - 256, 1)));
    return v;
  };
  // B decoding sequences and one prefilling sequence, all at `context` (reference path).
  std::vector<SequenceState> base;
  for (int b = 0; b <= B; ++b) {
    base.push_back(m.new_sequence());
    m.forward(base.back(), ids(o.context), nullptr, false);
  }
  const std::vector<int32_t> dec = ids(B);
  std::vector<std::vector<int32_t>> chunks;
  for (int i = 0; i < o.steps; ++i) chunks.push_back(ids(o.chunk));
  MixedResult res;
  res.batch = B;
  res.chunk = o.chunk;
  std::vector<double> bw;
  const double total = double(o.reps) * double(o.executors.size());
  double done = 0;
  for (const std::string& n : o.executors) {
    ExecutorOptions eo;
    eo.workers = W;
    eo.profile = o.profile;
    eo.states = m.options().states;
    std::unique_ptr<Executor> ex = make_executor(m, parse_executor_kind(n), B + 1, eo);
    std::vector<SequenceState> work;
    for (int b = 0; b <= B; ++b) work.push_back(ex->new_sequence());
    auto restore = [&] {
      for (int b = 0; b <= B; ++b) work[size_t(b)].copy_from(base[size_t(b)]);
    };
    std::vector<float> logits(size_t(B + 1) * size_t(V));
    // The profile of the timed steps (per op, seconds summed over the steps; null: not timed).
    struct Profile {
      std::vector<double> run = std::vector<double>(plan::kNumOps),
                          wait = std::vector<double>(plan::kNumOps);
      int steps = 0;
    } prof_mixed, prof_separate;
    auto add_profile = [&](Profile* pr) {
      if (!pr || !o.profile) return;
      const StepStats& st = ex->last_step_stats();
      for (int k = 0; k < plan::kNumOps; ++k) {
        pr->run[size_t(k)] += st.run_by_op[size_t(k)];
        pr->wait[size_t(k)] += st.wait_by_op[size_t(k)];
      }
    };
    // The decode rows' logits and the chunk's last row, as a server asks for them.
    auto mixed_block = [&](Profile* pr) {
      restore();
      double t = 0;
      for (int i = 0; i < o.steps; ++i) {
        std::vector<StepSeq> q;
        for (int b = 0; b < B; ++b)
          q.push_back(StepSeq{&work[size_t(b)], std::span(&dec[size_t(b)], 1), LogitRows::kLast});
        q.push_back(StepSeq{&work[size_t(B)], chunks[size_t(i)], LogitRows::kLast});
        const double t0 = now_seconds();
        ex->step(q, logits.data());
        t += now_seconds() - t0;
        add_profile(pr);
        if (pr) ++pr->steps;
      }
      return t / o.steps * 1e3;
    };
    auto separate_block = [&](Profile* pr) {
      restore();
      double t = 0;
      for (int i = 0; i < o.steps; ++i) {
        std::vector<StepSeq> q;
        for (int b = 0; b < B; ++b)
          q.push_back(StepSeq{&work[size_t(b)], std::span(&dec[size_t(b)], 1), LogitRows::kLast});
        const StepSeq c{&work[size_t(B)], chunks[size_t(i)], LogitRows::kLast};
        const double t0 = now_seconds();
        ex->step(q, logits.data());
        add_profile(pr);
        ex->step(std::span(&c, 1), logits.data());
        t += now_seconds() - t0;
        add_profile(pr);
        if (pr) ++pr->steps;
      }
      return t / o.steps * 1e3;
    };
    mixed_block(nullptr);  // warm-up: the plans compiled, the pages touched
    separate_block(nullptr);
    std::vector<double> mx, sp, ratio;
    for (int rep = 0; rep < o.reps; ++rep) {
      if (o.progress)
        o.progress(done / total, fmt::format("mixed {} rep {}/{}", n, rep + 1, o.reps));
      bw.push_back(cpu::measure_read_bandwidth_gbps(m.pool(), size_t(1) << 29, 1));
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      const double a = mixed_block(&prof_mixed), s = separate_block(&prof_separate);
      mx.push_back(a);
      sp.push_back(s);
      ratio.push_back(s / a);
      done += 1;
    }
    MixedCell cell;
    cell.executor = n;
    cell.mixed_ms = median(mx);
    cell.separate_ms = median(sp);
    cell.separate_over_mixed = median(ratio);
    if (o.profile) {
      auto per_step = [](const std::vector<double>& v, int steps) {
        std::vector<double> ms(v.size());
        for (size_t k = 0; k < v.size(); ++k) ms[k] = v[k] / std::max(steps, 1) * 1e3;
        return ms;
      };
      cell.mixed_run_ms_by_op = per_step(prof_mixed.run, prof_mixed.steps);
      cell.mixed_wait_ms_by_op = per_step(prof_mixed.wait, prof_mixed.steps);
      cell.separate_run_ms_by_op = per_step(prof_separate.run, prof_separate.steps);
      cell.separate_wait_ms_by_op = per_step(prof_separate.wait, prof_separate.steps);
    }
    res.cells.push_back(std::move(cell));
  }
  cpu::release_bandwidth_buffer();
  res.bandwidth_gbps = median(bw);
  return res;
}

}  // namespace md::bench
