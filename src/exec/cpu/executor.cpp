// The CPU executors of the decode plan: the persistent megakernel and the op-by-op baseline,
// the watchdog, the per-batch plan cache and the per-step bookkeeping.
//
// Why the megakernel cannot deadlock. The compiler emits instructions in a global order in which
// every counter's signallers all precede every instruction that waits on that counter
// (validate_plan checks it), and every wait asks for exactly the signals the counter receives in
// one step (target = per_step, shifted by the epoch). Each worker's queue is a subsequence of
// that global order. Suppose a step stopped with some instruction unfinished, and let i be the
// unfinished instruction that comes first in the global order. Everything before i in its
// worker's queue precedes i globally, so it is finished and i is at the head of that queue. Every
// instruction i waits for (every signaller of its counters) also precedes i globally, so it is
// finished and has signalled; i's waits are satisfied, so its worker runs it: a contradiction.
// Hence every step completes, for any number of workers and any timing. The executor's
// shortcuts keep the premises: a worker skips only waits that are met when reached (a repeat of
// an earlier wait, or a counter only it signals, whose signals come earlier in its own queue),
// and publishes every signal another worker waits for (PlanRuntime). The op-by-op executor
// runs barrier phases in which no instruction waits on a counter signalled in its own phase
// (again checked by validate_plan), so a phase only needs earlier phases, which the barriers
// complete first.
//
// Memory ordering: a tile writes its outputs with plain stores, then publishes its signal with a
// release store to its worker's slot of the counter (see PlanRuntime); a consumer's acquire load
// that observes a producer worker's target synchronizes with the store that wrote it, which that
// worker made after all its earlier tiles, so everything they wrote happens before the consumer
// goes on. Chains of waits compose (happens-before is transitive), which the plan relies on: a
// tile reads buffers whose producers it reaches through several waits. Steps are separated by the
// thread pool's fork-join, which orders one step's tiles before the next step's.
#include "megadecode/exec/cpu_executor.h"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <mutex>
#include <thread>

#include "../draft_layout.h"
#include "../step_layout.h"
#include "megadecode/base/error.h"
#include "megadecode/base/threads.h"
#include "megadecode/base/util.h"
#include "megadecode/dist/communicator.h"
#include "megadecode/kernels/cpu/expert_slots.h"
#include "plan_runtime.h"
#include "tiles.h"

namespace md {

using plan::Instr;
using plan::kNone;
using plan::Wait;

std::string_view executor_name(ExecutorKind k) {
  return k == ExecutorKind::kMegakernel ? "megakernel" : "opbyop";
}

ExecutorKind parse_executor_kind(std::string_view name) {
  if (name == "megakernel") return ExecutorKind::kMegakernel;
  if (name == "opbyop") return ExecutorKind::kOpByOp;
  fail("unknown executor '{}' (expected megakernel or opbyop)", name);
}

struct CpuExecutor::Impl {
  Model& model;
  int max_batch;
  ExecutorKind kind;
  ExecutorOptions opt;
  int W;
  double spin_seconds;
  std::unique_ptr<ThreadPool> pool;   // the workers (and commit's replay)
  std::unique_ptr<StatePool> states;  // this backend's sequences (host memory)
  std::map<std::pair<int, int>, std::unique_ptr<PlanRuntime>> plans;  // by (batch, rows)
  // The attached draft (attach_draft) and its plans by (batch, context rows, block rows).
  DraftConfig draft_cfg;
  const DraftWeights* draft_w = nullptr;
  std::map<std::tuple<int, int, int>, std::unique_ptr<PlanRuntime>> draft_plans;
  std::unique_ptr<uint8_t, AlignedFree> arena;
  size_t arena_cap = 0;
  std::vector<exec::Scratch> scratch;
  std::unique_ptr<WorkerStatus[]> status;
  alignas(64) std::atomic<bool> abort{false};
  alignas(64) std::atomic<uint32_t> bar_count{0};
  alignas(64) std::atomic<uint32_t> bar_gen{0};
  std::mutex err_mu;
  std::string err;
  StepStats stats;
  std::vector<float> scratch_logits;  // a step's logits when the caller wants only next_ids

