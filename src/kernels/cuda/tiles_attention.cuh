// The attention tiles of the decode plan on CUDA: Kimi Delta Attention cores, the MLA latent
// rows, cores (unsplit and KV-split) and merges, and K3's q LoRA. The twins of
// src/exec/cpu/tiles_attention.cpp: the same operations and the same bf16 rounding points (every
// place the CPU tile calls round_bf16 / maybe_round), with the fp32 sums in the block's own
// orders (warp butterflies, block_sum), which depend only on the block size. Every thread of a
// block of kTileThreads calls each tile.
//
// Scratch: work() only (kWorkFloats floats); the weight stages belong to gemv_block. The segmented
// path of gemv_block keeps its per-token-row partial sums in work()[0, B), so every tile that
// calls it leaves the first kGemvReserve floats alone while the GEMV runs.
#pragma once
#include "gemv.cuh"
#include "megadecode/plan/ops.h"  // the operand slots (plan::arg)

MD_CUDA_BEGIN

namespace attn {

// work()[0, kGemvReserve): gemv_block's segmented partials (B <= kGemvReserve token rows per call;
// plan::kMaxRows is 64).
inline constexpr int kGemvReserve = 64;
inline constexpr int kRed = 32;  // block_sum / block_max scratch (warps <= 32)
// Cache rows per MLA block: cpu::kMlaBlockRows, the CPU decode's block (same online-softmax
// structure: one max/rescale per block, so the two stay close).
inline constexpr int kMlaBlock = cpu::kMlaBlockRows;

MD_DEV int imin(int a, int b) {
  return a < b ? a : b;
}
MD_DEV int64_t imin64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

// The step's token rows (exec::StepCtx's accessors).
MD_DEV int first_row(const DevStep& s, int b) {
  return s.row0[b];
}
MD_DEV int rows_of(const DevStep& s, int b) {
  return s.row0[b + 1] - s.row0[b];
}
MD_DEV int64_t pos_of(const DevStep& s, int t) {
  const int b = s.seq_of_row[t];
  return s.pos[b] + (t - s.row0[b]);
}

// Row-log offsets (exec's RowLogLayout, kda_row_log_floats): per row, raw q/k/v [3][C], conv
// outputs [3][C], f [C], beta [H].
struct RowLog {
  int64_t C, H;
  MD_DEV int64_t raw(int i) const { return int64_t(i) * C; }
  MD_DEV int64_t conv(int i) const { return (3 + int64_t(i)) * C; }
  MD_DEV int64_t f() const { return 6 * C; }
  MD_DEV int64_t beta() const { return 7 * C; }
  MD_DEV int64_t row() const { return 7 * C + H; }
};

// cpu::LatentCache::row() (host code) for the device: row t lives in page pages[t / page_rows] at
// row t % page_rows; elements bf16 or fp32.
MD_DEV uint8_t* latent_row(const cpu::LatentCache& c, int64_t t) {
  const int64_t p = t / c.page_rows, r = t - p * c.page_rows;
  return static_cast<uint8_t*>(c.base) + int64_t(c.pages[p]) * c.page_stride +
         r * c.ld * (c.bf16 ? 2 : 4);
}
// Element e of a cache row as fp32 (a bf16 element widens exactly, as on the CPU).
MD_DEV float latent_at(const uint8_t* row, int64_t e, bool bf16) {
  return bf16 ? bf16f(reinterpret_cast<const uint16_t*>(row)[e])
              : reinterpret_cast<const float*>(row)[e];
}

// SiLU as cpu::silu writes it, and the conv's activation with the bf16 reference's rounding
// points (conv result and SiLU output rounded).
MD_DEV float silu_d(float x) {
  return x / (1.0f + port::exp_f(-x));
}
MD_DEV float conv_activation(float acc, bool round) {
  if (!round) return silu_d(acc);
  return round_bf16_d(silu_d(round_bf16_d(acc)));
}

}  // namespace attn

