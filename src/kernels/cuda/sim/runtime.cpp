// The CUDA simulation's scheduler: blocks, threads as fibers, barriers, warp collectives,
// mbarriers and bulk copies, the deadlock detector (include/megadecode/kernels/cuda/sim.h).
#include "runtime.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "fiber.h"
#include "megadecode/base/error.h"

#if defined(__SANITIZE_THREAD__)
#define MD_SIM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MD_SIM_TSAN 1
#endif
#endif
// The same for AddressSanitizer (GCC defines the macro; clang only answers __has_feature, which GCC
// 12's preprocessor cannot parse outside an #if defined(__has_feature) block).
#if defined(__SANITIZE_ADDRESS__)
#define MD_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MD_SIM_ASAN 1
#endif
#endif
#if MD_SIM_TSAN
#include <sanitizer/tsan_interface.h>
#define MD_SIM_RELEASE(p) __tsan_release(p)
#define MD_SIM_ACQUIRE(p) __tsan_acquire(p)
// TSan's dynamic annotations (libtsan): the scheduler's own bookkeeping is shared by every fiber
// on one OS thread without synchronisation, so its accesses are hidden from TSan (IgnoreScope);
// what the device code reads and writes stays visible, ordered only by the barriers,
// collectives, mbarriers and atomics.
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
namespace {
struct IgnoreScope {
  IgnoreScope() {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~IgnoreScope() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
  IgnoreScope(const IgnoreScope&) = delete;
  IgnoreScope& operator=(const IgnoreScope&) = delete;
};
}  // namespace
#define MD_SIM_BOOKKEEPING IgnoreScope md_sim_ignore_scope
#define MD_SIM_STACK (size_t{512} << 10)
#elif MD_SIM_ASAN
#define MD_SIM_RELEASE(p) (void)(p)
#define MD_SIM_ACQUIRE(p) (void)(p)
#define MD_SIM_BOOKKEEPING (void)0
#define MD_SIM_STACK (size_t{512} << 10)
#else
#define MD_SIM_RELEASE(p) (void)(p)
#define MD_SIM_ACQUIRE(p) (void)(p)
#define MD_SIM_BOOKKEEPING (void)0
#define MD_SIM_STACK (size_t{128} << 10)
#endif

namespace md::cuda::sim {

Config& config() {
  static Config c;
  return c;
}

void note(Event e) {
  __atomic_fetch_add(&stats().events[size_t(e)], 1, __ATOMIC_RELAXED);
}

LaunchStats& stats() {
  static LaunchStats s;
  return s;
}

namespace {

constexpr uint32_t kMbarMagic = 0x6d626172;

struct Block;
struct Launch;

enum class State : uint8_t { kRunnable, kBarrier, kWarp, kDone };

struct Thread {
  Fiber* fiber = nullptr;  // borrowed from the pool
  ThreadCoords c;
  Block* block = nullptr;
  Launch* launch = nullptr;
  State state = State::kRunnable;
  bool started = false;
  size_t run_index = 0;    // position in Launch::runnable while runnable
  uint64_t spin_gen = ~0ull;
  int spins = 0;
  const char* waiting = nullptr;  // what the last pause waited for
  const Mbar* mbar = nullptr;     // the mbarrier it waits on, if any
};

struct Warp {
  uint32_t arrived = 0;
  WarpOp op = WarpOp::kSumF32;
  uint32_t arg = 0;
  uint64_t vals[32] = {};
  uint64_t res[32] = {};
  Thread* waiters[32] = {};
};

struct Block {
  uint32_t bid = 0;
  std::vector<Thread*> threads;
  std::unique_ptr<uint8_t[]> smem_store;
  uint8_t* smem = nullptr;
  uint32_t bar_arrived = 0;
  std::vector<Thread*> bar_waiters;
  std::vector<Warp> warps;
  uint32_t live = 0;
  int sync_token = 0;  // the TSan release/acquire address of the barrier
};

// The fibers are kept between launches (a decode step launches dozens of grids), and for the
// process's life: never destroyed at exit, when no launch runs and their stacks are plain mappings
// (TSan would otherwise see the exit's deletes race with the fibers' last bookkeeping reads).
std::vector<std::unique_ptr<Fiber>>& fiber_pool() {
  static auto* p = new std::vector<std::unique_ptr<Fiber>>();
  return *p;
}

struct Launch {
  const std::function<void()>* body = nullptr;
  std::vector<Thread*> runnable;
  uint64_t gen = 0;      // progress generation: bumped by every switch that is not a pause
  size_t stuck = 0;      // runnable threads that paused twice in this generation
  size_t live = 0;       // threads started and not finished
  uint64_t rng = 0;
  size_t rr = 0;
  std::string error;
  bool aborting = false;  // the launch failed: suspended threads unwind (AbortLaunch) and finish
  uint64_t pauses = 0;
  std::vector<std::unique_ptr<Block>> blocks;

