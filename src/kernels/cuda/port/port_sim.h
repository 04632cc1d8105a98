// The portability layer on the host simulation (see port.h): every call goes to the simulation's
// scheduler (src/kernels/cuda/sim/runtime.h); global-memory atomics are the host's, with the same
// memory orders (ThreadSanitizer sees them).
#pragma once
#include <cstring>

#include "../sim/runtime.h"

#define MD_DEV inline
#define MD_GLOBAL
#define MD_HD inline

namespace md::cuda::port {

// 16 bytes, loaded in one instruction on the GPU.
struct alignas(16) U4 {
  uint32_t x, y, z, w;
};

MD_DEV uint32_t thread_id() {
  return sim::coords().tid;
}
MD_DEV uint32_t block_threads() {
  return sim::coords().ntid;
}
MD_DEV uint32_t block_id() {
  return sim::coords().bid;
}
MD_DEV uint32_t grid_blocks() {
  return sim::coords().nbid;
}
MD_DEV uint8_t* smem() {
  return sim::coords().smem;
}
MD_DEV void sync_block() {
  sim::sync_block();
}

namespace detail {
inline uint64_t fbits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float bitsf(uint64_t v) {
  const uint32_t u = uint32_t(v);
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
}  // namespace detail

MD_DEV uint32_t f2u(float x) {
  return uint32_t(detail::fbits(x));
}
MD_DEV float u2f(uint32_t u) {
  return detail::bitsf(u);
}
MD_DEV float exp_f(float x) {
  return __builtin_expf(x);
}
MD_DEV float sqrt_f(float x) {
  return __builtin_sqrtf(x);
}
MD_DEV float tanh_f(float x) {
  return __builtin_tanhf(x);
}
MD_DEV float log_f(float x) {
  return __builtin_logf(x);
}

MD_DEV double sqrt_d(double x) {
  return __builtin_sqrt(x);
}
MD_DEV double exp_d(double x) {
  return __builtin_exp(x);
}
MD_DEV double cos_d(double x) {
  return __builtin_cos(x);
}
MD_DEV double sin_d(double x) {
  return __builtin_sin(x);
}
MD_DEV double pow_d(double x, double y) {
  return __builtin_pow(x, y);
}

MD_DEV float warp_sum(float v) {
  return detail::bitsf(sim::warp_collective(detail::fbits(v), sim::WarpOp::kSumF32, 0));
}
MD_DEV float warp_max(float v) {
  return detail::bitsf(sim::warp_collective(detail::fbits(v), sim::WarpOp::kMaxF32, 0));
}
MD_DEV uint32_t warp_min_u32(uint32_t v) {
  return uint32_t(sim::warp_collective(v, sim::WarpOp::kMinU32, 0));
}
MD_DEV uint64_t warp_max_u64(uint64_t v) {
  return sim::warp_collective(v, sim::WarpOp::kMaxU64, 0);
}
MD_DEV float warp_shfl(float v, uint32_t src_lane) {
  return detail::bitsf(sim::warp_collective(detail::fbits(v), sim::WarpOp::kShflIdx, src_lane));
}
MD_DEV uint32_t warp_ballot(bool p) {
  return uint32_t(sim::warp_collective(p ? 1 : 0, sim::WarpOp::kBallot, 0));
}

// Global-memory counters (device scope).
MD_DEV uint32_t load_acquire(const uint32_t* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
MD_DEV uint32_t load_relaxed(const uint32_t* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
MD_DEV void store_relaxed(uint32_t* p, uint32_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}
MD_DEV uint32_t atomic_add_release(uint32_t* p, uint32_t v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELEASE);
}
MD_DEV uint32_t atomic_add_acq_rel(uint32_t* p, uint32_t v) {
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
}
MD_DEV uint32_t atomic_or_relaxed(uint32_t* p, uint32_t v) {
  return __atomic_fetch_or(p, v, __ATOMIC_RELAXED);
}

// Orders the block's earlier writes (made visible to this thread by a block barrier) before
// this thread's next release at device scope.
MD_DEV void fence_device() {
  // Nothing: one host thread runs every fiber, and TSan sees the barrier and the release.
}

// Programmatic dependent launch: the simulation runs launches one after another.
MD_DEV void launch_dependents() {}
MD_DEV void grid_dependency_wait() {}

MD_DEV void pause(const char* what) {
  sim::pause(what);
}
MD_DEV uint64_t now_ns() {
  return sim::now_ns();
}
[[noreturn]] inline void trap(const char* what) {
  sim::trap(what);
}
// A schedule event for the simulation's statistics (sim.h Event).
using Event = sim::Event;
MD_DEV void note(Event e) {
  sim::note(e);
}

// mbarriers in shared memory and bulk async copies global -> shared completing on them.
using Mbar = sim::Mbar;
MD_DEV void mbar_init(Mbar* m, uint32_t count) {
  sim::mbar_init(m, count);
}
// After the initialising thread's inits, before a block barrier: makes them visible to the copy
// engine (a no-op here).
MD_DEV void mbar_init_fence() {}
MD_DEV void mbar_arrive_expect_tx(Mbar* m, uint32_t bytes) {
  sim::mbar_arrive_expect_tx(m, bytes);
}
MD_DEV void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, Mbar* m) {
  sim::bulk_copy_g2s(dst, src, bytes, m);
}
// (One fiber at a time: the copies are ordered already.)
MD_DEV void fence_async_shared() {}
MD_DEV void mbar_wait(Mbar* m, uint32_t parity) {
  sim::mbar_wait(m, parity);
}

}  // namespace md::cuda::port