// One row of the delta rule on a head's state S [K][K] (cpu::kda_decode_head; the portable form
// of cpu::decode_state, state row-major, row = key channel): from the row's conv outputs qc, kc,
// vc and decay gate g (K each, shared memory), the head's output o (when not null) and the new S.
// qc and kc are rewritten (exp(g) * qn and kn), eg and ck are scratch (K each), red is
// block_sum's. Thread j owns value column j and runs both passes over the key rows in ascending
// order, so the column needs no barrier between reading and updating. The decode tile and the
// commit replay both call it, so a replayed state is bit for bit the one a step of those rows
// leaves.
MD_DEV void kda_delta_row(float* S, float* qc, float* kc, const float* vc, const float* g,
                          float bt, float* eg, float* ck, float* red, int K, float qs, float* o) {
  const uint32_t tid = port::thread_id(), nt = port::block_threads();
  // l2norm_scaled of q (times K^-0.5) and k, the decay vectors and k . q.
  float sq = 0.0f, sk = 0.0f;
  for (int cc = int(tid); cc < K; cc += int(nt)) {
    sq += qc[cc] * qc[cc];
    sk += kc[cc] * kc[cc];
  }
  sq = port::block_sum(sq, red);
  sk = port::block_sum(sk, red);
  const float nq = port::sqrt_f(sq + 1e-6f), nk = port::sqrt_f(sk + 1e-6f);
  float kq = 0.0f;
  for (int cc = int(tid); cc < K; cc += int(nt)) {
    const float qn = qc[cc] / nq * qs, kn = kc[cc] / nk;
    const float e = port::exp_f(g[cc]);
    kq += kn * qn;
    kc[cc] = kn;
    eg[cc] = e;
    ck[cc] = e * kn;
    qc[cc] = e * qn;
  }
  kq = port::block_sum(kq, red);  // its barriers also publish the vectors
  // kv = S^T ck, oa = S^T cq; d = beta (v - kv); o = oa + (k.q) d; S = diag(eg) S + k d^T.
  for (int j = int(tid); j < K; j += int(nt)) {
    float kv = 0.0f, oa = 0.0f;
    for (int r = 0; r < K; ++r) {
      const float sr = S[int64_t(r) * K + j];
      kv += ck[r] * sr;
      oa += qc[r] * sr;
    }
    const float d = bt * (vc[j] - kv);
    if (o) o[j] = oa + kq * d;
    for (int r = 0; r < K; ++r) {
      float* sr = S + int64_t(r) * K + j;
      *sr = eg[r] * *sr + kc[r] * d;
    }
  }
  port::sync_block();  // the next row rewrites the vectors
}

// The fp32 query scale: cpu::query_scale is 1 / sqrt(K) in double, rounded once; this is the
// fp32 quotient of the fp32 root (at most an ulp apart).
MD_DEV float kda_query_scale(int K) {
  return 1.0f / port::sqrt_f(float(K));
}

