// A fixed pool of worker threads (the caller is worker 0) for fork-join parallel regions. Workers
// spin briefly and then sleep on an atomic wait between regions, so a region costs microseconds.
#pragma once
#include <atomic>
#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

namespace md {

class ThreadPool {
 public:
  // n_threads <= 0 means one per online CPU. pin: bind worker i to CPU i (mod CPU count); the
  // caller, worker 0, is bound to CPU 0 at the first run() it makes.
  explicit ThreadPool(int n_threads = 0, bool pin = true);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }

  // Runs f(worker, n_workers) on every worker, the caller included; returns when all finished.
  // An exception thrown by any worker is rethrown here (the first one).
  void run(const std::function<void(int, int)>& f);

  // Splits [0, n) into size() contiguous ranges (aligned to `align`) and runs f(begin, end) on each.
  void parallel_for(size_t n, const std::function<void(size_t, size_t)>& f, size_t align = 1);

 private:
  void worker_main(int id);

  int n_;
  bool pin_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<bool> stop_{false};
  std::exception_ptr error_;
  std::atomic<bool> has_error_{false};
};

int online_cpus();
// The CPUs the process was started on (a launcher's binding or taskset; else online_cpus()).
int usable_cpus();
// The CPUs one of `ranks` processes of a distributed run should use: usable_cpus() for one
// process or a rank its launcher bound to cores; otherwise its share of them (the ranks on this
// node, OMPI_COMM_WORLD_LOCAL_SIZE, else all `ranks`), so that ranks do not oversubscribe them.
int cpus_per_rank(int ranks);
// Pins the calling thread to the cpu-th CPU (mod their count) of those the process was started
// on: all of them, or a launcher's binding (mpirun's per-rank cores).
void pin_current_thread(int cpu);

// Splits [0, n) into `parts` contiguous ranges whose boundaries are multiples of align (except n);
// returns [begin, end) of range `i`.
std::pair<size_t, size_t> split_range(size_t n, int parts, int i, size_t align = 1);

}  // namespace md
