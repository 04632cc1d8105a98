// Fibers for the CUDA simulation: a stack and a saved stack pointer, switched by a hand-written
// x86-64 routine that saves only the callee-saved registers (~10x faster than swapcontext, which
// makes a signal-mask system call per switch: ../shared/CUDA.md measured 78 ms against 651 ms for
// a simulated decode step), with the ucontext calls as the portable fallback. Sanitizer builds
// announce every switch to AddressSanitizer (stack bounds) and ThreadSanitizer (one TSan thread
// per fiber, switches without synchronisation).
#pragma once
#include <cstddef>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace md::cuda::sim {

class Fiber {
 public:
  using Entry = void (*)(void* arg);
  // A fiber that will run entry(arg) on its own stack of `stack_bytes` when first resumed. The
  // entry must never return: it ends by switching away for good (finish()).
  Fiber(size_t stack_bytes);
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  void reset(Entry entry, void* arg);
  // From the scheduler's context into this fiber, until it switches back.
  void resume();
  // From this fiber back to the scheduler.
  void yield();
  // The first thing the entry does (sanitizer bookkeeping of the switch that started it).
  void entered();
  // The last: back to the scheduler for good (reset() before resuming it again).
  [[noreturn]] void exit();

 private:
  void* stack_ = nullptr;
  size_t bytes_ = 0;
  void* sp_ = nullptr;         // the fiber's saved stack pointer
  void* sched_sp_ = nullptr;   // the scheduler's, while the fiber runs
  void* tsan_fiber_ = nullptr;
  void* tsan_sched_ = nullptr;
  void* asan_fake_ = nullptr;
  void* asan_fiber_fake_ = nullptr;
  const void* sched_bottom_ = nullptr;
  size_t sched_size_ = 0;
#if !defined(__x86_64__)
  ucontext_t ctx_{}, sched_ctx_{};
#endif
};

}  // namespace md::cuda::sim