// [q, k, v, fa, ga, braw, o, f_b, g_b, q_conv, k_conv, v_conv, A_log, dt_bias, o_norm,
//  kda_state, conv_cache]: heads [r0, r1) of sequence seq over its R token rows.
//
// Every step of the CPU tile is per channel or per head, so the block takes one head at a time
// and, within it, groups of G token rows: G rows of f = round(f_b fa) in one GEMV (the head's K
// weight rows), the rows' recurrence one by one (conv + SiLU, decay gate, delta rule), then G rows
// of gate = round(g_b ga) in a second GEMV into the same buffer (f is consumed by then) and the
// gated norms. G is what fits work() next to the per-row vectors (K = 128: 26 rows), so a step of
// more rows streams the head's f_b / g_b rows once per group (L2-resident; correctness first).
//
// Above plan::kMaxChainedRows the CPU tile switches to the reference prefill's chunked form; this
// one stays row by row, which is the same computation in exact arithmetic (the chunked form is an
// algebraic rearrangement of the row recurrence), so it differs from the CPU there by fp32
// rounding only. The row log is written where the CPU writes it (rowlog set and R <= the chained
// limit: the chunked branch logs nothing), the state/conv copy whenever kda_state0 is set.
//
// The delta rule of each row: kda_delta_row.
MD_DEV void kda_core_tile(const DevStep& s, const plan::Instr& in, const Args& a, Pipe& pipe) {
  using K_ = plan::arg::KdaCore;  // q, k, v are consecutive slots
  using attn::imin;
  const DevCfg& c = s.cfg;
  const int b = int(in.seq), h0 = int(in.r0), h1 = int(in.r1);
  const int R = attn::rows_of(s, b), t0 = attn::first_row(s, b);
  const int K = c.kda_head_dim, Wc = c.kda_conv, H = c.kda_heads;
  const int64_t C = int64_t(H) * K, cstride = int64_t(Wc - 1) * C;
  const bool rnd = s.num.round_bf16;
  const bool full_gate = (in.flags & plan::kFlagFullRankGate) != 0;
  const bool bounded = (in.flags & plan::kFlagBoundedDecay) != 0;
  const DevSeq& sv = a.seq(b);
  const attn::RowLog lg{C, H};
  const bool log_rows = sv.rowlog != nullptr && R <= plan::kMaxChainedRows;
  const uint32_t tid = port::thread_id(), nt = port::block_threads();

  // work(): [gemv reserve | red | qc kc vc eg ck (K each) | fb (G rows of K)]. After the norms qc
  // holds exp(g) * qn (cq) and kc holds kn, in place.
  float* red = work() + attn::kGemvReserve;
  float* qc = red + attn::kRed;
  float* kc = qc + K;
  float* vc = kc + K;
  float* eg = vc + K;
  float* ck = eg + K;
  float* fb = ck + K;
  int G = int((int64_t(kWorkFloats) - (fb - work())) / K);
  if (G < 1) port::trap("kda_core: head too wide for the work area");
  G = imin(G, attn::kGemvReserve);

  const float* wconv[3] = {a.vec(K_::q_conv), a.vec(K_::k_conv), a.vec(K_::v_conv)};
  const float* A_log = a.vec(K_::a_log);
  const float* dt_bias = a.vec(K_::dt_bias);
  const float* onorm = a.vec(K_::o_norm);
  const float lower = c.kda_gate_lower_bound;
  const float qs = kda_query_scale(K);

  for (int h = h0; h < h1; ++h) {
    const int64_t ch = int64_t(h) * K;
    float* S = sv.kda_state + ch * K;
    if (sv.kda_state0) {  // the state before the step, for a commit to a prefix
      for (int64_t e = tid; e < int64_t(K) * K; e += nt) sv.kda_state0[ch * K + e] = S[e];
      for (int64_t e = tid; e < int64_t(3) * (Wc - 1) * K; e += nt) {
        const int64_t i = e / (int64_t(Wc - 1) * K), j = e / K % (Wc - 1);
        const int64_t off = i * cstride + j * C + ch + e % K;
        sv.conv0[off] = sv.conv_cache[off];
      }
      port::sync_block();
    }
    const float rate = port::exp_f(A_log[h]);
    for (int g0 = 0; g0 < R; g0 += G) {
      const int gn = imin(G, R - g0);
      // The stream after this group's last GEMV: f_b of the next group or head, or the tile's
      // end (gemv_block's tail prefetch).
      const StreamRef after_group = g0 + G < R        ? then_stream(a.w(K_::f_b), ch, ch + K)
                                    : h + 1 < h1      ? then_stream(a.w(K_::f_b), ch + K, ch + 2 * K)
                                                      : then_tile_end();
      // f = round(f_b fa) for the group's rows (gemv_block ends with a barrier).
      gemv_block(
          a.w(K_::f_b), ch, ch + K, gn, [&](int t) { return a.f(K_::fa, t0 + g0 + t); },
          [&](int t, int64_t r, float v) { fb[t * K + (r - ch)] = maybe_round(v, rnd); }, pipe,
          full_gate ? after_group : then_stream(a.w(K_::g_b), ch, ch + K));
      for (int ii = 0; ii < gn; ++ii) {
        const int i = g0 + ii;
        float* fi = fb + int64_t(ii) * K;
        float* lrow = log_rows ? sv.rowlog + i * lg.row() : nullptr;
        float bt = sigmoid_d(a.f(K_::braw, t0 + i)[h]);
        if (s.num.round_beta) bt = round_bf16_d(bt);
        // Short conv + SiLU of q, k, v on the head's channels (cpu::short_conv_decode: oldest tap
        // first; the thread of channel c alone shifts c's window).
        for (int e = int(tid); e < 3 * K; e += int(nt)) {
          const int j = e / K, cc = e % K;
          const int64_t cx = ch + cc;
          const float x = a.f(K_::q + j, t0 + i)[cx];
          float* cache = sv.conv_cache + j * cstride;
          const float* w = wconv[j] + cx * Wc;
          float acc = 0.0f;
          for (int tap = 0; tap < Wc - 1; ++tap) acc += w[tap] * cache[tap * C + cx];
          acc += w[Wc - 1] * x;
          for (int tap = 0; tap + 1 < Wc - 1; ++tap)
            cache[tap * C + cx] = cache[(tap + 1) * C + cx];
          if (Wc > 1) cache[int64_t(Wc - 2) * C + cx] = x;
          const float o = attn::conv_activation(acc, rnd);
          (j == 0 ? qc : j == 1 ? kc : vc)[cc] = o;
          if (lrow) {
            lrow[lg.raw(j) + cx] = x;
            lrow[lg.conv(j) + cx] = o;
          }
        }
        // The decay gate (cpu::kda_decay_gate / _bounded), in place on the row's f.
        for (int cc = int(tid); cc < K; cc += int(nt)) {
          const float x = fi[cc] + dt_bias[ch + cc];
          float g;
          if (bounded) {
            g = lower * sigmoid_d(rate * x);
          } else {
            const float sp = x > 20.0f ? x : port::log_f(1.0f + port::exp_f(x));
            g = -rate * sp;
          }
          fi[cc] = g;
          if (lrow) lrow[lg.f() + ch + cc] = g;
        }
        if (lrow && tid == 0) lrow[lg.beta() + h] = bt;
        port::sync_block();
        kda_delta_row(S, qc, kc, vc, fi, bt, eg, ck, red, K, qs, a.f(K_::o, t0 + i) + ch);
      }
      // gate = round(g_b ga) (K3's full-rank gate: operand 4 itself), then per row round(o),
      // the gated norm, round(o).
      if (!full_gate)
        gemv_block(
            a.w(K_::g_b), ch, ch + K, gn, [&](int t) { return a.f(K_::ga, t0 + g0 + t); },
            [&](int t, int64_t r, float v) { fb[t * K + (r - ch)] = maybe_round(v, rnd); }, pipe,
            after_group);
      for (int ii = 0; ii < gn; ++ii) {
        const int i = g0 + ii;
        const float* gate = full_gate ? a.f(K_::ga, t0 + i) + ch : fb + int64_t(ii) * K;
        float* orow = a.f(K_::o, t0 + i) + ch;
        float ss = 0.0f;
        for (int cc = int(tid); cc < K; cc += int(nt)) {
          const float x = maybe_round(orow[cc], rnd);
          ss += x * x;
        }
        const float ms = port::block_sum(ss, red) / float(K);
        const float r = 1.0f / port::sqrt_f(ms + s.num.eps);
        for (int cc = int(tid); cc < K; cc += int(nt)) {
          const float x = maybe_round(orow[cc], rnd);
          orow[cc] = maybe_round(onorm[cc] * (x * r) * sigmoid_d(gate[cc]), rnd);
        }
      }
      port::sync_block();  // the next group's GEMV rewrites fb
    }
  }
}

