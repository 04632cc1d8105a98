// The simulation's device-side entry points, called by the portability layer (port_sim.h) from
// kernel code compiled for the host. See include/megadecode/kernels/cuda/sim.h for the model.
#pragma once
#include <cstddef>
#include <cstdint>

#include "megadecode/kernels/cuda/sim.h"

namespace md::cuda::sim {

// The running simulated thread's coordinates and its block's shared memory.
struct ThreadCoords {
  uint32_t tid = 0, ntid = 0, bid = 0, nbid = 0;
  uint8_t* smem = nullptr;
  size_t smem_bytes = 0;
};
const ThreadCoords& coords();

void sync_block();

// Warp collectives. Every lane of the calling thread's warp must call the same one; each gets its
// own result, computed as the hardware's shuffle network computes it (reductions: the xor
// butterfly over offsets 16, 8, 4, 2, 1, which leaves every lane with the same bits).
enum class WarpOp : uint8_t { kSumF32, kMaxF32, kMinU32, kMaxU64, kShflIdx, kShflXor, kBallot };
uint64_t warp_collective(uint64_t value, WarpOp op, uint32_t arg);

// A spin wait's pause: lets the other threads run; `what` names what is waited for (the deadlock
// report prints it).
void pause(const char* what);
// The simulated clock (advances with the pauses, see Config::spin_ns).
uint64_t now_ns();

// An mbarrier: arrivals and transaction bytes of the current phase.
struct Mbar {
  uint32_t count = 0;     // arrivals per phase
  uint32_t pending = 0;   // arrivals still expected this phase
  int64_t tx_pending = 0; // transaction bytes announced and not yet delivered
  uint32_t phase = 0;     // completed phases
  uint32_t magic = 0;     // set by mbar_init: waits on an uninitialised barrier are reported
};
void mbar_init(Mbar* m, uint32_t count);
void mbar_arrive_expect_tx(Mbar* m, uint32_t bytes);
void mbar_arrive(Mbar* m);
// Copies bytes (a positive multiple of 16, both addresses 16-byte aligned, dst inside the block's
// shared memory) and delivers them to m: more bytes than announced is an error at once, fewer
// leave the waiters waiting (the deadlock report shows the outstanding bytes).
void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, Mbar* m);
// True once the phase of this parity has completed (the hardware's try_wait.parity).
bool mbar_test(const Mbar* m, uint32_t parity);
void mbar_wait(Mbar* m, uint32_t parity);

// Counts a kernel event (LaunchStats::events; relaxed atomics, as fibers are TSan threads).
void note(Event e);

// Fails the launch with this message (the device code's trap).
[[noreturn]] void trap(const char* what);

}  // namespace md::cuda::sim