  Impl(Model& m, int mb, ExecutorKind k, const ExecutorOptions& o)
      : model(m), max_batch(mb), kind(k), opt(o) {
    MD_CHECK(mb >= 1 && mb <= 1024, "executor: max_batch {} is outside 1..1024", mb);
    m.require_host_weights("the CPU executors");
    MD_CHECK(o.workers >= 0 && o.workers <= 4096, "executor: workers {} is outside 0..4096",
             o.workers);
    MD_CHECK(o.watchdog_seconds > 0, "executor: the watchdog timeout must be positive");
    W = o.workers > 0 ? o.workers : default_cpu_workers(model);
    // Oversubscribed workers must hand the CPU over quickly to whoever holds the work.
    spin_seconds = W > online_cpus() ? 5e-6 : 200e-6;
    pool = std::make_unique<ThreadPool>(W, o.pin);
    PoolOptions po = o.states;
    po.max_sequences = std::max(po.max_sequences, mb);  // a full batch always fits
    states = std::make_unique<StatePool>(m.config(), m.numerics().round_bf16, po);
    scratch.resize(size_t(W));
    status = std::make_unique<WorkerStatus[]>(size_t(W));
  }

  ~Impl() = default;

  // ---- plans --------------------------------------------------------------------------------

  PlanRuntime& runtime(int batch, int rows) {
    auto it = plans.find({batch, rows});
    if (it != plans.end()) return *it->second;
    auto rt = std::make_unique<PlanRuntime>();
    plan::PlanOptions po = opt.plan;
    po.batch = batch;
    po.rows = rows;
    po.workers = W;
    po.world = model.shard().world();
    po.rank = model.shard().rank;
    rt->plan = plan::compile_decode_plan(model.config(), &model.weights(), po);
    for (const plan::WeightRef& r : rt->plan.weights) {
      rt->weights.push_back(exec::bind_weight(model.weights(), r));
      // A distributed rank holds only its group's routed experts (the tiles skip the others).
      const bool expert = r.kind == plan::WeightKind::kExpertGate ||
                          r.kind == plan::WeightKind::kExpertUp ||
                          r.kind == plan::WeightKind::kExpertDown;
      MD_CHECK(rt->weights.back().data != nullptr || (expert && model.shard().sharded()),
               "decode plan: weight {} of layer {} is absent", plan::weight_kind_name(r.kind),
               r.layer);
    }
    prepare(*rt);
    return *plans.emplace(std::make_pair(batch, rows), std::move(rt)).first->second;
  }

  // The draft's plan for (batch, context rows, block rows), bound to the attached draft.
  PlanRuntime& draft_runtime(int batch, int ctx_rows, int rows) {
    MD_CHECK(draft_w, "draft step: no draft is attached to this executor (attach_draft)");
    const auto key = std::make_tuple(batch, ctx_rows, rows);
    auto it = draft_plans.find(key);
    if (it != draft_plans.end()) return *it->second;
    auto rt = std::make_unique<PlanRuntime>();
    plan::PlanOptions po = opt.plan;
    po.batch = batch;
    po.rows = rows;
    po.workers = W;
    rt->plan = plan::compile_draft_plan(draft_cfg, po, ctx_rows);
    for (const plan::WeightRef& r : rt->plan.weights)
      rt->weights.push_back(exec::bind_draft_weight(*draft_w, r));
    prepare(*rt);
    return *draft_plans.emplace(key, std::move(rt)).first->second;
  }

  // Counters, scratch and the (shared) arena for a compiled plan.
  void prepare(PlanRuntime& rt) {
    rt.prepare();
    const size_t nf = exec::scratch_floats(rt.plan), ni = exec::scratch_ints(rt.plan);
    for (exec::Scratch& s : scratch) {
      if (s.f.size() < nf) s.f.resize(nf);
      if (s.i.size() < ni) s.i.resize(ni);
    }
    if (rt.plan.arena_bytes > arena_cap) {
      const size_t cap = (rt.plan.arena_bytes + 4095) / 4096 * 4096;
      void* p = std::aligned_alloc(64, cap);
      MD_CHECK(p, "executor: cannot allocate a {} activation arena", human_bytes(double(cap)));
      std::memset(p, 0, cap);
      arena.reset(static_cast<uint8_t*>(p));
      arena_cap = cap;
    }
  }

  // ---- waiting and the watchdog -------------------------------------------------------------

  uint64_t progress_sum() const {
    uint64_t s = 0;
    for (int w = 0; w < W; ++w) s += status[w].progress.load(std::memory_order_relaxed);
    return s;
  }

