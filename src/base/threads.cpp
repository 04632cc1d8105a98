#include "megadecode/base/threads.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

namespace md {

int online_cpus() {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

namespace {
// The CPUs this process may run on, as it started (a launcher's binding: mpirun binds each rank
// to its cores), read before any thread of ours is pinned.
std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  if (cpus.empty())
    for (int c = 0; c < online_cpus(); ++c) cpus.push_back(c);
  return cpus;
}
const std::vector<int> g_allowed_cpus = allowed_cpus();
}  // namespace

int usable_cpus() {
  return int(g_allowed_cpus.empty() ? allowed_cpus().size() : g_allowed_cpus.size());
}

int cpus_per_rank(int ranks) {
  const int usable = usable_cpus();
  if (ranks <= 1 || usable < online_cpus()) return usable;  // one process, or a bound rank
  if (const char* e = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"))
    if (std::atoi(e) > 0) ranks = std::atoi(e);
  return std::max(1, usable / ranks);
}

void pin_current_thread(int cpu) {
  // Worker i goes to the i-th CPU the process was given (all of them without a binding), so
  // two ranks bound to different cores never pin their workers onto one.
  const std::vector<int>& cpus = g_allowed_cpus.empty() ? allowed_cpus() : g_allowed_cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpus[size_t(cpu) % cpus.size()], &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: ignore failure
}

std::pair<size_t, size_t> split_range(size_t n, int parts, int i, size_t align) {
  size_t blocks = (n + align - 1) / align;
  size_t per = blocks / static_cast<size_t>(parts), extra = blocks % static_cast<size_t>(parts);
  size_t ui = static_cast<size_t>(i);
  size_t b0 = ui * per + std::min(ui, extra);
  size_t b1 = b0 + per + (ui < extra ? 1 : 0);
  return {std::min(n, b0 * align), std::min(n, b1 * align)};
}

namespace {
// Whether this thread has been bound to CPU 0 as some pool's worker 0.
thread_local bool t_pinned_as_caller = false;
}  // namespace

// The calling thread is worker 0, but it is pinned at its first run(), not here: a thread's
// affinity is inherited by the threads it creates, so pinning the constructing thread (a
// program's main thread) would bind every thread it starts later (a server's HTTP threads, the
// engine thread) to CPU 0, to compete there with worker 0 while CPU 1 spins for worker 1.
ThreadPool::ThreadPool(int n_threads, bool pin)
    : n_(n_threads > 0 ? n_threads : usable_cpus()), pin_(pin) {
  for (int i = 1; i < n_; ++i) {
    threads_.emplace_back([this, i, pin] {
      if (pin) pin_current_thread(i);
      worker_main(i);
    });
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker_main(int id) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t g;
    int spins = 0;
    while ((g = generation_.load(std::memory_order_acquire)) == seen) {
      if (++spins < 20000) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      } else {
        generation_.wait(seen, std::memory_order_acquire);
      }
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    try {
      (*job_)(id, n_);
    } catch (...) {
      bool expected = false;
      if (has_error_.compare_exchange_strong(expected, true)) error_ = std::current_exception();
    }
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining_.notify_one();
  }
}

void ThreadPool::run(const std::function<void(int, int)>& f) {
  if (pin_ && !t_pinned_as_caller) {
    pin_current_thread(0);
    t_pinned_as_caller = true;
  }
  if (n_ == 1) {
    f(0, 1);
    return;
  }
  job_ = &f;
  has_error_.store(false, std::memory_order_relaxed);
  error_ = nullptr;
  remaining_.store(n_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  std::exception_ptr mine;
  try {
    f(0, n_);
  } catch (...) {
    mine = std::current_exception();
  }
  int spins = 0, r;
  while ((r = remaining_.load(std::memory_order_acquire)) != 0) {
    if (++spins < 200000) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    } else {
      remaining_.wait(r, std::memory_order_acquire);
    }
  }
  if (mine) std::rethrow_exception(mine);
  if (has_error_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t)>& f,
                              size_t align) {
  run([&](int id, int nw) {
    auto [b, e] = split_range(n, nw, id, align);
    if (b < e) f(b, e);
  });
}

}  // namespace md
