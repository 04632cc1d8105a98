// The sample tile on CUDA: the next token of each logit row, with the semantics of
// engine/sampler.cpp's sample_row (penalties, temperature, top-k, top-p, min-p, a draw with the
// row's uniform), computed by one block per row range.
//
// Greedy rows are an argmax (ties to the lowest id) as on the CPU. A draw selects the same sets
// as the CPU: the top-k candidates by (x desc, id asc), the smallest best-first prefix of them
// whose mass reaches top_p, the min-p filter, then the token where the row's uniform falls in
// the kept mass. The CPU sorts and partitions; here every set is a threshold found by bisection
// over the order-preserving bits of x (then over ids, for ties), each step one block reduction —
// deterministic, so both CUDA executors draw the same tokens. The mass sums are doubles in the
// block's order (the CPU's are sequential), and the final scan runs in id order (the CPU's in its
// partition order), so a draw can differ from the CPU's by the reordering of the sums near a
// boundary: the same distribution, not always the same token.
#pragma once
#include "common.cuh"

MD_CUDA_BEGIN

// The order-preserving map of a float onto unsigned integers.
MD_DEV uint32_t ordered_bits(float x) {
  const uint32_t u = port::f2u(x);
  return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

MD_DEV uint32_t block_sum_u32(uint32_t v, float* red) {
  // Counts below 2^24 are exact in fp32 partials; the vocabulary is far below that.
  return uint32_t(port::block_sum(float(v), red));
}

// Doubles over the block in a fixed order (thread partials in smem, summed by thread 0).
MD_DEV double block_sum_f64(double v, double* red) {
  red[port::thread_id()] = v;
  port::sync_block();
  double s = 0;
  for (uint32_t i = 0; i < port::block_threads(); ++i) s += red[i];
  port::sync_block();
  return s;
}

// Argmax of row [0, V), ties to the lowest id. Each thread loads kArgmaxUnroll of its logits
// before it compares any: with one load in flight a thread waited a memory latency per
// block-width of the row (254 us for kl48's 163840 logits on an H200, 2026-12-04). The keys are
// unique (the id is in them), so their maximum does not depend on the order.
inline constexpr int kArgmaxUnroll = 8;
MD_DEV uint64_t argmax_key(float v, int64_t i) {
  return uint64_t(ordered_bits(v)) << 32 | uint64_t(0xffffffffu - uint32_t(i));
}
MD_DEV int32_t argmax_row(const float* row, int64_t V, uint64_t* red) {
  const int64_t nt = port::block_threads();
  uint64_t best = 0;
  int64_t i = port::thread_id();
  for (; i + (kArgmaxUnroll - 1) * nt < V; i += kArgmaxUnroll * nt) {
    float v[kArgmaxUnroll];
    for (int u = 0; u < kArgmaxUnroll; ++u) v[u] = row[i + u * nt];
    for (int u = 0; u < kArgmaxUnroll; ++u) {
      const uint64_t key = argmax_key(v[u], i + u * nt);
      best = key > best ? key : best;
    }
  }
  for (; i < V; i += nt) {
    const uint64_t key = argmax_key(row[i], i);
    best = key > best ? key : best;
  }
  best = port::block_max_u64(best, red);
  return int32_t(0xffffffffu - uint32_t(best));
}

// The draw (sampler.cpp draw()) over row l (penalised already): see the file comment.
struct DrawSets {
  const float* l;
  int64_t V;
  float inv_t, mx, min_p;
  // Top-k: key > kT, or key == kT and id <= kI. (k == V: everything.)
  bool topk = false;
  uint32_t kT = 0;
  int64_t kI = 0;
  // Top-p: key > pT, or key == pT and id <= pI.
  bool topp = false;
  uint32_t pT = 0;
  int64_t pI = 0;
  MD_DEV float x(int64_t i) const { return l[i] * inv_t; }
  MD_DEV float w(int64_t i) const { return port::exp_f(x(i) - mx); }
  MD_DEV bool in_c(int64_t i) const {
    if (!topk) return true;
    const uint32_t k = ordered_bits(x(i));
    return k > kT || (k == kT && i <= kI);
  }
  MD_DEV bool kept(int64_t i) const {
    if (!in_c(i)) return false;
    if (!topp) return true;
    const uint32_t k = ordered_bits(x(i));
    return k > pT || (k == pT && i <= pI);
  }
};

// The largest T with f(T) true, f monotone (true at 0 ... false above); 32 halvings.
template <class F>
MD_DEV uint32_t largest_key(F f) {
  uint32_t lo = 0, hi = 0xffffffffu;  // f(lo) assumed true
  while (lo < hi) {
    const uint32_t mid = lo + uint32_t((uint64_t(hi) - lo + 1) / 2);
    if (f(mid))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}
// The smallest id I in [0, V) with f(I) true, f monotone; V - 1 if none.
template <class F>
MD_DEV int64_t smallest_id(int64_t V, F f) {
  int64_t lo = 0, hi = V - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (f(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

MD_DEV int32_t draw_row(const DevSample& r, const float* l, int64_t V, float* red) {
  double* dred = reinterpret_cast<double*>(red + 64);  // block_threads() doubles
  DrawSets d{l, V, 1.0f / r.temperature, 0, r.min_p};
  float mx = -__builtin_huge_valf();
  for (int64_t i = port::thread_id(); i < V; i += port::block_threads()) mx = d.x(i) > mx ? d.x(i) : mx;
  d.mx = port::block_max(mx, red);
  const uint32_t tid = port::thread_id(), nt = port::block_threads();
  auto count = [&](auto pred) {
    uint32_t c = 0;
    for (int64_t i = tid; i < V; i += nt) c += pred(i) ? 1u : 0u;
    return block_sum_u32(c, red);
  };
  auto mass = [&](auto pred) {
    double m = 0;
    for (int64_t i = tid; i < V; i += nt)
      if (pred(i)) m += double(d.w(i));
    return block_sum_f64(m, dred);
  };
  const int64_t k = r.top_k > 0 && int64_t(r.top_k) < V ? int64_t(r.top_k) : V;
  if (k < V) {
    d.kT = largest_key([&](uint32_t T) {
      return count([&](int64_t i) { return ordered_bits(d.x(i)) >= T; }) >= uint32_t(k);
    });
    const uint32_t gt = count([&](int64_t i) { return ordered_bits(d.x(i)) > d.kT; });
    const uint32_t need = uint32_t(k) - gt;
    d.kI = smallest_id(V, [&](int64_t I) {
      return count([&](int64_t i) { return ordered_bits(d.x(i)) == d.kT && i <= I; }) >= need;
    });
    d.topk = true;
  }
  if (r.top_p < 1.0f) {
    const double z = mass([&](int64_t i) { return d.in_c(i); });
    const double target = double(r.top_p) * z;
    d.pT = largest_key([&](uint32_t T) {
      return mass([&](int64_t i) { return d.in_c(i) && ordered_bits(d.x(i)) >= T; }) >= target;
    });
    const double gt = mass([&](int64_t i) { return d.in_c(i) && ordered_bits(d.x(i)) > d.pT; });
    d.pI = smallest_id(V, [&](int64_t I) {
      return gt + mass([&](int64_t i) {
               return d.in_c(i) && ordered_bits(d.x(i)) == d.pT && i <= I;
             }) >= target;
    });
    d.topp = true;
  }
  auto eligible = [&](int64_t i) { return d.kept(i) && d.w(i) >= d.min_p; };
  const double total = mass(eligible);
  const double u = r.uniform * total;
  // The first id whose cumulative kept mass (id order) exceeds u; the last eligible id if the
  // rounding leaves u at the total.
  const int64_t j = smallest_id(V, [&](int64_t J) {
    return mass([&](int64_t i) { return eligible(i) && i <= J; }) > u;
  });
  if (eligible(j) && mass([&](int64_t i) { return eligible(i) && i <= j; }) > u) return int32_t(j);
  uint64_t last = 0;
  for (int64_t i = tid; i < V; i += nt)
    if (eligible(i)) last = uint64_t(i) + 1 > last ? uint64_t(i) + 1 : last;
  last = port::block_max_u64(last, reinterpret_cast<uint64_t*>(red));
  return last > 0 ? int32_t(last - 1) : int32_t(j);
}

// [logits, next]: logit rows [r0, r1) of those the step has.
MD_DEV void sample_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  const int64_t V = s.cfg.vocab;
  float* red = work();
  for (int b = int(in.r0); b < int(in.r1) && b < s.n_logits; ++b) {
    const float* row = s.logits + int64_t(b) * V;
    if (s.greedy_pairs) {
      // This rank's block only (DevStep::greedy_pairs); the host trades the pairs.
      const int64_t lo = s.vocab_lo;
      const int32_t i = argmax_row(row + lo, s.vocab_hi - lo, reinterpret_cast<uint64_t*>(red));
      if (port::thread_id() == 0) {
        const float v = row[lo + i];
        const int32_t id = v == -__builtin_huge_valf() ? -1 : int32_t(lo) + i;
        s.greedy_pairs[2 * b] = v;
        s.greedy_pairs[2 * b + 1] = port::u2f(uint32_t(id));  // the id's bits
      }
      port::sync_block();
      continue;
    }
    int32_t id;
    const DevSample* r = s.sampling ? &s.sampling[b] : nullptr;
    const bool pen = r && r->npen > 0 &&
                     (r->repetition_penalty != 1.0f || r->presence_penalty != 0.0f ||
                      r->frequency_penalty != 0.0f);
    if (pen) {
      // apply_penalties on a copy, in the list's order (one thread: a repeated id is penalised
      // twice, as on the CPU).
      float* w = s.sample_work + int64_t(b) * V;
      for (int64_t i = port::thread_id(); i < V; i += port::block_threads()) w[i] = row[i];
      port::sync_block();
      if (port::thread_id() == 0)
        for (uint32_t i = 0; i < r->npen; ++i) {
          const PenaltyCount& p = s.penalties[r->pen0 + i];
          float& l = w[p.id];
          if (r->repetition_penalty != 1.0f) l = l > 0.0f ? l / r->repetition_penalty : l * r->repetition_penalty;
          if (p.output_count > 0)
            l -= r->frequency_penalty * float(p.output_count) + r->presence_penalty;
        }
      port::sync_block();
      row = w;
    }
    if (!r || r->temperature == 0.0f)
      id = argmax_row(row, V, reinterpret_cast<uint64_t*>(red));
    else
      id = draw_row(*r, row, V, red);
    if (port::thread_id() == 0) a.ints(plan::arg::Sample::next, b)[0] = id;
    port::sync_block();
  }
}

MD_CUDA_END