  // Waits until pred(): spins (pause), then yields, then sleeps while nothing progresses.
  // Returns false on abort, or when no worker completed an instruction for the watchdog
  // timeout (the first worker to notice records the report and raises the abort flag).
  // While waiting, the worker streams the weights of the tile it waits to run (pf).
  template <class Pred>
  bool wait_until(PlanRuntime& rt, Pred pred, exec::Prefetcher* pf = nullptr) {
    if (pred()) return true;
    const double t0 = now_seconds();
    for (int i = 1;; ++i) {
      if (pf && !pf->done())
        pf->step(4);
      else
        cpu_relax();
      if (pred()) return true;
      if ((i & 63) == 0) {
        if (abort.load(std::memory_order_relaxed)) return false;
        if (now_seconds() - t0 > spin_seconds) break;
      }
    }
    uint64_t last = progress_sum();
    double last_t = now_seconds();
    for (int idle = 0;; ++idle) {
      if (pred()) return true;
      if (abort.load(std::memory_order_relaxed)) return false;
      if (pf && pf->step(64)) continue;
      if (idle < 2000)
        sched_yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(idle < 4000 ? 50 : 1000));
      const uint64_t p = progress_sum();
      const double t = now_seconds();
      if (p != last) {
        last = p;
        last_t = t;
        idle = 0;
      } else if (t - last_t > opt.watchdog_seconds) {
        report_stuck(rt, t - last_t);
        return false;
      }
    }
  }

  void report_stuck(PlanRuntime& rt, double idle_s) {
    const plan::Plan& p = rt.plan;
    std::string m = fmt::format(
        "decode step stuck: no instruction completed for {:.1f} s ({}, batch {}, {} workers)",
        idle_s, executor_name(kind), p.batch, W);
    for (int w = 0; w < W; ++w) {
      const WorkerStatus& s = status[w];
      const uint32_t st = s.state.load(std::memory_order_relaxed);
      const uint32_t id = s.instr.load(std::memory_order_relaxed);
      const std::string where =
          id < p.instrs.size() ? plan::describe_instr(p, p.instrs[id]) : std::string("-");
      m += fmt::format("; worker {} ", w);
      switch (st) {
        case kWaiting: {
          const uint32_t c = s.counter.load(std::memory_order_relaxed);
          const uint32_t tgt = s.target.load(std::memory_order_relaxed);
          const uint32_t from = s.from.load(std::memory_order_relaxed);
          if (c >= p.counters.size()) {
            m += fmt::format("waits in instruction {}", where);
            break;
          }
          const plan::CounterDesc& cd = p.counters[c];
          m += fmt::format(
              "waits in instruction {} for counter c{} ({} {} group {}, {} signals per "
              "step)",
              where, c, plan::op_name(cd.op),
              cd.layer == plan::kNoLayer ? std::string("--") : fmt::format("L{}", cd.layer),
              cd.group, cd.per_step);
          if (from == kNone)
            m += fmt::format(" to reach {} at epoch {}: unreachable", tgt, rt.epoch);
          else
            m += fmt::format(": worker {} has published {} of {}", from,
                             rt.slot(int(from), c).load(std::memory_order_relaxed), tgt);
          break;
        }
        case kAtBarrier:
          m += fmt::format("waits at the barrier after phase {}",
                           s.phase.load(std::memory_order_relaxed));
          break;
        case kStalled:
          m += fmt::format("is stalled in instruction {} (test hook)", where);
          break;
        case kRunning:
          m += fmt::format("is running instruction {}", where);
          break;
        case kFinished:
          m += "has finished its queue";
          break;
        default:
          m += "has not started";
          break;
      }
    }
    std::lock_guard<std::mutex> lk(err_mu);
    if (err.empty()) err = m;
    abort.store(true, std::memory_order_relaxed);
  }

  void fail_worker(const std::string& what) {
    std::lock_guard<std::mutex> lk(err_mu);
    if (err.empty()) err = what;
    abort.store(true, std::memory_order_relaxed);
  }

  // A tile flagged by the test hook: waits for something that never happens.
  void stall(PlanRuntime& rt, WorkerStatus& st) {
    st.state.store(kStalled, std::memory_order_relaxed);
    wait_until(rt, [] { return false; });
  }

  // ---- the two executors --------------------------------------------------------------------

