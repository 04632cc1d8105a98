// The portability layer on the GPU (see port.h). sm_90 and later stream through the copy engine
// (cp.async.bulk completing on an mbarrier's transaction count); sm_80 has no bulk copies, so
// there the issuing thread copies in 16-byte loads and the mbarrier is a phase word in shared
// memory, with the same interface and the same results.
#pragma once
#include <cstdio>
#include <cuda/atomic>

#define MD_DEV __device__ __forceinline__
#define MD_GLOBAL __global__
#define MD_HD __host__ __device__ __forceinline__

namespace md::cuda::port {

// 16 bytes, loaded in one instruction.
using U4 = uint4;

MD_DEV uint32_t thread_id() {
  return threadIdx.x;
}
MD_DEV uint32_t block_threads() {
  return blockDim.x;
}
MD_DEV uint32_t block_id() {
  return blockIdx.x;
}
MD_DEV uint32_t grid_blocks() {
  return gridDim.x;
}
// The kernel's dynamic shared memory (the launch's smem bytes), 128-byte aligned.
MD_DEV uint8_t* smem() {
  extern __shared__ __align__(128) uint8_t md_dynamic_smem[];
  return md_dynamic_smem;
}
MD_DEV void sync_block() {
  __syncthreads();
}

MD_DEV uint32_t f2u(float x) {
  return __float_as_uint(x);
}
MD_DEV float u2f(uint32_t u) {
  return __uint_as_float(u);
}
MD_DEV float exp_f(float x) {
  return expf(x);
}
MD_DEV float sqrt_f(float x) {
  return sqrtf(x);
}
MD_DEV float tanh_f(float x) {
  return tanhf(x);
}
MD_DEV float log_f(float x) {
  return logf(x);
}

MD_DEV double sqrt_d(double x) {
  return sqrt(x);
}
MD_DEV double exp_d(double x) {
  return exp(x);
}
MD_DEV double cos_d(double x) {
  return cos(x);
}
MD_DEV double sin_d(double x) {
  return sin(x);
}
MD_DEV double pow_d(double x, double y) {
  return pow(x, y);
}

MD_DEV float warp_sum(float v) {
  for (int m = 16; m >= 1; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
MD_DEV float warp_max(float v) {
  for (int m = 16; m >= 1; m /= 2) {
    const float o = __shfl_xor_sync(0xffffffffu, v, m);
    v = v < o ? o : v;
  }
  return v;
}
MD_DEV uint32_t warp_min_u32(uint32_t v) {
  for (int m = 16; m >= 1; m /= 2) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o < v ? o : v;
  }
  return v;
}
MD_DEV uint64_t warp_max_u64(uint64_t v) {
  for (int m = 16; m >= 1; m /= 2) {
    const uint64_t o = __shfl_xor_sync(0xffffffffu, v, m);
    v = v < o ? o : v;
  }
  return v;
}
MD_DEV float warp_shfl(float v, uint32_t src_lane) {
  return __shfl_sync(0xffffffffu, v, int(src_lane));
}
MD_DEV uint32_t warp_ballot(bool p) {
  return __ballot_sync(0xffffffffu, p);
}

MD_DEV uint32_t load_acquire(const uint32_t* p) {
  return ::cuda::atomic_ref<const uint32_t, ::cuda::thread_scope_device>(*p).load(
      ::cuda::memory_order_acquire);
}
MD_DEV uint32_t load_relaxed(const uint32_t* p) {
  return ::cuda::atomic_ref<const uint32_t, ::cuda::thread_scope_device>(*p).load(
      ::cuda::memory_order_relaxed);
}
MD_DEV void store_relaxed(uint32_t* p, uint32_t v) {
  ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_device>(*p).store(v,
                                                                      ::cuda::memory_order_relaxed);
}
MD_DEV uint32_t atomic_add_release(uint32_t* p, uint32_t v) {
  return ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_device>(*p).fetch_add(
      v, ::cuda::memory_order_release);
}
MD_DEV uint32_t atomic_add_acq_rel(uint32_t* p, uint32_t v) {
  return ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_device>(*p).fetch_add(
      v, ::cuda::memory_order_acq_rel);
}
MD_DEV uint32_t atomic_or_relaxed(uint32_t* p, uint32_t v) {
  return ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_device>(*p).fetch_or(
      v, ::cuda::memory_order_relaxed);
}

// Orders the block's earlier writes (made visible to this thread by a block barrier) before
// this thread's next release at device scope.
MD_DEV void fence_device() {
  __threadfence();
}

// Programmatic dependent launch (sm_90+): the next kernel in the stream may start once every
// block of this one has called launch_dependents(); grid_dependency_wait() holds a kernel until
// the previous one has completed and its writes are visible. No-ops before Hopper.
MD_DEV void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
MD_DEV void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

MD_DEV void pause(const char*) {
  __nanosleep(64);
}
// The simulation's schedule statistics; nothing on a GPU.
enum class Event : uint8_t { kPrefetchUsed, kPrefetchUsedNextTile, kPrefetchDrained };
MD_DEV void note(Event) {}
MD_DEV uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// A trap leaves the CUDA context unusable (a sticky error), so the reason is printed first: it
// reaches the process's stdout when the host next synchronises.
[[noreturn]] __device__ inline void trap(const char* what) {
  printf("megadecode device trap (block %u thread %u): %s\n", blockIdx.x, threadIdx.x, what);
  __trap();
  __builtin_unreachable();
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
struct Mbar {
  uint64_t word;
};
MD_DEV uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}
MD_DEV void mbar_init(Mbar* m, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(m)), "r"(count)
               : "memory");
}
MD_DEV void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
MD_DEV void mbar_arrive_expect_tx(Mbar* m, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(m)),
               "r"(bytes)
               : "memory");
}
MD_DEV void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, Mbar* m) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(m))
      : "memory");
}
// A bulk copy completes in microseconds; one that has not completed after a second never will
// (a short copy, a lost phase): a trap naming it beats a hang the op-by-op path has no watchdog
// for.
inline constexpr uint64_t kMbarTimeoutNs = 1000000000ull;
MD_DEV void mbar_wait(Mbar* m, uint32_t parity) {
  uint32_t done = 0;
  uint64_t t0 = 0;
  for (uint32_t i = 0;; ++i) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_addr(m)), "r"(parity) : "memory");
    if (done) return;
    if ((i & 1023) == 0) {
      const uint64_t t = now_ns();
      if (i == 0)
        t0 = t;
      else if (t - t0 > kMbarTimeoutNs)
        trap("a bulk copy into shared memory did not complete within 1 s (mbar_wait)");
    }
  }
}
// Orders this thread's (and, after a block barrier, the block's) generic-proxy accesses to shared
// memory before the async-proxy writes of the bulk copies it issues next: a stage is refilled
// only after every warp has read it.
MD_DEV void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#else
// sm_80: one issuing thread per phase copies synchronously; the phase word completes when the
// announced bytes have been copied.
struct Mbar {
  uint32_t phase;
  int32_t tx;
};
MD_DEV void mbar_init(Mbar* m, uint32_t) {
  m->phase = 0;
  m->tx = 0;
}
MD_DEV void mbar_init_fence() {}
MD_DEV void mbar_arrive_expect_tx(Mbar* m, uint32_t bytes) {
  m->tx += int32_t(bytes);
  if (m->tx == 0) {
    __threadfence_block();
    *reinterpret_cast<volatile uint32_t*>(&m->phase) = m->phase + 1;
  }
}
MD_DEV void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, Mbar* m) {
  const int4* s = static_cast<const int4*>(src);
  int4* d = static_cast<int4*>(dst);
  for (uint32_t i = 0; i < bytes / 16; ++i) d[i] = s[i];
  m->tx -= int32_t(bytes);
  if (m->tx == 0) {
    __threadfence_block();
    *reinterpret_cast<volatile uint32_t*>(&m->phase) = m->phase + 1;
  }
}
MD_DEV void mbar_wait(Mbar* m, uint32_t parity) {
  while ((*reinterpret_cast<volatile uint32_t*>(&m->phase) & 1u) == (parity & 1u)) {
  }
  __threadfence_block();
}
// The copies are plain loads and stores here: nothing to order.
MD_DEV void fence_async_shared() {}
#endif

}  // namespace md::cuda::port