// A commit's replay of one (KDA layer, head) (exec::replay_kda_rows on the device): the state
// before the step restored, the first `rows` rows of the row log run through kda_delta_row (the
// step's own arithmetic, so the state is bit for bit that of a step of those rows), and the conv
// cache rebuilt from its copy before the step and the rows' raw inputs.
MD_DEV void kda_commit_block(const DevCommit& cm, const DevCommitLayer& L, int h) {
  const int K = cm.head_dim, H = cm.heads, Wc = cm.conv;
  const int64_t C = int64_t(H) * K, ch = int64_t(h) * K, cstride = int64_t(Wc - 1) * C;
  const attn::RowLog lg{C, H};
  const uint32_t tid = port::thread_id(), nt = port::block_threads();
  float* red = work();
  float* qc = red + attn::kRed;
  float* kc = qc + K;
  float* vc = kc + K;
  float* g = vc + K;
  float* eg = g + K;
  float* ck = eg + K;
  if (ck + K > work() + kWorkFloats) port::trap("commit: head too wide for the work area");
  float* S = L.kda_state + ch * K;
  for (int64_t e = tid; e < int64_t(K) * K; e += nt) S[e] = L.kda_state0[ch * K + e];
  const float qs = kda_query_scale(K);
  for (int i = 0; i < cm.rows; ++i) {
    const float* row = L.rowlog + i * lg.row();
    for (int cc = int(tid); cc < K; cc += int(nt)) {
      qc[cc] = row[lg.conv(0) + ch + cc];
      kc[cc] = row[lg.conv(1) + ch + cc];
      vc[cc] = row[lg.conv(2) + ch + cc];
      g[cc] = row[lg.f() + ch + cc];
    }
    port::sync_block();
    kda_delta_row(S, qc, kc, vc, g, row[lg.beta() + h], eg, ck, red, K, qs, nullptr);
  }
  // The conv cache after k rows holds the last W-1 inputs of [cache before the step, raw rows
  // 0..k-1], oldest first (the head's channels).
  for (int64_t e = tid; e < int64_t(3) * (Wc - 1) * K; e += nt) {
    const int i = int(e / (int64_t(Wc - 1) * K)), j = int(e / K % (Wc - 1));
    const int64_t cx = ch + e % K;
    const int src = cm.rows + j;
    const float v = src < Wc - 1 ? L.conv0[i * cstride + src * C + cx]
                                 : L.rowlog[(src - (Wc - 1)) * lg.row() + lg.raw(i) + cx];
    L.conv_cache[i * cstride + j * C + cx] = v;
  }
}

