// A distributed rank's collectives as plan tiles (docs/distributed.md "Collectives"): one worker
// issues the call while the others go on with instructions that do not need its result. The
// instructions form one dependency chain per step (each collective waits, through the layer
// between, on the one before), so the calls are serialized across workers as MPI's
// MPI_THREAD_SERIALIZED level requires, and every rank issues them in the same order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/dist/communicator.h"
#include "megadecode/dist/shard.h"
#include "megadecode/engine/sampler.h"
#include "megadecode/plan/ops.h"
#include "tiles.h"

namespace md::exec::detail {

namespace {

// The message buffer of this worker (grown once to the plan's largest message).
std::vector<float>& message(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

dist::Communicator& comm_of(const StepCtx& s, const plan::Instr& in) {
  MD_CHECK(s.comm, "decode plan: #{} is a collective and this executor has no communicator", in.id);
  return *s.comm;
}

}  // namespace

// [x, x2, resid]: token rows [r0, r1) of x (and of x2) summed over the ranks in one call, then
// x = round(sum) (the reference rounds o_proj's and the down projections' outputs), and with
// resid x = round(resid + x): the residual is the left operand, as in attn_out_tile.
void all_reduce_tile(const StepCtx& s, const plan::Instr& in, const Args& a) {
  using A = plan::arg::AllReduce;
  const int t0 = int(in.r0), n = int(in.r1) - t0;
  if (n <= 0) return;
  const int64_t cx = a.a[A::x].count;
  const int64_t c2 = a.present(A::x2) ? a.a[A::x2].count : 0;
  const int64_t row = cx + c2;
  std::vector<float>& buf = message(size_t(n) * size_t(row));
  for (int t = 0; t < n; ++t) {
    std::copy(a.f(A::x, t0 + t), a.f(A::x, t0 + t) + cx, buf.data() + t * row);
    if (c2) std::copy(a.f(A::x2, t0 + t), a.f(A::x2, t0 + t) + c2, buf.data() + t * row + cx);
  }
  comm_of(s, in).all_reduce_sum(buf.data(), size_t(n) * size_t(row), dist::Elem::kF32);
  const bool rnd = s.num.round_bf16;
  for (int t = 0; t < n; ++t) {
    const float* m = buf.data() + t * row;
    float* x = a.f(A::x, t0 + t);
    std::copy(m, m + cx, x);
    maybe_round(x, cx, rnd);
    if (in.flags & plan::kFlagResidual) {
      const float* r = a.f(A::resid, t0 + t);
      for (int64_t i = 0; i < cx; ++i) x[i] = rnd ? round_bf16(r[i] + x[i]) : r[i] + x[i];
    }
    if (c2) {
      float* y = a.f(A::x2, t0 + t);
      std::copy(m + cx, m + row, y);
      maybe_round(y, c2, rnd);
    }
  }
}

// Every rank's block of columns (dist::vocab_block of the width C) of n rows to every rank, in
// place: blocks ceil(C / world) wide (the last padded) in one all-gather. row(t) is row t.
template <class Row>
void gather_column_blocks(dist::Communicator& c, int n, int64_t C, Row row) {
  const int W = c.size();
  const int64_t per = (C + W - 1) / W;
  const size_t block = size_t(n) * size_t(per);
  std::vector<float>& buf = message(block * size_t(W + 1));
  float* send = buf.data();
  float* recv = send + block;
  const auto [c0, c1] = dist::vocab_block(C, W, c.rank());
  for (int t = 0; t < n; ++t) {
    float* dst = send + size_t(t) * size_t(per);
    std::copy(row(t) + c0, row(t) + c1, dst);
    std::fill(dst + (c1 - c0), dst + per, 0.0f);
  }
  c.all_gather(send, recv, block, dist::Elem::kF32);
  for (int r = 0; r < W; ++r) {
    const auto [r0, r1] = dist::vocab_block(C, W, r);
    for (int t = 0; t < n; ++t) {
      const float* src = recv + size_t(r) * block + size_t(t) * size_t(per);
      std::copy(src, src + (r1 - r0), row(t) + r0);
    }
  }
}

// [x]: every token row's columns [c0, c1) of x (this rank's block of its width) to every rank;
// afterwards every rank holds all of x's columns. The values travel unchanged.
void all_gather_tile(const StepCtx& s, const plan::Instr& in, const Args& a) {
  using G = plan::arg::AllGather;
  const int t0 = int(in.r0), n = int(in.r1) - t0;
  if (n <= 0) return;
  gather_column_blocks(comm_of(s, in), n, a.a[G::x].count,
                       [&](int t) { return a.f(G::x, t0 + t); });
}

// The greedy exchange (StepCtx::greedy_exchange): each rank's (max, id) of its block per row, one
// all-gather of 8 bytes a row, then on every rank the first rank's pair with the largest value
// (blocks ascend in id, so ties go to the lowest id: Sampler's argmax over the whole row). The
// next ids go straight to the kSample instructions' output.
static void exchange_greedy_ids(const StepCtx& s, dist::Communicator& c) {
  const int n = s.n_logits, W = c.size();
  const int64_t V = s.cfg->vocab_size;
  const auto [v0, v1] = dist::vocab_block(V, W, c.rank());
  std::vector<float>& buf = message(size_t(n) * 2 * size_t(W + 1));
  float* send = buf.data();
  float* recv = send + size_t(n) * 2;
  for (int b = 0; b < n; ++b) {
    const float* row = s.logits + int64_t(b) * V;
    const LogitMax m = logit_max(std::span<const float>(row + v0, size_t(v1 - v0)), int32_t(v0));
    send[2 * b] = m.value;
    std::memcpy(&send[2 * b + 1], &m.id, 4);  // the id's bits travel as they are
  }
  c.all_gather(send, recv, size_t(n) * 2, dist::Elem::kF32);
  const plan::BufferDesc& d = s.plan->buffers[s.plan->next_ids_buffer];
  for (int b = 0; b < n; ++b) {
    LogitMax best{-INFINITY, -1};
    for (int r = 0; r < W; ++r) {
      const float* p = recv + size_t(r) * size_t(n) * 2 + 2 * size_t(b);
      int32_t id;
      std::memcpy(&id, p + 1, 4);
      if (id >= 0 && p[0] > best.value) best = {p[0], id};
    }
    MD_CHECK(best.id >= 0, "sampler: every logit is -inf");
    std::memcpy(s.arena + d.offset + d.stride * uint64_t(b), &best.id, 4);
  }
}

// [logits]: this rank computed its vocabulary block of every logit row (lm_head); afterwards
// every rank holds every block. Blocks are ceil(V / world) wide (the last padded). A greedy
// exchange step trades (max, id) pairs instead.
void logits_gather_tile(const StepCtx& s, const plan::Instr& in, const Args& a) {
  (void)a;
  dist::Communicator& c = comm_of(s, in);
  const int n = s.n_logits;
  if (n == 0) return;
  if (s.greedy_exchange) return exchange_greedy_ids(s, c);
  const int64_t V = s.cfg->vocab_size;
  gather_column_blocks(c, n, V, [&](int b) { return s.logits + int64_t(b) * V; });
}

}  // namespace md::exec::detail