  void run_tile(const exec::StepCtx& ctx, const Instr& in, exec::Scratch& sc, WorkerStatus& st) {
    if (!opt.profile) return exec::run_instr(ctx, in, sc);
    const double t0 = now_seconds();
    exec::run_instr(ctx, in, sc);
    st.run_by_op[size_t(in.op)] += now_seconds() - t0;
  }

  // Lists the streams a worker reads from here on (cpu::set_upcoming_streams): the tile's own
  // (cur, which knows them once the tile's expert ids are visible), then the next tile's first
  // (next, if any), so that each GEMV call's last prefetches go to the stream after it.
  static void list_upcoming(const exec::StepCtx& ctx, const Instr& in, exec::Prefetcher& cur,
                            const exec::Prefetcher* next) {
    cpu::ByteSpan up[cpu::kMaxUpcomingStreams];
    int n = cur.spans(up, 3);
    if (n == 0 && (in.op == plan::Op::kExpertGateUp || in.op == plan::Op::kExpertDown)) {
      cur.start(ctx, in, true);  // after the tile's waits its expert ids are visible
      n = cur.spans(up, 3);
    }
    if (next) n += next->spans(up + n, 1);
    cpu::set_upcoming_streams(up, n);
  }

  void run_megakernel(const exec::StepCtx& ctx, PlanRuntime& rt, int w) {
    const std::vector<Instr>& q = rt.plan.queues[size_t(w)];
    exec::Scratch& sc = scratch[size_t(w)];
    WorkerStatus& st = status[w];
    exec::Prefetcher pf, next;  // this tile's streams, the next tile's
    uint64_t done = st.progress.load(std::memory_order_relaxed);
    if (!q.empty()) pf.start(ctx, q[0]);
    const std::vector<uint8_t>& mask = rt.wait_mask[size_t(w)];
    for (size_t i = 0; i < q.size(); ++i) {
      const Instr& in = q[i];
      st.instr.store(in.id, std::memory_order_relaxed);
      for (int k = 0; k < 2; ++k) {
        if (!(mask[i] & (1u << k))) continue;
        const Wait& wt = in.wait[k];
        const uint32_t c = wt.counter;
        if (wt.target > rt.plan.counters[c].per_step) {  // can never be met: let the watchdog tell
          st.counter.store(c, std::memory_order_relaxed);
          st.target.store(wt.target + rt.epoch * rt.plan.counters[c].per_step,
                          std::memory_order_relaxed);
          st.from.store(kNone, std::memory_order_relaxed);
          st.state.store(kWaiting, std::memory_order_relaxed);
          wait_until(
              rt, [] { return false; }, &pf);
          return;
        }
        for (auto [u, n] : rt.producers[c]) {
          if (u == w) continue;
          const std::atomic<uint32_t>& sl = rt.slot(u, c);
          const uint32_t target = (rt.epoch + 1) * n;
          if (reached(sl.load(std::memory_order_acquire), target)) continue;
          st.counter.store(c, std::memory_order_relaxed);
          st.target.store(target, std::memory_order_relaxed);
          st.from.store(uint32_t(u), std::memory_order_relaxed);
          st.state.store(kWaiting, std::memory_order_relaxed);
          const double t0 = now_seconds();
          const bool ok = wait_until(
              rt, [&] { return reached(sl.load(std::memory_order_acquire), target); }, &pf);
          const double dt = now_seconds() - t0;
          st.wait_s += dt;
          st.wait_by_op[size_t(in.op)] += dt;
          st.state.store(kRunning, std::memory_order_relaxed);
          if (!ok) return;
        }
      }
      if (in.flags & plan::kFlagTestStall) return stall(rt, st);
      if (i + 1 < q.size()) {
        // The router's expert ids are visible here once this worker has run (or passed the waits
        // of) an expert tile of the layer: its waits acquired them, directly or through the
        // gate/up counter.
        const bool ids = (in.op == plan::Op::kExpertGateUp || in.op == plan::Op::kExpertDown) &&
                         in.layer == q[i + 1].layer;
        next.start(ctx, q[i + 1], ids);
      }
      list_upcoming(ctx, in, pf, i + 1 < q.size() ? &next : nullptr);
      run_tile(ctx, in, sc, st);
      if (in.signal != kNone && rt.publish[size_t(w) * rt.C + in.signal]) {
        std::atomic<uint32_t>& sl = rt.slot(w, in.signal);
        sl.store(sl.load(std::memory_order_relaxed) + 1, std::memory_order_release);
      }
      st.progress.store(++done, std::memory_order_relaxed);
      if (i + 1 < q.size()) {
        std::swap(pf, next);
        pf.step(32);
      }
    }
    cpu::set_upcoming_streams(nullptr, 0);
    st.state.store(kFinished, std::memory_order_relaxed);
  }