// [a, kv_a_norm, mla_cache]: the new cache rows of the token rows of sequences [r0, r1):
// rmsnorm(a[:R]) with the latent eps, then a[R:R+P] as it is, stored at the row's position (bf16
// storage: rounded to nearest even, exact for the bf16-valued rows of BF16 numerics). The sum of
// squares is a block sum in fp32 (the CPU's is in double).
MD_DEV void mla_latent_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using L_ = plan::arg::MlaLatent;
  const int R = s.cfg.kv_lora;
  const int64_t CW = int64_t(R) + s.cfg.rope;  // DevCfg's helpers are host code
  const bool rnd = s.num.round_bf16;
  const float* w = a.vec(L_::kv_a_norm);
  float* red = work();
  const uint32_t tid = port::thread_id(), nt = port::block_threads();
  const int t0 = attn::first_row(s, int(in.r0)), t1 = attn::first_row(s, int(in.r1));
  for (int t = t0; t < t1; ++t) {
    const float* x = a.f(L_::a, t);
    float ss = 0.0f;
    for (int64_t i = tid; i < R; i += nt) ss += x[i] * x[i];
    ss = port::block_sum(ss, red);
    const float r = 1.0f / port::sqrt_f(ss / float(R) + s.num.latent_eps);
    const cpu::LatentCache& cache = a.seq(s.seq_of_row[t]).mla;
    uint8_t* row = attn::latent_row(cache, attn::pos_of(s, t));
    for (int64_t i = tid; i < CW; i += nt) {
      float v = x[i];
      if (i < R) v = rnd ? round_bf16_d(w[i] * round_bf16_d(x[i] * r)) : w[i] * (x[i] * r);
      if (cache.bf16)
        reinterpret_cast<uint16_t*>(row)[i] = uint16_t(port::f2u(round_bf16_d(v)) >> 16);
      else
        reinterpret_cast<float*>(row)[i] = v;
    }
  }
}

