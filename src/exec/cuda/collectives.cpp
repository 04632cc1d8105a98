// A distributed rank's collectives on the CUDA executors (docs/distributed.md "CUDA ranks"). The
// plan's kAllReduce / kLogitsGather instructions are exchanged by the host between launches:
//  * op by op, before the phase that holds them (every input comes from earlier phases);
//  * in the megakernel, which then runs in segments: one launch from each such phase to the next
//    (a queue is increasing in global order and a phase is a run of it, so a block's part of a
//    segment is a contiguous slice of its queue).
// An exchange gathers the instruction's rows into one message in device memory, calls the
// communicator (NCCL between GPUs; on the simulation, whose device memory is host memory, the
// run's MPI communicator) and writes the result back in place; the instruction's tile then
// rounds and adds the residual on the device (kernels/cuda/tiles_dist.cuh), as the CPU tile does
// after its call. The sampling tiles read every rank's logits: the logits are gathered whole.
// A step that wants only greedy ids skips that gather: its sample tiles write each row's (max,
// id) pair over the rank's vocabulary block, and the ranks trade those pairs after the step
// (exchange_greedy_ids: 8 bytes a row instead of the block), as the CPU executor does.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "impl.h"
#include "megadecode/dist/communicator.h"
#include "megadecode/dist/shard.h"