  bool barrier(PlanRuntime& rt, WorkerStatus& st, uint32_t phase, exec::Prefetcher& pf) {
    st.phase.store(phase, std::memory_order_relaxed);
    st.state.store(kAtBarrier, std::memory_order_relaxed);
    const uint32_t g = bar_gen.load(std::memory_order_acquire);
    if (bar_count.fetch_add(1, std::memory_order_acq_rel) == uint32_t(W - 1)) {
      bar_count.store(0, std::memory_order_relaxed);
      bar_gen.store(g + 1, std::memory_order_release);
    } else {
      const double t0 = now_seconds();
      const bool ok = wait_until(
          rt, [&] { return bar_gen.load(std::memory_order_acquire) != g; }, &pf);
      const double dt = now_seconds() - t0;
      st.wait_s += dt;
      st.wait_by_op[size_t(rt.plan.stages[rt.plan.phases[phase].second - 1].op)] += dt;
      if (!ok) return false;
    }
    st.state.store(kRunning, std::memory_order_relaxed);
    return true;
  }

  void run_opbyop(const exec::StepCtx& ctx, PlanRuntime& rt, int w) {
    const plan::Plan& p = rt.plan;
    exec::Scratch& sc = scratch[size_t(w)];
    WorkerStatus& st = status[w];
    uint64_t done = st.progress.load(std::memory_order_relaxed);
    const size_t nph = p.phase_instrs.size();
    exec::Prefetcher pf, next;  // this tile's streams, the next tile's
    // My next tile after position j of phase ph (in this phase or a later one), if any.
    auto next_tile = [&](size_t ph, size_t j) -> const Instr* {
      if (j + 1 < p.phase_instrs[ph][size_t(w)].size())
        return &p.instrs[p.phase_instrs[ph][size_t(w)][j + 1]];
      for (size_t nx = ph + 1; nx < nph; ++nx)
        if (!p.phase_instrs[nx][size_t(w)].empty())
          return &p.instrs[p.phase_instrs[nx][size_t(w)][0]];
      return nullptr;
    };
    if (const Instr* first = next_tile(0, size_t(-1))) pf.start(ctx, *first);
    for (size_t ph = 0; ph < nph; ++ph) {
      const std::vector<uint32_t>& mine = p.phase_instrs[ph][size_t(w)];
      for (size_t j = 0; j < mine.size(); ++j) {
        const Instr& in = p.instrs[mine[j]];
        st.instr.store(in.id, std::memory_order_relaxed);
        if (in.flags & plan::kFlagTestStall) return stall(rt, st);
        const Instr* nx = next_tile(ph, j);
        // Within a phase the router ran in an earlier phase: its ids are visible (barrier).
        if (nx) next.start(ctx, *nx, j + 1 < mine.size());
        list_upcoming(ctx, in, pf, nx ? &next : nullptr);
        run_tile(ctx, in, sc, st);
        st.progress.store(++done, std::memory_order_relaxed);
        if (nx) {
          std::swap(pf, next);
          pf.step(32);
        }
      }
      if (ph + 1 < nph && W > 1 && !barrier(rt, st, uint32_t(ph), pf)) return;
    }
    cpu::set_upcoming_streams(nullptr, 0);
    st.state.store(kFinished, std::memory_order_relaxed);
  }