namespace attn {

struct MlaShape {
  int H, N, P, V, R;
};

// cpu::mla_split_rows: split i of S over T rows, whole blocks, contiguous, ascending.
MD_DEV void split_rows(int T, int S, int i, int* t0, int* t1) {
  const int64_t nb = (int64_t(T) + kMlaBlock - 1) / kMlaBlock;
  const int64_t b0 = nb * i / S, b1 = nb * (i + 1) / S;
  *t0 = int(imin64(T, b0 * kMlaBlock));
  *t1 = int(imin64(T, b1 * kMlaBlock));
}

// The partial of head h over cache rows [t0, t1) (cpu::mla_decode_partial for one head):
// part[0, R) = sum_t exp(s_t - m) c_t, part[R] = m, part[R + 1] = sum_t exp(s_t - m). part may be
// shared or global memory (only its owner thread touches part[r]; thread 0 writes m and the sum).
// qa: R + P floats and sc: kMlaBlock floats of work memory. The structure is the CPU's: blocks of
// kMlaBlock rows from t0, one max / rescale per block, the block's exponentials added in
// ascending order, the rows added to the accumulator four at a time as the CPU groups them.
MD_DEV void mla_partial_head(const float* q, const cpu::LatentCache& cache, int t0, int t1,
                             const uint16_t* kvb, const MlaShape& d, int h, float* part, float* qa,
                             float* sc) {
  const int N = d.N, P = d.P, V = d.V, R = d.R, RP = R + P;
  const uint32_t tid = port::thread_id(), nt = port::block_threads();
  const uint32_t lane = port::lane(), wid = port::warp_id(), nw = port::warps();
  const float scale = 1.0f / port::sqrt_f(float(N + P));
  const float* qh = q + int64_t(h) * (N + P);
  const uint16_t* wuk = kvb + int64_t(h) * (N + V) * R;
  // ql = W_UK^T q_nope (per element, the CPU's axpy order: ascending n), then q_pe.
  for (int r = int(tid); r < RP; r += int(nt)) {
    float acc = 0.0f;
    if (r < R) {
      for (int n = 0; n < N; ++n) acc += qh[n] * bf16f(wuk[int64_t(n) * R + r]);
    } else {
      acc = qh[N + (r - R)];
    }
    qa[r] = acc;
    if (r < R) part[r] = 0.0f;
  }
  port::sync_block();
  const float neg_inf = -port::u2f(0x7f800000u);
  float run_max = neg_inf, run_sum = 0.0f;  // every thread holds the same values
  for (int b0 = t0; b0 < t1; b0 += kMlaBlock) {
    const int nb = imin(kMlaBlock, t1 - b0);
    // Scores: a warp per row, the lanes over the row's R + P elements.
    for (int k = int(wid); k < nb; k += int(nw)) {
      const uint8_t* row = latent_row(cache, b0 + k);
      float acc = 0.0f;
      for (int e = int(lane); e < RP; e += int(port::kWarp))
        acc += qa[e] * latent_at(row, e, cache.bf16);
      acc = port::warp_sum(acc);
      if (lane == 0) sc[k] = acc * scale;
    }
    port::sync_block();
    float bmax = sc[0];
    for (int k = 1; k < nb; ++k) bmax = bmax < sc[k] ? sc[k] : bmax;
    float alpha = 1.0f;
    const bool rescale = bmax > run_max;
    if (rescale) {  // on the first block exp(-inf) = 0 leaves the zero sums zero
      alpha = port::exp_f(run_max - bmax);
      run_sum *= alpha;
      run_max = bmax;
    }
    float p[kMlaBlock];
    const uint8_t* rows[kMlaBlock];
    float sum = 0.0f;
    for (int k = 0; k < nb; ++k) {
      p[k] = port::exp_f(sc[k] - run_max);
      sum += p[k];
      rows[k] = latent_row(cache, b0 + k);
    }
    run_sum += sum;
    for (int r = int(tid); r < R; r += int(nt)) {
      float y = part[r];
      if (rescale) y *= alpha;
      int k = 0;
      for (; k + 4 <= nb; k += 4)
        y += p[k] * latent_at(rows[k], r, cache.bf16) +
             p[k + 1] * latent_at(rows[k + 1], r, cache.bf16) +
             p[k + 2] * latent_at(rows[k + 2], r, cache.bf16) +
             p[k + 3] * latent_at(rows[k + 3], r, cache.bf16);
      for (; k < nb; ++k) y += p[k] * latent_at(rows[k], r, cache.bf16);
      part[r] = y;
    }
    port::sync_block();  // the next block rewrites sc
  }
  if (tid == 0) {
    part[R] = run_max;
    part[R + 1] = run_sum;
  }
  port::sync_block();
}

// cpu::mla_decode_merge for head h: the S partials at part + i * stride (head h's), merged in
// ascending i skipping empty ones, out_h = W_UV_h acc / sum; out(v, value) is called by one lane
// per value (zeros when no row was attended). acc: R floats of work memory.
template <class Out>
MD_DEV void mla_merge_head(const float* part, int64_t stride, int S, const uint16_t* kvb,
                           const MlaShape& d, int h, float* acc, Out out) {
  const int N = d.N, V = d.V, R = d.R;
  const uint32_t tid = port::thread_id(), nt = port::block_threads();
  const uint32_t lane = port::lane(), wid = port::warp_id(), nw = port::warps();
  const float neg_inf = -port::u2f(0x7f800000u);
  float m = neg_inf;
  for (int i = 0; i < S; ++i) {
    const float* pi = part + i * stride;
    if (pi[R + 1] > 0.0f) m = m < pi[R] ? pi[R] : m;
  }
  if (!(m > neg_inf)) {  // no row attended: zero, as T = 0
    for (int v = int(tid); v < V; v += int(nt)) out(v, 0.0f);
    return;
  }
  float sum = 0.0f;
  for (int i = 0; i < S; ++i) {
    const float* pi = part + i * stride;
    if (pi[R + 1] > 0.0f) sum += port::exp_f(pi[R] - m) * pi[R + 1];
  }
  for (int r = int(tid); r < R; r += int(nt)) {
    float y = 0.0f;
    for (int i = 0; i < S; ++i) {
      const float* pi = part + i * stride;
      if (pi[R + 1] > 0.0f) y += port::exp_f(pi[R] - m) * pi[r];
    }
    acc[r] = y;
  }
  port::sync_block();
  const uint16_t* wuv = kvb + (int64_t(h) * (N + V) + N) * R;
  const float inv = 1.0f / sum;
  for (int v = int(wid); v < V; v += int(nw)) {
    float y = 0.0f;
    for (int e = int(lane); e < R; e += int(port::kWarp))
      y += bf16f(wuv[int64_t(v) * R + e]) * acc[e];
    y = port::warp_sum(y);
    if (lane == 0) out(v, y * inv);
  }
  port::sync_block();  // acc is reused by the next head
}

// The attention output's epilogue (the CPU tiles': round, then K3's sigmoid output gate).
MD_DEV float att_epilogue(float x, const float* gate, int64_t o, bool rnd) {
  x = maybe_round(x, rnd);
  if (!gate) return x;
  return rnd ? round_bf16_d(x * round_bf16_d(sigmoid_d(gate[o]))) : x * sigmoid_d(gate[o]);
}

MD_DEV MlaShape mla_shape(const DevCfg& c) {
  return MlaShape{c.mla_heads, c.nope, c.rope, c.v_head, c.kv_lora};
}

}  // namespace attn

