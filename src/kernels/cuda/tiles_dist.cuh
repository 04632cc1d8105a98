// A distributed rank's collectives on CUDA (docs/distributed.md "CUDA ranks"). The exchange
// itself is the host's: before the launch that holds a collective (the op-by-op phase, or the
// megakernel's segment that starts at that phase), the executor gathers the instruction's rows
// into one message, runs the communicator on it (NCCL on a GPU; on the simulation, whose device
// memory is host memory, the run's MPI communicator) and writes the sums back in place
// (src/exec/cuda/collectives.cpp). The tiles here are what is left on the device: the CPU tiles'
// (src/exec/cpu/tiles_dist.cpp) rounding and residual after the sum, element for element.
#pragma once
#include "common.cuh"

MD_CUDA_BEGIN

// [x, x2, resid]: token rows [r0, r1) of x (and x2) hold the ranks' sums; x = round(x), then with
// kFlagResidual x = round(resid + x) (the residual is the left operand, as in attn_out_tile);
// x2 = round(x2).
MD_DEV void all_reduce_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using A = plan::arg::AllReduce;
  const bool rnd = s.num.round_bf16, resid = in.flags & plan::kFlagResidual;
  const int64_t cx = int64_t(a.a[A::x].count);
  const int64_t c2 = a.present(A::x2) ? int64_t(a.a[A::x2].count) : 0;
  for (int t = int(in.r0); t < int(in.r1); ++t) {
    float* x = a.f(A::x, t);
    const float* r = resid ? a.f(A::resid, t) : nullptr;
    for (int64_t i = port::thread_id(); i < cx; i += port::block_threads()) {
      const float v = maybe_round(x[i], rnd);
      x[i] = r ? (rnd ? round_bf16_d(r[i] + v) : r[i] + v) : v;
    }
    if (c2) {
      float* y = a.f(A::x2, t);
      for (int64_t i = port::thread_id(); i < c2; i += port::block_threads())
        y[i] = maybe_round(y[i], rnd);
    }
  }
  port::sync_block();
}

MD_CUDA_END