  // Runs the plan's instructions on the workers (megakernel or op by op). False when a worker
  // failed or the watchdog fired (err says why); the counters are then reset for the next step.
  bool run_workers(const exec::StepCtx& ctx, PlanRuntime& rt) {
    abort.store(false, std::memory_order_relaxed);
    err.clear();
    for (int w = 0; w < W; ++w) {
      status[w].state.store(kIdle, std::memory_order_relaxed);
      status[w].instr.store(kNone, std::memory_order_relaxed);
      status[w].wait_s = 0;
      status[w].wait_by_op.fill(0.0);
      status[w].run_by_op.fill(0.0);
    }
    try {
      pool->run([&](int w, int) {
        try {
          if (kind == ExecutorKind::kMegakernel)
            run_megakernel(ctx, rt, w);
          else
            run_opbyop(ctx, rt, w);
        } catch (const std::exception& e) {
          fail_worker(fmt::format("decode step: worker {} failed: {}", w, e.what()));
        }
      });
    } catch (...) {
      abort.store(true, std::memory_order_relaxed);
    }
    if (abort.load(std::memory_order_relaxed)) {
      // Every worker has returned; start the next step from clean counters and barrier.
      rt.reset_counters();
      bar_count.store(0, std::memory_order_relaxed);
      return false;
    }
    ++rt.epoch;
    return true;
  }

  // ---- a step -------------------------------------------------------------------------------