// [q, kv_b, mla_cache, att | parts, gate]: heads [r0, r1) of sequence seq; row i attends to its
// cache rows [0, pos + i]. Unsplit: the partial over all rows in work memory, then the merge of
// that one partial (as cpu::mla_decode_absorbed: with one split the merge is exact), so a
// one-split decode and the unsplit one give the same bits. Split (splits > 1): split `slot`'s
// partials, written to the parts buffer at [slot][H][R + 2].
// The heads go one at a time, each walking the cache rows (the CPU walks them once for the whole
// head range; here the rows are re-read from L2 per head).
MD_DEV void mla_core_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using M = plan::arg::MlaCore;
  const attn::MlaShape d = attn::mla_shape(s.cfg);
  const int b = int(in.seq);
  const bool rnd = s.num.round_bf16, gated = (in.flags & plan::kFlagOutputGate) != 0;
  const cpu::LatentCache& cache = a.seq(b).mla;
  const auto* kvb = static_cast<const uint16_t*>(a.w(M::kv_b).data);
  // work(): qa [R + P] | sc [kMlaBlock] | part [R + 2] | acc [R].
  float* qa = work();
  float* sc = qa + (d.R + d.P);
  float* part = sc + attn::kMlaBlock;
  float* acc = part + (d.R + 2);
  if (int64_t(3) * d.R + d.P + 2 + attn::kMlaBlock > int64_t(kWorkFloats))
    port::trap("mla_core: latent too wide for the work area");
  for (int i = 0; i < attn::rows_of(s, b); ++i) {
    const int t = attn::first_row(s, b) + i;
    const int T = int(s.pos[b] + i + 1);
    const float* q = a.f(M::q, t);
    if (in.splits > 1) {
      int t0 = 0, t1 = 0;
      attn::split_rows(T, int(in.splits), int(in.slot), &t0, &t1);
      float* parts = a.f(M::out, t) + int64_t(in.slot) * d.H * (d.R + 2);
      for (int h = int(in.r0); h < int(in.r1); ++h)
        attn::mla_partial_head(q, cache, t0, t1, kvb, d, h, parts + int64_t(h) * (d.R + 2), qa, sc);
      continue;
    }
    float* att = a.f(M::out, t);
    const float* gate = gated ? a.f(M::gate, t) : nullptr;
    for (int h = int(in.r0); h < int(in.r1); ++h) {
      attn::mla_partial_head(q, cache, 0, T, kvb, d, h, part, qa, sc);
      attn::mla_merge_head(part, 0, 1, kvb, d, h, acc, [&](int v, float x) {
        const int64_t o = int64_t(h) * d.V + v;
        att[o] = attn::att_epilogue(x, gate, o, rnd);
      });
    }
  }
}

