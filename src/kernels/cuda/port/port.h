// The portability layer of the CUDA kernels (docs/cuda.md "Portability layer"): the only place
// where kernel code meets the hardware. The kernel sources (src/kernels/cuda) are compiled twice:
// by nvcc for the GPU (port_device.h: CUDA intrinsics, the one dynamic __shared__ array, the PTX
// of mbarriers and bulk copies) and by the host compiler for the simulation (MD_CUDA_SIM,
// port_sim.h: src/kernels/cuda/sim). scripts/check-cuda-port.sh rejects __shared__, inline PTX
// and threadIdx/blockIdx outside this folder, so the two builds cannot drift apart.
//
// Conventions: 1-D grids and blocks, blocks a multiple of 32 threads, warp collectives called by
// all 32 lanes (full mask), all shared memory dynamic (port::smem(), carved by the kernel).
//
// Both builds live in one binary: each flavor's symbols are in its own inline namespace
// (md::cuda::dev or md::cuda::sim_k), opened by MD_CUDA_BEGIN / MD_CUDA_END.
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define MD_CUDA_BEGIN \
  namespace md::cuda {  \
  inline namespace dev {
#define MD_CUDA_END \
  }                 \
  }
#include "port_device.h"
#elif defined(MD_CUDA_SIM)
#define MD_CUDA_BEGIN \
  namespace md::cuda {  \
  inline namespace sim_k {
#define MD_CUDA_END \
  }                 \
  }
#include "port_sim.h"
#else
#error "port.h is for the CUDA kernels: compile with nvcc, or with MD_CUDA_SIM for the simulation"
#endif

namespace md::cuda::port {

inline constexpr uint32_t kWarp = 32;

MD_DEV uint32_t lane() {
  return thread_id() % kWarp;
}
MD_DEV uint32_t warp_id() {
  return thread_id() / kWarp;
}
MD_DEV uint32_t warps() {
  return block_threads() / kWarp;
}

// Sum of v over the block (every thread gets it). red: block_threads() / 32 floats of shared
// memory, not used by anything else during the call. The order of the additions depends only on
// the block size (a warp butterfly, then the warps' partials in order), so every executor that
// runs a tile with the same block gets the same bits.
MD_DEV float block_sum(float v, float* red) {
  v = warp_sum(v);
  if (lane() == 0) red[warp_id()] = v;
  sync_block();
  float s = 0;
  for (uint32_t w = 0; w < warps(); ++w) s += red[w];
  sync_block();
  return s;
}

MD_DEV float block_max(float v, float* red) {
  v = warp_max(v);
  if (lane() == 0) red[warp_id()] = v;
  sync_block();
  float s = red[0];
  for (uint32_t w = 1; w < warps(); ++w) s = s > red[w] ? s : red[w];
  sync_block();
  return s;
}

// The largest key over the block (every thread gets it); keys are unsigned 64-bit (for an argmax:
// ordered value bits << 32 | ~index, so that ties go to the lowest index).
MD_DEV uint64_t block_max_u64(uint64_t v, uint64_t* red) {
  v = warp_max_u64(v);
  if (lane() == 0) red[warp_id()] = v;
  sync_block();
  uint64_t s = red[0];
  for (uint32_t w = 1; w < warps(); ++w) s = s > red[w] ? s : red[w];
  sync_block();
  return s;
}

}  // namespace md::cuda::port