namespace md {

void CudaExecutor::Impl::plan_collectives(DevPlan& dp) {
  const plan::Plan& p = dp.plan;
  dp.phase_collectives.assign(p.phases.size(), {});
  dp.seg_phase.assign(1, 0);
  dp.has_collectives = false;
  for (size_t ph = 0; ph < p.phases.size(); ++ph) {
    const uint32_t first = p.stages[p.phases[ph].first].begin;
    const uint32_t last = p.stages[p.phases[ph].second - 1].end;
    for (uint32_t i = first; i < last; ++i) {
      const plan::Op op = p.instrs[i].op;
      if (op == plan::Op::kAllReduce || op == plan::Op::kLogitsGather || op == plan::Op::kAllGather)
        dp.phase_collectives[ph].push_back(i);
    }
    if (dp.phase_collectives[ph].empty()) continue;
    MD_CHECK(comm, "cuda executor: the plan has collectives and the model no communicator");
    dp.has_collectives = true;
    if (ph > 0) dp.seg_phase.push_back(uint32_t(ph));
  }
  if (!dp.has_collectives) return;
  // Each segment's slice of each block's queue: the instructions from its first phase's first
  // id up to the next segment's.
  const size_t S = dp.seg_phase.size();
  std::vector<uint32_t> begin(S * size_t(W)), end(S * size_t(W));
  uint32_t off = 0;
  for (int b = 0; b < W; ++b) {
    const std::vector<uint32_t>& q = p.queue_ids[size_t(b)];
    for (size_t k = 0; k < S; ++k) {
      const uint32_t id0 = p.stages[p.phases[dp.seg_phase[k]].first].begin;
      const uint32_t id1 = k + 1 < S ? p.stages[p.phases[dp.seg_phase[k + 1]].first].begin
                                     : uint32_t(p.instrs.size());
      begin[k * size_t(W) + size_t(b)] =
          off + uint32_t(std::lower_bound(q.begin(), q.end(), id0) - q.begin());
      end[k * size_t(W) + size_t(b)] =
          off + uint32_t(std::lower_bound(q.begin(), q.end(), id1) - q.begin());
    }
    off += uint32_t(q.size());
  }
  upload(*dev, dp.seg_begin, begin);
  upload(*dev, dp.seg_end, end);
}

void CudaExecutor::Impl::exchange(const DevPlan& dp, const DevStep& h, size_t phase) {
  const plan::Plan& p = dp.plan;
  dev->sync();  // the launches that wrote the inputs
  uint8_t* arena_p = arena.as<uint8_t>();
  for (uint32_t id : dp.phase_collectives[phase]) {
    const plan::Instr& in = p.instrs[id];
    const plan::BufferDesc* a = p.buffers.data() + in.args;
    if (in.op == plan::Op::kAllReduce) {
      // Token rows [r0, r1) of x and x2, one message of rows [x | x2].
      using A = plan::arg::AllReduce;
      const int t0 = int(in.r0), t1 = std::min(int(in.r1), h.n);
      if (t1 <= t0) continue;
      const plan::BufferDesc& x = a[A::x];
      const plan::BufferDesc& x2 = a[A::x2];
      const size_t cx = x.count, c2 = x2.kind == plan::BufKind::kNull ? 0 : x2.count;
      const size_t row = cx + c2, n = size_t(t1 - t0);
      coll_send.reserve(dev.get(), n * row * 4);
      float* m = coll_send.as<float>();
      auto rows = [&](bool pack) {
        for (int t = t0; t < t1; ++t) {
          float* mr = m + size_t(t - t0) * row;
          uint8_t* xr = arena_p + x.offset + x.stride * uint64_t(t);
          pack ? dev->copy(mr, xr, cx * 4) : dev->copy(xr, mr, cx * 4);
          if (!c2) continue;
          uint8_t* yr = arena_p + x2.offset + x2.stride * uint64_t(t);
          pack ? dev->copy(mr + cx, yr, c2 * 4) : dev->copy(yr, mr + cx, c2 * 4);
        }
      };
      rows(true);
      dev->sync();
      comm->all_reduce_sum(m, n * row, dist::Elem::kF32);
      rows(false);
    } else if (in.op == plan::Op::kAllGather) {
      // Token rows [r0, r1) of x: this rank's columns (its dist::vocab_block of the width) to
      // every rank, blocks ceil(width / W) wide (the last padded), then each block in its place.
      const plan::BufferDesc& x = a[plan::arg::AllGather::x];
      const int t0 = int(in.r0), t1 = std::min(int(in.r1), h.n), Wr = comm->size();
      if (t1 <= t0) continue;
      const int64_t C = int64_t(x.count), per = (C + Wr - 1) / Wr;
      const size_t n = size_t(t1 - t0), block = n * size_t(per);
      coll_send.reserve(dev.get(), block * 4);
      coll_recv.reserve(dev.get(), block * size_t(Wr) * 4);
      float* send = coll_send.as<float>();
      float* recv = coll_recv.as<float>();
      auto row = [&](int t) {
        return reinterpret_cast<float*>(arena_p + x.offset + x.stride * uint64_t(t));
      };
      const auto [c0, c1] = dist::vocab_block(C, Wr, comm->rank());
      dev->zero(send, block * 4);
      for (int t = t0; t < t1; ++t)
        dev->copy(send + size_t(t - t0) * size_t(per), row(t) + c0, size_t(c1 - c0) * 4);
      dev->sync();
      comm->all_gather(send, recv, block, dist::Elem::kF32);
      for (int r = 0; r < Wr; ++r) {
        const auto [r0, r1] = dist::vocab_block(C, Wr, r);
        for (int t = t0; t < t1; ++t)
          dev->copy(row(t) + r0, recv + size_t(r) * block + size_t(t - t0) * size_t(per),
                    size_t(r1 - r0) * 4);
      }
    } else if (!h.greedy_pairs) {  // (a greedy exchange step trades pairs after the step)
      // This rank's vocabulary block of every logit row to every rank (blocks ceil(V / W)
      // wide, the last padded), then each rank's block into its place.
      const int n = h.n_logits, Wr = comm->size();
      if (n == 0) continue;
      const int64_t V = model.config().vocab_size, per = (V + Wr - 1) / Wr;
      const size_t block = size_t(n) * size_t(per);
      coll_send.reserve(dev.get(), block * 4);
      coll_recv.reserve(dev.get(), block * size_t(Wr) * 4);
      float* send = coll_send.as<float>();
      float* recv = coll_recv.as<float>();
      const auto [v0, v1] = dist::vocab_block(V, Wr, comm->rank());
      dev->zero(send, block * 4);
      for (int b = 0; b < n; ++b)
        dev->copy(send + size_t(b) * size_t(per), h.logits + int64_t(b) * V + v0,
                  size_t(v1 - v0) * 4);
      dev->sync();
      comm->all_gather(send, recv, block, dist::Elem::kF32);
      for (int r = 0; r < Wr; ++r) {
        const auto [r0, r1] = dist::vocab_block(V, Wr, r);
        for (int b = 0; b < n; ++b)
          dev->copy(h.logits + int64_t(b) * V + r0,
                    recv + size_t(r) * block + size_t(b) * size_t(per), size_t(r1 - r0) * 4);
      }
    }
  }
}

void CudaExecutor::Impl::exchange_greedy_ids(const DevStep& h, int32_t* next_ids) {
  const int n = h.n_logits, Wr = comm->size();
  const size_t msg = size_t(n) * 2;
  coll_recv.reserve(dev.get(), msg * size_t(Wr) * 4);
  dev->sync();  // the sample tiles' pairs
  comm->all_gather(h.greedy_pairs, coll_recv.p, msg, dist::Elem::kF32);
  std::vector<float> all(msg * size_t(Wr));
  dev->copy(all.data(), coll_recv.p, all.size() * 4);
  dev->sync();
  // Per row the first rank's pair with the largest value: blocks ascend in id, so ties go to the
  // lowest id (Sampler's argmax over the whole row).
  for (int b = 0; b < n; ++b) {
    float best = -INFINITY;
    int32_t best_id = -1;
    for (int r = 0; r < Wr; ++r) {
      const float* p = all.data() + size_t(r) * msg + 2 * size_t(b);
      int32_t id;
      std::memcpy(&id, p + 1, 4);
      if (id >= 0 && p[0] > best) best = p[0], best_id = id;
    }
    MD_CHECK(best_id >= 0, "sampler: every logit is -inf");
    next_ids[b] = best_id;
  }
}

}  // namespace md
