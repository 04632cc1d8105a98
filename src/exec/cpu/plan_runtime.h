// The CPU executors' run-time state of a bound plan (executor.cpp): the per-worker counter slots
// and which waits a worker checks, and each worker's status for the watchdog and the profile.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "megadecode/plan/plan.h"
#include "tiles.h"

// An unnamed namespace, as when this lived in executor.cpp (its only includer): internal linkage
// gives the same code.
namespace md {
namespace {  // NOLINT(google-build-namespaces)

using plan::Instr;
using plan::kNone;
using plan::Wait;

inline bool reached(uint32_t value, uint32_t target) {
  return int32_t(value - target) >= 0;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

enum WorkerState : uint32_t { kIdle, kRunning, kWaiting, kAtBarrier, kStalled, kFinished };

// What a worker is doing, for the watchdog's report. Written by its worker (relaxed), read by
// whichever worker reports.
struct alignas(64) WorkerStatus {
  std::atomic<uint64_t> progress{0};  // instructions completed, ever
  std::atomic<uint32_t> state{kIdle};
  std::atomic<uint32_t> instr{kNone};
  std::atomic<uint32_t> counter{kNone};
  std::atomic<uint32_t> target{0};
  std::atomic<uint32_t> from{kNone};  // the worker whose signals it waits for (kNone: unreachable)
  std::atomic<uint32_t> phase{0};
  // Written by the worker only, read by the host after the step.
  double wait_s = 0;
  std::array<double, plan::kNumOps> wait_by_op{};
  std::array<double, plan::kNumOps> run_by_op{};
};

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

// A plan bound to this executor, with its counters. The counters are sharded by worker:
// worker u counts its own signals of counter c in slot (u, c), which only u writes (a plain
// release store: no locked read-modify-write, and signallers do not bounce one line between
// them). A wait on c by worker v is satisfied when every other worker u that signals c has
// published its n(u, c) signals of the step: slot(u, c) = (epoch + 1) * n(u, c). v's own
// signals of c need no check: all of c's signallers precede its waiters in the global order, so
// v's come earlier in v's own queue. The counter in the plan's sense is the sum of its slots; a
// worker does not publish signals that no other worker waits for.
struct PlanRuntime {
  plan::Plan plan;
  std::vector<exec::WeightView> weights;
  uint32_t epoch = 0;
  int W = 0;
  size_t C = 0, stride = 0;
  std::unique_ptr<std::atomic<uint32_t>[]> slots;                // [W][stride]
  std::vector<uint8_t> publish;                                  // [W][C]
  std::vector<std::vector<std::pair<int, uint32_t>>> producers;  // per counter: (u, n(u, c))
  // Per megakernel queue position, the waits to check (bit k: wait[k]). A wait is skipped when
  // the worker already waited for the same counter earlier in its queue, or when no other worker
  // signals the counter.
  std::vector<std::vector<uint8_t>> wait_mask;

  std::atomic<uint32_t>& slot(int u, uint32_t c) { return slots[size_t(u) * stride + c]; }
  uint32_t value(uint32_t c) {
    uint32_t v = 0;
    for (int u = 0; u < W; ++u) v += slot(u, c).load(std::memory_order_relaxed);
    return v;
  }

  void prepare() {
    W = plan.workers;
    C = plan.counters.size();
    stride = (C + 15) / 16 * 16;
    slots = std::make_unique<std::atomic<uint32_t>[]>(size_t(W) * stride);
    analyze();
  }

  void analyze() {
    std::vector<uint32_t> n(size_t(W) * C, 0);
    for (int w = 0; w < W; ++w)
      for (const Instr& in : plan.queues[size_t(w)])
        if (in.signal != kNone) ++n[size_t(w) * C + in.signal];
    producers.assign(C, {});
    for (size_t c = 0; c < C; ++c)
      for (int u = 0; u < W; ++u)
        if (n[size_t(u) * C + c]) producers[c].emplace_back(u, n[size_t(u) * C + c]);
    publish.assign(size_t(W) * C, 0);
    wait_mask.assign(size_t(W), {});
    std::vector<char> seen(C);
    for (int w = 0; w < W; ++w) {
      std::fill(seen.begin(), seen.end(), 0);
      for (const Instr& in : plan.queues[size_t(w)]) {
        uint8_t m = 0;
        for (int k = 0; k < 2; ++k) {
          const Wait& wt = in.wait[k];
          if (wt.counter == kNone) continue;
          const uint32_t c = wt.counter;
          if (wt.target > plan.counters[c].per_step) {  // unreachable: reported by the watchdog
            m |= uint8_t(1u << k);
            continue;
          }
          bool remote = false;
          for (auto [u, cnt] : producers[c]) remote |= u != w;
          if (seen[c] || !remote) continue;
          seen[c] = 1;
          m |= uint8_t(1u << k);
          for (auto [u, cnt] : producers[c])
            if (u != w) publish[size_t(u) * C + c] = 1;
        }
        wait_mask[size_t(w)].push_back(m);
      }
    }
  }

  void reset_counters() {
    for (size_t i = 0; i < size_t(W) * stride; ++i) slots[i].store(0, std::memory_order_relaxed);
    epoch = 0;
  }
};

}  // namespace
}  // namespace md