  void step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids,
            std::span<const SampleRow> sampling, const StepOptions& so) {
    // Rows are compact in sequence order: sequence b's are [row0[b], row0[b + 1]). The plan is
    // the one for the batch and the longest sequence's rows; the others use fewer of its rows.
    exec::StepLayout lay =
        exec::layout_step(model, *states, max_batch, seqs, logits, sampling, so, next_ids != nullptr);
    const bool caller_logits = logits != nullptr;
    if (!logits && lay.n_logits > 0) {  // only the drawn tokens are wanted: logits to scratch
      scratch_logits.resize(size_t(lay.n_logits) * size_t(model.config().vocab_size));
      logits = scratch_logits.data();
    }
    const ModelConfig& c = model.config();
    const int B = lay.B, L = c.num_layers, R = lay.R, N = lay.N, n_logits = lay.n_logits;
    std::vector<int32_t>& row0 = lay.row0;
    std::vector<int32_t>& logit_of_row = lay.logit_of_row;
    std::vector<int32_t>& seq_of_row = lay.seq_of_row;
    PlanRuntime& rt = runtime(B, R);

    // Host-side preparation: give each latent cache the pages of the rows this step writes
    // (check_inputs made sure they are free), set up the row logs, then resolve every state
    // pointer into the pool.
    std::vector<exec::SeqView> views(size_t(B) * size_t(L));
    std::vector<int64_t>& pos = lay.pos;
    std::vector<int32_t>& tokens = lay.tokens;
    for (int b = 0; b < B; ++b) {
      SequenceState& s = *seqs[size_t(b)].seq;
      const int Rb = int(seqs[size_t(b)].tokens.size());
      s.reserve(s.pos + Rb);
      s.rowlog = {};
      if (so.keep_for_commit) s.rowlog = {s.pos, Rb};
      for (int l = 0; l < L; ++l) {
        exec::SeqView& v = views[size_t(b) * size_t(L) + size_t(l)];
        if (c.attn_kind[size_t(l)] == AttnKind::KDA) {
          v.kda_state = s.kda_state(l);
          v.conv_cache = s.conv_cache(l);
          if (so.keep_for_commit) {
            v.kda_state0 = s.kda_state0(l);
            v.conv0 = s.conv0(l);
            v.rowlog = s.row_inputs(l);
          }
        } else {
          v.mla = s.latent(l);
        }
      }
    }
    exec::StepCtx ctx;
    ctx.plan = &rt.plan;
    ctx.cfg = &c;
    ctx.num = model.numerics();
    ctx.arena = arena.get();
    ctx.weights = rt.weights.data();
    ctx.batch = B;
    ctx.rows = R;
    ctx.n = N;
    ctx.row0 = row0.data();
    ctx.seq_of_row = seq_of_row.data();
    ctx.tokens = tokens.data();
    ctx.logits = logits;
    ctx.n_logits = n_logits;
    ctx.logit_of_row = logit_of_row.data();
    ctx.seqs = views.data();
    ctx.pos = pos.data();
    ctx.sampling = sampling.empty() ? nullptr : sampling.data();
    ctx.comm = model.communicator();
    // Only the drawn ids wanted, all greedy without penalties: ranks trade (max, id) pairs, not
    // logits (the same decision on every rank, whose inputs are the same).
    ctx.greedy_exchange =
        ctx.comm && ctx.comm->size() > 1 && next_ids && !caller_logits && n_logits > 0 &&
        std::all_of(sampling.begin(), sampling.end(), [](const SampleRow& r) {
          return r.greedy() && !(r.has_penalties() && r.num_penalties > 0);
        });

    const double t_start = now_seconds();
    if (!run_workers(ctx, rt)) {
      for (const StepSeq& q : seqs) q.seq->rowlog.rows = 0;
      throw Error(err.empty() ? std::string("decode step failed") : err);
    }
    const double t_run = now_seconds() - t_start;
    // The aux capture reads the residual-stream buffers the step has just written (each once, so
    // every row is still there): a copy of the rows asked for, no instruction, nothing when no
    // layer is listed.
    if (!so.aux.layers.empty())
      exec::copy_aux_rows(rt.plan, so.aux, N, [&](uint32_t bi) -> const uint8_t* {
        return arena.get() + rt.plan.buffers[bi].offset;
      });
    if (next_ids) {
      const plan::BufferDesc& d = rt.plan.buffers[rt.plan.next_ids_buffer];
      for (int j = 0; j < n_logits; ++j)
        std::memcpy(&next_ids[j], arena.get() + d.offset + d.stride * uint64_t(j), 4);
    }
    std::vector<int> rows(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) {
      rows[size_t(b)] = int(seqs[size_t(b)].tokens.size());
      seqs[size_t(b)].seq->pos += rows[size_t(b)];
    }
    compute_stats(rt, pos, rows, N);
    stats.seconds = t_run;
    for (int w = 0; w < W; ++w) {
      stats.wait_seconds += status[w].wait_s;
      for (int op = 0; op < plan::kNumOps; ++op) {
        stats.wait_by_op[size_t(op)] += status[w].wait_by_op[size_t(op)];
        stats.run_by_op[size_t(op)] += status[w].run_by_op[size_t(op)];
      }
    }
  }

  // ---- a draft step ------------------------------------------------------------------------

  void draft_step(std::span<const DraftStepSeq> seqs) {
    MD_CHECK(draft_w, "draft step: no draft is attached to this executor (attach_draft)");
    const DraftConfig& d = draft_cfg;
    const exec::DraftLayout lay = exec::layout_draft_step(d, max_batch, seqs);
    const int B = lay.B, C = lay.C, G = lay.G, L = d.num_layers;
    if (C == 0 && G == 0) return;
    PlanRuntime& rt = draft_runtime(B, C, G);
    const plan::Plan& p = rt.plan;
    if (C > 0)
      exec::fill_draft_context(p, lay, seqs, model.numerics().round_bf16,
                               arena.get() + p.buffers[p.draft.aux].offset,
                               arena.get() + p.buffers[p.draft.ctx_pos].offset);
    const int64_t KV = d.kv_width();
    std::vector<exec::SeqView> views(size_t(B) * size_t(L));
    for (int b = 0; b < B; ++b) {
      const DraftStepSeq& q = seqs[size_t(b)];
      for (int l = 0; l < L; ++l) {
        exec::SeqView& v = views[size_t(b) * size_t(L) + size_t(l)];
        const size_t off = size_t(l) * size_t(d.window) * size_t(KV);
        v.ring_k = q.ring.keys + off;
        v.ring_v = q.ring.values + off;
        v.ring_pos = q.ring.positions;
      }
    }
    exec::StepCtx ctx;
    ctx.plan = &p;
    ctx.cfg = &p.cfg;
    ctx.num = exec::draft_numerics(model.numerics(), d);
    ctx.arena = arena.get();
    ctx.weights = rt.weights.data();
    ctx.batch = B;
    ctx.rows = G;
    ctx.n = lay.N;
    ctx.row0 = lay.row0.data();
    ctx.seq_of_row = lay.seq_of_row.data();
    ctx.tokens = lay.tokens.data();
    ctx.n_logits = lay.N;
    ctx.logit_of_row = lay.logit_of_row.data();
    ctx.seqs = views.data();
    ctx.pos = lay.pos.data();
    ctx.n_ctx = B * C;
    if (!run_workers(ctx, rt))
      throw Error(err.empty() ? std::string("draft step failed") : err);
    exec::copy_draft_outputs(p, lay, seqs, [&](uint32_t bi) -> const uint8_t* {
      return arena.get() + p.buffers[bi].offset;
    });
  }

  void compute_stats(const PlanRuntime& rt, const std::vector<int64_t>& pos,
                     const std::vector<int>& rows, int n) {
    const ModelConfig& c = model.config();
    std::vector<exec::RouterIds> ids(size_t(c.num_layers));
    for (int l = 0; l < c.num_layers; ++l) {
      const uint32_t bi = rt.plan.router_ids_buffer[size_t(l)];
      if (bi == kNone) continue;
      const plan::BufferDesc& d = rt.plan.buffers[bi];
      ids[size_t(l)] = {reinterpret_cast<const int32_t*>(arena.get() + d.offset), d.stride / 4};
    }
    const auto held = model.shard().sharded() ? model.shard().experts(model.full_config())
                                              : std::pair<int, int>{0, -1};
    stats = decode_step_bytes(model, pos, exec::distinct_experts_of_step(c, n, ids, held),
                              std::span<const int>(rows));
  }
};

