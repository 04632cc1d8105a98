// The host simulation of the CUDA execution model (docs/cuda.md "Simulation"): the CUDA
// backend's kernel sources, compiled with the host compiler against the portability layer
// (src/kernels/cuda/port), run here as fibers, one per simulated thread, in one OS thread.
//
// What is simulated: a 1-D grid of blocks of a multiple of 32 threads; blocks resident at once up
// to sm_count (a cooperative launch needs them all resident, as the persistent megakernel does);
// per-block dynamic shared memory; block barriers; warp collectives (shuffles, reductions,
// ballots: every lane of the warp must arrive, as on the GPU with a full mask); global atomics
// with their memory orders; bulk async copies into shared memory completing on mbarriers with
// byte-count checking; spin waits. A thread runs until it reaches a barrier, a warp collective or
// a spin pause, then the scheduler picks the next runnable thread: in a fixed round-robin order
// (seed 0) or at random (any other seed), so that missing waits show up as wrong results under
// some seeds.
//
// Deadlock detector: when every runnable thread has spun twice without any thread making
// progress in between (or no thread can run at all: a barrier some threads never reach), the
// launch stops with an md::Error describing what every waiting thread waits for. Under
// ThreadSanitizer every fiber is its own TSan thread and switches carry no synchronisation, so
// the data races of the device code between threads and blocks are reported; barriers,
// collectives and atomics carry the happens-before edges they carry on the GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace md::cuda::sim {

struct Config {
  int sm_count = 4;          // what the simulated device reports as its SM count
  uint64_t seed = 0;         // thread scheduling: 0 round-robin, else random with this seed
  size_t max_smem = 227 << 10;  // dynamic shared memory a block may ask for (H100/H200 opt-in)
  // The simulated clock for the device watchdog: nanoseconds advance by this much per spin pause,
  // so a watchdog of T seconds fires after T / spin_ns pauses whatever the host's speed.
  uint64_t spin_ns = 1000;
};
// The process-wide configuration (set before launching; tests set the seed per case).
Config& config();

// What the kernels report through port::note (no-ops on a GPU), for tests of their schedule.
enum class Event : uint8_t {
  kPrefetchUsed,          // a GEMV started from chunks issued before it (its own prefetch)
  kPrefetchUsedNextTile,  // ... issued by the previous instruction's tail
  kPrefetchDrained,       // a prefetch nobody used was waited out (bandwidth wasted)
  kCount
};
struct LaunchStats {
  uint64_t switches = 0;  // fiber switches
  uint64_t threads = 0;   // simulated threads run
  uint64_t events[size_t(Event::kCount)] = {};
  uint64_t count(Event e) const { return events[size_t(e)]; }
};
LaunchStats& stats();

// Runs body() as every thread of a grid of `grid` blocks of `block` threads with `smem` bytes
// of dynamic shared memory each. cooperative: all blocks resident at once (md::Error if the
// grid exceeds sm_count). Throws md::Error on a deadlock, a bulk-copy byte mismatch, a bad launch
// shape or an exception thrown by a thread.
void launch(uint32_t grid, uint32_t block, size_t smem, bool cooperative,
            const std::function<void()>& body);

}  // namespace md::cuda::sim
