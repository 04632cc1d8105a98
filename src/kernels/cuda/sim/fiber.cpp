#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

#include "megadecode/base/error.h"

#if defined(__SANITIZE_ADDRESS__)
#define MD_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MD_SIM_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define MD_SIM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MD_SIM_TSAN 1
#endif
#endif

#if MD_SIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if MD_SIM_TSAN
#include <sanitizer/tsan_interface.h>
#endif

#if defined(__x86_64__)
// md_sim_switch(void** save_sp, void* new_sp): pushes the callee-saved registers, saves the stack
// pointer, loads the other one and pops its registers. A fresh fiber's stack is laid out so that
// the pops land in md_sim_fiber_start with the entry in r12 and its argument in r13.
extern "C" void md_sim_switch(void** save_sp, void* new_sp);
extern "C" void md_sim_fiber_start();
asm(R"(
  .text
  .globl md_sim_switch
  .type md_sim_switch, @function
md_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size md_sim_switch, .-md_sim_switch
  .globl md_sim_fiber_start
  .type md_sim_fiber_start, @function
md_sim_fiber_start:
  movq %r13, %rdi
  callq *%r12
  ud2
  .size md_sim_fiber_start, .-md_sim_fiber_start
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

namespace md::cuda::sim {

namespace {
size_t page_size() {
  static const size_t p = size_t(sysconf(_SC_PAGESIZE));
  return p;
}
}  // namespace

Fiber::Fiber(size_t stack_bytes) {
  const size_t pg = page_size();
  bytes_ = (stack_bytes + pg - 1) / pg * pg + pg;  // + a guard page at the bottom
  stack_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                -1, 0);
  MD_CHECK(stack_ != MAP_FAILED, "cuda-sim: cannot map a {} byte fiber stack", bytes_);
  mprotect(stack_, pg, PROT_NONE);
#if MD_SIM_TSAN
  tsan_fiber_ = __tsan_create_fiber(0);
#endif
}

Fiber::~Fiber() {
#if MD_SIM_TSAN
  if (tsan_fiber_) __tsan_destroy_fiber(tsan_fiber_);
#endif
  if (stack_ && stack_ != MAP_FAILED) munmap(stack_, bytes_);
}

void Fiber::reset(Entry entry, void* arg) {
#if MD_SIM_ASAN
  // A fiber abandoned mid-run (a deadlock, a trap) leaves its frames' redzones poisoned; the next
  // thread on this stack starts from a clean one.
  ASAN_UNPOISON_MEMORY_REGION(static_cast<char*>(stack_) + page_size(), bytes_ - page_size());
#endif
#if defined(__x86_64__)
  // Top of the stack, 16-byte aligned; the six saved registers and the return address below it
  // (sp = top - 72 is 8 mod 16, so md_sim_fiber_start's call sees the ABI's alignment).
  auto top = (reinterpret_cast<uintptr_t>(stack_) + bytes_) & ~uintptr_t(15);
  auto* s = reinterpret_cast<void**>(top - 72);
  s[0] = nullptr;                                          // r15
  s[1] = nullptr;                                          // r14
  s[2] = arg;                                              // r13
  s[3] = reinterpret_cast<void*>(entry);                   // r12
  s[4] = nullptr;                                          // rbx
  s[5] = nullptr;                                          // rbp
  s[6] = reinterpret_cast<void*>(&md_sim_fiber_start);     // return address
  sp_ = s;
#else
  getcontext(&ctx_);
  ctx_.uc_stack.ss_sp = static_cast<char*>(stack_) + page_size();
  ctx_.uc_stack.ss_size = bytes_ - page_size();
  ctx_.uc_link = nullptr;
  makecontext(&ctx_, reinterpret_cast<void (*)()>(entry), 1, arg);
#endif
#if MD_SIM_TSAN
  // A fresh TSan thread per run of the fiber: what an earlier thread on this stack did must not
  // look ordered or racy against this one.
  if (tsan_fiber_) __tsan_destroy_fiber(tsan_fiber_);
  tsan_fiber_ = __tsan_create_fiber(0);
#endif
}

void Fiber::resume() {
#if MD_SIM_TSAN
  tsan_sched_ = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(tsan_fiber_, __tsan_switch_to_fiber_no_sync);
#endif
#if MD_SIM_ASAN
  __sanitizer_start_switch_fiber(&asan_fake_, static_cast<char*>(stack_) + page_size(),
                                 bytes_ - page_size());
#endif
#if defined(__x86_64__)
  md_sim_switch(&sched_sp_, sp_);
#else
  swapcontext(&sched_ctx_, &ctx_);
#endif
#if MD_SIM_ASAN
  __sanitizer_finish_switch_fiber(asan_fake_, nullptr, nullptr);
#endif
}

void Fiber::yield() {
#if MD_SIM_TSAN
  __tsan_switch_to_fiber(tsan_sched_, __tsan_switch_to_fiber_no_sync);
#endif
#if MD_SIM_ASAN
  __sanitizer_start_switch_fiber(&asan_fiber_fake_, sched_bottom_, sched_size_);
#endif
#if defined(__x86_64__)
  md_sim_switch(&sp_, sched_sp_);
#else
  swapcontext(&ctx_, &sched_ctx_);
#endif
#if MD_SIM_ASAN
  __sanitizer_finish_switch_fiber(asan_fiber_fake_, &sched_bottom_, &sched_size_);
#endif
}

void Fiber::entered() {
#if MD_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &sched_bottom_, &sched_size_);
#endif
}

void Fiber::exit() {
#if MD_SIM_TSAN
  __tsan_switch_to_fiber(tsan_sched_, __tsan_switch_to_fiber_no_sync);
#endif
#if MD_SIM_ASAN
  __sanitizer_start_switch_fiber(nullptr, sched_bottom_, sched_size_);
#endif
#if defined(__x86_64__)
  md_sim_switch(&sp_, sched_sp_);
#else
  swapcontext(&ctx_, &sched_ctx_);
#endif
  __builtin_unreachable();
}

}  // namespace md::cuda::sim