CpuExecutor::CpuExecutor(Model& model, int max_batch, int workers, ExecutorKind kind)
    : CpuExecutor(model, max_batch, kind, [&] {
        ExecutorOptions o;
        o.workers = workers;
        return o;
      }()) {}

CpuExecutor::CpuExecutor(Model& model, int max_batch, ExecutorKind kind, const ExecutorOptions& opt)
    : impl_(std::make_unique<Impl>(model, max_batch, kind, opt)) {}

CpuExecutor::~CpuExecutor() = default;

void CpuExecutor::run_step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids,
                           std::span<const SampleRow> sampling, const StepOptions& options) {
  impl_->step(seqs, logits, next_ids, sampling, options);
}

const plan::Plan& CpuExecutor::plan(int batch, int rows) {
  MD_CHECK(batch >= 1 && batch <= impl_->max_batch, "batch {} is outside 1..{}", batch,
           impl_->max_batch);
  MD_CHECK(rows >= 1 && rows <= plan::kMaxRows, "rows {} is outside 1..{}", rows, plan::kMaxRows);
  return impl_->runtime(batch, rows).plan;
}

void CpuExecutor::commit(SequenceState& seq, int k) {
  MD_CHECK(seq.pool() == impl_->states.get(),
           "commit: the sequence is not a state of this executor's pool");
  exec::commit_rows(impl_->model.config(), seq, k, *impl_->pool);
}

std::string_view CpuExecutor::name() const {
  return executor_name(impl_->kind);
}
StatePool& CpuExecutor::states() {
  return *impl_->states;
}
const Model& CpuExecutor::model() const {
  return impl_->model;
}
int CpuExecutor::workers() const {
  return impl_->W;
}
int CpuExecutor::max_batch() const {
  return impl_->max_batch;
}
ExecutorKind CpuExecutor::kind() const {
  return impl_->kind;
}
const StepStats& CpuExecutor::last_step_stats() const {
  return impl_->stats;
}
void CpuExecutor::set_watchdog_seconds(double s) {
  MD_CHECK(s > 0, "executor: the watchdog timeout must be positive");
  impl_->opt.watchdog_seconds = s;
}

void CpuExecutor::edit_instr_for_testing(int batch, uint32_t id,
                                         const std::function<void(plan::Instr&)>& f) {
  PlanRuntime& rt = impl_->runtime(batch, 1);
  MD_CHECK(id < rt.plan.instrs.size(), "no instruction {}", id);
  f(rt.plan.instrs[id]);
  for (auto& q : rt.plan.queues)
    for (Instr& in : q)
      if (in.id == id) in = rt.plan.instrs[id];
  rt.analyze();
  rt.reset_counters();
}

void CpuExecutor::attach_draft(const DraftConfig& c, const DraftWeights& w) {
  exec::check_draft_fits(impl_->model.config(), c, w);
  // Every drafter on this executor attaches its model (serve: one per slot): the same one again
  // keeps the compiled plans.
  if (impl_->draft_w == &w) return;
  impl_->draft_plans.clear();
  impl_->draft_cfg = c;
  impl_->draft_w = &w;
}

void CpuExecutor::draft_step(std::span<const DraftStepSeq> seqs) {
  impl_->draft_step(seqs);
}

const plan::Plan& CpuExecutor::draft_plan(int batch, int ctx_rows, int block_rows) {
  return impl_->draft_runtime(batch, ctx_rows, block_rows).plan;
}

void CpuExecutor::drop_plans() {
  impl_->plans.clear();
  impl_->draft_plans.clear();
}

}  // namespace md