  void make_runnable(Thread* t) {
    t->state = State::kRunnable;
    t->run_index = runnable.size();
    runnable.push_back(t);
  }
  void remove_runnable(Thread* t) {
    const size_t i = t->run_index;
    runnable[i] = runnable.back();
    runnable[i]->run_index = i;
    runnable.pop_back();
  }
  void progress() {
    ++gen;
    stuck = 0;
  }
  Thread* pick() {
    if (config().seed == 0) {
      if (rr >= runnable.size()) rr = 0;
      return runnable[rr++];
    }
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return runnable[size_t(rng % runnable.size())];
  }
};

thread_local Thread* g_cur = nullptr;
thread_local Launch* g_launch = nullptr;

Thread& cur() {
  MD_CHECK(g_cur != nullptr, "cuda-sim: a device function was called outside a kernel launch");
  return *g_cur;
}

// Thrown into a suspended thread when its launch has failed: it unwinds the device code and
// finishes normally, publishing what it wrote (the host reads the status board after a failure).
struct AbortLaunch {};

// Back to the scheduler; the caller has set the thread's state.
void switch_out(Thread& t) {
  ++stats().switches;
  t.fiber->yield();
  g_cur = &t;
  if (t.launch->aborting) throw AbortLaunch{};
}

void finish_thread(Thread& t);

void thread_main(void* arg) {
  Thread& t = *static_cast<Thread*>(arg);
  {
    MD_SIM_BOOKKEEPING;
    t.fiber->entered();
    t.started = true;
    g_cur = &t;
    MD_SIM_ACQUIRE(t.launch);  // what the host wrote before the launch
  }
  try {
    (*t.launch->body)();
  } catch (const AbortLaunch&) {
    // unwound after the launch failed
  } catch (const std::exception& e) {
    MD_SIM_BOOKKEEPING;
    if (t.launch->error.empty())
      t.launch->error = fmt::format("block {} thread {}: {}", t.c.bid, t.c.tid, e.what());
  } catch (...) {
    MD_SIM_BOOKKEEPING;
    if (t.launch->error.empty())
      t.launch->error = fmt::format("block {} thread {}: unknown exception", t.c.bid, t.c.tid);
  }
  finish_thread(t);
}

void finish_thread(Thread& t) {
  {
    MD_SIM_BOOKKEEPING;
    MD_SIM_RELEASE(t.launch);  // what the thread wrote, for the host after the launch
    if (t.state == State::kRunnable) t.launch->remove_runnable(&t);
    t.state = State::kDone;
    t.launch->progress();
    --t.block->live;
    --t.launch->live;
  }
  t.fiber->exit();
}

std::string describe_waits(const Launch& L) {
  std::string m;
  int shown = 0;
  for (const auto& b : L.blocks) {
    if (!b) continue;
    for (const Thread* t : b->threads) {
      if (t->state == State::kDone) continue;
      if (shown++ == 8) {
        m += "; ...";
        return m;
      }
      m += fmt::format("; block {} thread {} ", t->c.bid, t->c.tid);
      switch (t->state) {
        case State::kBarrier:
          m += fmt::format("waits at the block barrier ({} of {} threads arrived)", b->bar_arrived,
                           b->live);
          break;
        case State::kWarp:
          m += fmt::format("waits in a warp collective ({} of 32 lanes arrived)",
                           b->warps[t->c.tid / 32].arrived);
          break;
        default:
          m += fmt::format("spins on {}", t->waiting ? t->waiting : "a condition");
          if (t->mbar)
            m += fmt::format(" (mbarrier: {} arrivals and {} transaction bytes outstanding)",
                             t->mbar->pending, t->mbar->tx_pending);
          break;
      }
    }
  }
  return m;
}

}  // namespace

const ThreadCoords& coords() {
  MD_SIM_BOOKKEEPING;
  return cur().c;
}

void sync_block() {
  MD_SIM_BOOKKEEPING;
  Thread& t = cur();
  Block& b = *t.block;
  Launch& L = *t.launch;
  MD_SIM_RELEASE(&b.sync_token);
  L.progress();
  if (++b.bar_arrived == b.live) {
    b.bar_arrived = 0;
    for (Thread* w : b.bar_waiters) L.make_runnable(w);
    b.bar_waiters.clear();
    // Let the others run first at times: the releasing thread is not special.
    if (config().seed != 0) switch_out(t);
  } else {
    t.state = State::kBarrier;
    L.remove_runnable(&t);
    b.bar_waiters.push_back(&t);
    switch_out(t);
  }
  MD_SIM_ACQUIRE(&b.sync_token);
}

uint64_t warp_collective(uint64_t value, WarpOp op, uint32_t arg) {
  MD_SIM_BOOKKEEPING;
  Thread& t = cur();
  Block& b = *t.block;
  Launch& L = *t.launch;
  Warp& w = b.warps[t.c.tid / 32];
  const uint32_t lane = t.c.tid % 32;
  if (w.arrived == 0) {
    w.op = op;
    w.arg = arg;
  } else if (w.op != op) {
    trap("warp collective: the lanes of a warp called different collectives");
  }
  w.vals[lane] = value;
  w.waiters[lane] = &t;
  MD_SIM_RELEASE(&w);
  L.progress();
  if (++w.arrived == 32) {
    auto f = [](uint64_t v) {
      float x;
      uint32_t u = uint32_t(v);
      std::memcpy(&x, &u, 4);
      return x;
    };
    auto bits = [](float x) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      return uint64_t(u);
    };
    uint64_t v[32];
    std::copy(w.vals, w.vals + 32, v);
    switch (op) {
      case WarpOp::kSumF32:
      case WarpOp::kMaxF32:
      case WarpOp::kMinU32:
      case WarpOp::kMaxU64:
        // The xor butterfly: at offset m every lane combines its value with lane ^ m's.
        for (uint32_t m = 16; m >= 1; m /= 2) {
          uint64_t nv[32];
          for (uint32_t i = 0; i < 32; ++i) {
            const uint64_t a = v[i], o = v[i ^ m];
            if (op == WarpOp::kSumF32)
              nv[i] = bits(f(a) + f(o));
            else if (op == WarpOp::kMaxF32)
              nv[i] = bits(std::max(f(a), f(o)));  // fmaxf on equal-or-NaN-free inputs
            else if (op == WarpOp::kMinU32)
              nv[i] = std::min(uint32_t(a), uint32_t(o));
            else
              nv[i] = std::max(a, o);
          }
          std::copy(nv, nv + 32, v);
        }
        std::copy(v, v + 32, w.res);
        break;
      case WarpOp::kShflIdx:
        for (uint32_t i = 0; i < 32; ++i) w.res[i] = v[arg % 32];
        break;
      case WarpOp::kShflXor:
        for (uint32_t i = 0; i < 32; ++i) w.res[i] = v[(i ^ arg) % 32];
        break;
      case WarpOp::kBallot: {
        uint64_t m = 0;
        for (uint32_t i = 0; i < 32; ++i) m |= uint64_t(v[i] != 0) << i;
        for (uint32_t i = 0; i < 32; ++i) w.res[i] = m;
        break;
      }
    }
    w.arrived = 0;
    MD_SIM_RELEASE(&w);  // the results, for the lanes woken below
    for (uint32_t i = 0; i < 32; ++i)
      if (w.waiters[i] != &t) L.make_runnable(w.waiters[i]);
    const uint64_t r = w.res[lane];
    if (config().seed != 0) switch_out(t);
    MD_SIM_ACQUIRE(&w);
    return r;
  }
  t.state = State::kWarp;
  L.remove_runnable(&t);
  switch_out(t);
  MD_SIM_ACQUIRE(&w);
  return w.res[lane];
}

void pause(const char* what) {
  MD_SIM_BOOKKEEPING;
  Thread& t = cur();
  Launch& L = *t.launch;
  ++L.pauses;
  t.waiting = what;
  if (t.spin_gen != L.gen) {
    t.spin_gen = L.gen;
    t.spins = 0;
  }
  if (++t.spins == 2) ++L.stuck;
  switch_out(t);
  t.waiting = nullptr;
  t.mbar = nullptr;
}

uint64_t now_ns() {
  MD_SIM_BOOKKEEPING;
  Launch* L = g_cur ? g_cur->launch : g_launch;
  return L ? L->pauses * config().spin_ns : 0;
}

void trap(const char* what) {
  throw Error(fmt::format("device trap: {}", what));
}

void bulk_copy_checks(void* dst, const void* src, uint32_t bytes, Mbar* m);

void mbar_init(Mbar* m, uint32_t count) {
  MD_SIM_BOOKKEEPING;
  MD_CHECK(count >= 1, "cuda-sim: an mbarrier needs at least one arrival per phase");
  m->count = m->pending = count;
  m->tx_pending = 0;
  m->phase = 0;
  m->magic = kMbarMagic;
}

namespace {
void mbar_check_phase(Mbar* m) {
  if (m->pending == 0 && m->tx_pending == 0) {
    ++m->phase;
    m->pending = m->count;
    if (g_cur) g_cur->launch->progress();
  }
}
}  // namespace

void mbar_arrive_expect_tx(Mbar* m, uint32_t bytes) {
  MD_SIM_BOOKKEEPING;
  if (m->magic != kMbarMagic) trap("mbarrier arrive on an uninitialised mbarrier");
  if (m->pending == 0) trap("mbarrier: more arrivals than its count in one phase");
  m->tx_pending += bytes;
  --m->pending;
  MD_SIM_RELEASE(m);
  mbar_check_phase(m);
}

void mbar_arrive(Mbar* m) {
  mbar_arrive_expect_tx(m, 0);
}

void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, Mbar* m) {
  {
    MD_SIM_BOOKKEEPING;
    bulk_copy_checks(dst, src, bytes, m);
  }
  // The copy itself is the device's data movement: visible to TSan (a copy into a stage another
  // thread still reads, without the barrier in between, is a race it reports).
  std::memcpy(dst, src, bytes);
  MD_SIM_BOOKKEEPING;
  m->tx_pending -= bytes;
  MD_SIM_RELEASE(m);
  mbar_check_phase(m);
}