// [parts, kv_b, att, gate]: heads [r0, r1) of one sequence's rows, the splits merged in ascending
// order (cpu::mla_decode_merge), then round and K3's output gate.
MD_DEV void mla_merge_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using Mg = plan::arg::MlaMerge;
  const attn::MlaShape d = attn::mla_shape(s.cfg);
  const bool rnd = s.num.round_bf16, gated = (in.flags & plan::kFlagOutputGate) != 0;
  const auto* kvb = static_cast<const uint16_t*>(a.w(Mg::kv_b).data);
  float* acc = work();
  if (d.R > int(kWorkFloats)) port::trap("mla_merge: latent too wide for the work area");
  const int b = int(in.seq);
  for (int i = 0; i < attn::rows_of(s, b); ++i) {
    const int t = attn::first_row(s, b) + i;
    const float* parts = a.f(Mg::parts, t);
    float* att = a.f(Mg::att, t);
    const float* gate = gated ? a.f(Mg::gate, t) : nullptr;
    for (int h = int(in.r0); h < int(in.r1); ++h)
      attn::mla_merge_head(parts + int64_t(h) * (d.R + 2), int64_t(d.H) * (d.R + 2), int(in.splits),
                           kvb, d, h, acc, [&](int v, float x) {
                             const int64_t o = int64_t(h) * d.V + v;
                             att[o] = attn::att_epilogue(x, gate, o, rnd);
                           });
  }
}

// [q_b, qa, q_a_norm, q]: K3's q LoRA, rows [r0, r1) of q = round(q_b RMSNorm(qa)) for every
// token row. The normalised rows go to work memory in groups of G rows (what fits), one GEMV per
// group (a row's result does not depend on the group it is computed in).
MD_DEV void mla_q_up_tile(const DevStep& s, const plan::Instr& in, const Args& a, Pipe& pipe) {
  using Q_ = plan::arg::MlaQUp;
  const int64_t Q = s.cfg.q_lora;
  const bool rnd = s.num.round_bf16;
  // work(): [gemv reserve (G) | red | G rows of Q].
  int G = int((int64_t(kWorkFloats) - attn::kRed) / (Q + 1));
  if (G < 1) port::trap("mla_q_up: q_lora_rank too wide for the work area");
  G = attn::imin(G, attn::kGemvReserve);
  float* red = work() + G;
  float* qn = red + attn::kRed;
  for (int g0 = 0; g0 < s.n; g0 += G) {
    const int gn = attn::imin(G, s.n - g0);
    for (int t = 0; t < gn; ++t)
      rmsnorm_block(a.f(Q_::qa, g0 + t), a.vec(Q_::q_a_norm), Q, s.num.latent_eps, qn + t * Q, rnd,
                    red);
    port::sync_block();
    gemv_block(
        a.w(Q_::q_b), in.r0, in.r1, gn, [&](int t) { return qn + t * Q; },
        [&](int t, int64_t r, float v) { a.f(Q_::q, g0 + t)[r] = maybe_round(v, rnd); }, pipe,
        g0 + G < s.n ? then_stream(a.w(Q_::q_b), in.r0, in.r1) : then_tile_end());
  }
}

MD_CUDA_END