void bulk_copy_checks(void* dst, const void* src, uint32_t bytes, Mbar* m) {
  const ThreadCoords& c = coords();
  if (m->magic != kMbarMagic) trap("bulk copy completing on an uninitialised mbarrier");
  if (bytes == 0 || bytes % 16 != 0)
    throw Error(fmt::format("device trap: bulk copy of {} bytes (must be a positive multiple of 16)",
                            bytes));
  if (reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16)
    trap("bulk copy: source or destination not 16-byte aligned");
  auto* d = static_cast<uint8_t*>(dst);
  if (d < c.smem || d + bytes > c.smem + c.smem_bytes)
    trap("bulk copy: destination outside the block's shared memory");
  if (int64_t(bytes) > m->tx_pending)
    throw Error(fmt::format(
        "device trap: bulk copy of {} bytes onto an mbarrier expecting {} more transaction bytes",
        bytes, m->tx_pending));
}

bool mbar_test(const Mbar* m, uint32_t parity) {
  MD_SIM_BOOKKEEPING;
  if (m->magic != kMbarMagic) trap("mbarrier wait on an uninitialised mbarrier");
  return (m->phase & 1u) != (parity & 1u);
}

void mbar_wait(Mbar* m, uint32_t parity) {
  MD_SIM_BOOKKEEPING;
  while (!mbar_test(m, parity)) {
    cur().mbar = m;
    pause("an mbarrier phase");
  }
  MD_SIM_ACQUIRE(m);
}

void launch(uint32_t grid, uint32_t block, size_t smem, bool cooperative,
            const std::function<void()>& body) {
  MD_SIM_BOOKKEEPING;
  const Config& cf = config();
  MD_CHECK(g_cur == nullptr, "cuda-sim: a kernel launch from device code");
  MD_CHECK(grid >= 1 && grid <= (1u << 24), "cuda-sim: grid of {} blocks", grid);
  MD_CHECK(block >= 32 && block <= 1024 && block % 32 == 0,
           "cuda-sim: blocks of {} threads (a multiple of 32 up to 1024)", block);
  MD_CHECK(smem <= cf.max_smem, "cuda-sim: {} bytes of dynamic shared memory (at most {})", smem,
           cf.max_smem);
  MD_CHECK(cf.sm_count >= 1, "cuda-sim: sm_count {}", cf.sm_count);
  MD_CHECK(!cooperative || grid <= uint32_t(cf.sm_count),
           "cuda-sim: a cooperative grid of {} blocks exceeds the {} SMs", grid, cf.sm_count);
  const uint32_t resident = cooperative ? grid : std::min<uint32_t>(grid, uint32_t(cf.sm_count));
  Launch L;
  L.body = &body;
  L.rng = cf.seed * 0x9e3779b97f4a7c15ull + 1;
  g_launch = &L;
  // Block issue order: ascending, or shuffled under a seed (blocks of a launch are unordered).
  std::vector<uint32_t> order(grid);
  for (uint32_t i = 0; i < grid; ++i) order[i] = i;
  if (cf.seed != 0)
    for (uint32_t i = grid; i > 1; --i) {
      L.rng ^= L.rng << 13;
      L.rng ^= L.rng >> 7;
      L.rng ^= L.rng << 17;
      std::swap(order[i - 1], order[size_t(L.rng % i)]);
    }
  auto& pool = fiber_pool();
  const size_t need = size_t(resident) * block;
  while (pool.size() < need) pool.push_back(std::make_unique<Fiber>(MD_SIM_STACK));
  std::vector<Thread> threads(need);
  std::vector<size_t> free_slots;  // resident slots whose block has finished
  for (uint32_t s = resident; s-- > 0;) free_slots.push_back(s);
  L.blocks.resize(resident);
  uint32_t next = 0;
  auto start_block = [&](uint32_t slot) {
    auto b = std::make_unique<Block>();
    b->bid = order[next++];
    const size_t bytes = std::max<size_t>(smem, 16) + 128;
    b->smem_store = std::make_unique<uint8_t[]>(bytes);
    b->smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(b->smem_store.get()) + 127) &
                                         ~uintptr_t(127));
    std::memset(b->smem, 0xcd, smem);  // not zero: kernels must not rely on it
    b->warps.resize(block / 32);
    b->live = block;
    for (uint32_t i = 0; i < block; ++i) {
      Thread& t = threads[size_t(slot) * block + i];
      t = Thread{};
      t.fiber = pool[size_t(slot) * block + i].get();
      t.c = ThreadCoords{i, block, b->bid, grid, b->smem, smem};
      t.block = b.get();
      t.launch = &L;
      t.fiber->reset(&thread_main, &t);
      b->threads.push_back(&t);
      L.make_runnable(&t);
    }
    L.live += block;
    L.blocks[slot] = std::move(b);
    stats().threads += block;
  };
  auto give_back = [&]() {
    g_launch = nullptr;
    g_cur = nullptr;
  };
  while (next < grid && !free_slots.empty()) {
    const uint32_t s = uint32_t(free_slots.back());
    free_slots.pop_back();
    start_block(s);
  }
  MD_SIM_RELEASE(&L);  // (the fibers acquire &L's address through their Launch*)
  while (L.live > 0 && L.error.empty()) {
    if (L.runnable.empty() || L.stuck >= L.runnable.size()) {
      L.error = "deadlock: no simulated thread can make progress" + describe_waits(L);
      break;
    }
    Thread* t = L.pick();
    g_cur = t;
    t->fiber->resume();
    g_cur = nullptr;
    // Retire finished blocks and start the next ones.
    for (uint32_t s = 0; s < resident; ++s) {
      Block* b = L.blocks[s].get();
      if (!b || b->live != 0) continue;
      if (b->bar_arrived != 0 && L.error.empty())
        L.error = fmt::format("block {}: threads exited while others wait at the barrier", b->bid);
      L.blocks[s].reset();
      if (next < grid) start_block(s);
    }
  }
  if (!L.error.empty()) {
    // Unwind every thread that started and has not finished, so that each publishes what it
    // wrote and leaves its stack clean; threads that never started wrote nothing.
    L.aborting = true;
    for (const auto& b : L.blocks) {
      if (!b) continue;
      for (Thread* t : b->threads)
        if (t->started && t->state != State::kDone) {
          g_cur = t;
          t->fiber->resume();
          g_cur = nullptr;
        }
    }
  }
  MD_SIM_ACQUIRE(&L);
  std::string err = std::move(L.error);
  give_back();
  if (!err.empty()) throw Error(fmt::format("cuda-sim: {}", err));
}

}  // namespace md::cuda::sim
