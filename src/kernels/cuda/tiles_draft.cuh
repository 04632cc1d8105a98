// The draft plan's tiles on CUDA (plan.h kDraft*; docs/speculative.md "The draft plan"): the
// twins of src/exec/cpu/tiles_draft.cpp, with the same operands, outputs and bf16 rounding points.
// The GEMVs (fc and k | v over the context rows, the Markov bias) are gemv_block's, the norms
// rmsnorm_block's (fp32 block sums where the CPU sums in double); the attention keeps the CPU's
// orders: each score is a thread's serial dot product over the head, the softmax's sum and every
// output element add up the keys in the CPU's order (visible ring slots ascending, then the block
// rows), so only the norms' statistics differ from the CPU by fp32 reordering. The block's other
// ops are the decode plan's tiles (tiles_dense.cuh).
//
// The ring (keys normed and rotated, values, slot positions) is per sequence and layer in device
// memory (DevSeq::ring_*). q and k of the block rows are normed and rotated in place: each
// attention tile owns its sequence's rows in its heads' columns, which nothing else reads.
#pragma once
#include "gemv.cuh"
#include "tiles_attention.cuh"
#include "tiles_sample.cuh"

MD_CUDA_BEGIN

// RoPE over neox halves of `heads` heads of x at `position` (cpu::rope_neox): angle = position *
// theta^(-2i/d) in double, cos and sin rounded to fp32 (and to bf16 with rnd), each output with
// the CPU's rounding points. Thread per (head, i < d / 2).
MD_DEV void rope_neox_block(float* x, int heads, int d, int64_t position, double theta, bool rnd) {
  const int half = d / 2;
  for (int e = int(port::thread_id()); e < heads * half; e += int(port::block_threads())) {
    const int h = e / half, i = e % half;
    const double angle = double(position) * port::pow_d(theta, -2.0 * i / d);
    float c = float(port::cos_d(angle)), s = float(port::sin_d(angle));
    if (rnd) c = round_bf16_d(c), s = round_bf16_d(s);
    float* v = x + int64_t(h) * d;
    const float a = v[i], b = v[i + half];
    v[i] = maybe_round(maybe_round(a * c, rnd) + maybe_round(-b * s, rnd), rnd);
    v[i + half] = maybe_round(maybe_round(b * c, rnd) + maybe_round(a * s, rnd), rnd);
  }
}

// Per-head RMSNorm of heads [h0, h1) of one row (in place), then RoPE of those heads at
// `position` (DraftModel's norm_rope, restricted to the heads).
MD_DEV void draft_norm_rope(const DevStep& s, float* row, int h0, int h1, const float* w,
                            int64_t position) {
  const int d = s.draft.head_dim;
  for (int h = h0; h < h1; ++h)
    rmsnorm_block(row + int64_t(h) * d, w, d, s.num.eps, row + int64_t(h) * d, s.num.round_bf16,
                  work());
  port::sync_block();
  rope_neox_block(row + int64_t(h0) * d, h1 - h0, d, position, s.draft.rope_theta,
                  s.num.round_bf16);
  port::sync_block();
}

// [W, X, Y] over the context rows: Y[t][r0:r1] = round(W X[t]) (fc, or a layer's k / v), in
// groups of kGemvReserve rows (gemv_block's partials), the rows' weights streamed once a group.
MD_DEV void draft_ctx_proj_tile(const DevStep& s, const plan::Instr& in, const Args& a,
                                Pipe& pipe) {
  using G = plan::arg::Gemv;
  const float* X = a.f(G::x);
  float* Y = a.f(G::y);
  const int64_t ldx = a.ld(G::x), ldy = a.ld(G::y);
  const bool rnd = s.num.round_bf16;
  const DevWeight& w = a.w(G::w);
  for (int t0 = 0; t0 < s.n_ctx; t0 += attn::kGemvReserve) {
    const int nb = attn::imin(attn::kGemvReserve, s.n_ctx - t0);
    const bool last = t0 + nb >= s.n_ctx;
    gemv_block(
        w, in.r0, in.r1, nb, [&](int t) { return X + (t0 + t) * ldx; },
        [&](int t, int64_t r, float v) { Y[(t0 + t) * ldy + r] = maybe_round(v, rnd); }, pipe,
        last ? then_tile_end() : then_stream(w, in.r0, in.r1));
  }
}

// [x, hidden_norm, h]: context rows [r0, r1).
MD_DEV void draft_ctx_norm_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using F = plan::arg::FfnNorm;
  for (int t = int(in.r0); t < int(in.r1); ++t) {
    rmsnorm_block(a.f(F::x, t), a.vec(F::norm), s.cfg.hidden, s.num.eps, a.f(F::h, t),
                  s.num.round_bf16, work());
    port::sync_block();
  }
}

// [k, v, k_norm, ctx_pos, ring] of sequence r0: each of its context rows' key (k_norm, RoPE at
// the row's position) and value into ring slot position % window; layer 0 records the slot's
// position (the slot's rows of every layer are written in the same step).
MD_DEV void draft_ctx_write_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using Cw = plan::arg::DraftCtxWrite;
  const DevDraft& c = s.draft;
  const int b = int(in.r0), C = s.n_ctx / s.batch;
  const int64_t KV = int64_t(c.kv_heads) * c.head_dim;
  const DevSeq& v = a.seq(b);
  for (int j = 0; j < C; ++j) {
    const int t = b * C + j;
    const int32_t p = a.ints(Cw::ctx_pos, t)[0];
    if (p < 0) continue;
    const int64_t slot = p % c.window;
    float* key = v.ring_k + slot * KV;
    float* val = v.ring_v + slot * KV;
    const float* k = a.f(Cw::k, t);
    const float* x = a.f(Cw::v, t);
    for (int64_t e = port::thread_id(); e < KV; e += port::block_threads()) {
      key[e] = k[e];
      val[e] = x[e];
    }
    port::sync_block();
    draft_norm_rope(s, key, 0, c.kv_heads, a.vec(Cw::k_norm), p);
    if (in.layer == 0 && port::thread_id() == 0) v.ring_pos[slot] = p;
  }
}

// Whether ring slot `slot` is visible from a block at `anchor`: filled, before the anchor, within
// the window.
MD_DEV bool ring_visible(const DevSeq& v, const DevDraft& c, int slot, int64_t anchor) {
  const int64_t p = v.ring_pos[slot];
  return p >= 0 && p < anchor && p >= anchor - c.window;
}

// [q, k, v, q_norm, k_norm, att, ring]: KV heads [r0, r1) of sequence `seq` and their query
// heads, every block row: q and k normed and rotated (in place), then each row attends to the
// visible ring slots and to the block's rows up to its own (cpu::gqa_attend's arithmetic: the
// scores, their max, the sum of exp(score - max), weights = exp * (1 / sum) rounded to bf16 in
// BF16, the weighted sum of the values), att rounded as the reference rounds the whole output.
// Keys are indexed j < window: ring slot j, then window + i: block row i.
MD_DEV void draft_attn_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using At = plan::arg::DraftAttn;
  const DevDraft& c = s.draft;
  const int b = in.seq, G = attn::rows_of(s, b), t0 = attn::first_row(s, b);
  const int grp = c.heads / c.kv_heads, d = c.head_dim, Wn = c.window;
  const int k0 = int(in.r0), k1 = int(in.r1), q0 = k0 * grp, q1 = k1 * grp;
  const int64_t KV = int64_t(c.kv_heads) * d, ldk = a.ld(At::k), ldv = a.ld(At::v);
  const int64_t anchor = s.pos[b];
  const bool rnd = s.num.round_bf16;
  const DevSeq& v = a.seq(b);
  const uint32_t T = port::block_threads(), tid = port::thread_id();
  if (d > 4 * int(T) || 64 + int(T) + d > int(kWorkFloats))
    port::trap("draft plan: the head size does not fit the attention tile");
  float* red = work();         // [32]: the block reductions
  float* wbuf = work() + 64;   // [T]: a chunk of keys' exponentials / weights
  float* qv = wbuf + T;        // [d]: the query head
  for (int r = 0; r < G; ++r) {
    draft_norm_rope(s, a.f(At::q, t0 + r), q0, q1, a.vec(At::q_norm), anchor + r);
    draft_norm_rope(s, a.f(At::k, t0 + r), k0, k1, a.vec(At::k_norm), anchor + r);
  }
  const float scale = float(1.0 / port::sqrt_d(double(d)));
  for (int r = 0; r < G; ++r) {
    const int nk = Wn + r + 1;
    for (int h = q0; h < q1; ++h) {
      const int64_t kv_off = int64_t(h / grp) * d;
      for (int e = int(tid); e < d; e += int(T)) qv[e] = a.f(At::q, t0 + r)[int64_t(h) * d + e];
      port::sync_block();
      // Key j's score (a thread's serial dot over the head), or whether it is not a key.
      auto key_of = [&](int j) -> const float* {
        if (j < Wn) return ring_visible(v, c, j, anchor) ? v.ring_k + int64_t(j) * KV + kv_off
                                                         : nullptr;
        return a.f(At::k, t0) + int64_t(j - Wn) * ldk + kv_off;
      };
      auto score = [&](const float* k) {
        float acc = 0;
        for (int e = 0; e < d; ++e) acc += qv[e] * k[e];
        return acc * scale;
      };
      float mx = -port::u2f(0x7f800000u);
      for (int j = int(tid); j < nk; j += int(T))
        if (const float* k = key_of(j)) {
          const float x = score(k);
          mx = x > mx ? x : mx;
        }
      mx = port::block_max(mx, red);
      // The sum in key order: each chunk's exponentials, added by thread 0.
      float sum = 0;
      for (int j0 = 0; j0 < nk; j0 += int(T)) {
        const int j = j0 + int(tid);
        const float* k = j < nk ? key_of(j) : nullptr;
        wbuf[tid] = k ? port::exp_f(score(k) - mx) : 0.0f;
        port::sync_block();
        if (tid == 0)
          for (int i = 0; i < int(T) && j0 + i < nk; ++i)
            if (key_of(j0 + i)) sum += wbuf[i];
        port::sync_block();
      }
      if (tid == 0) red[32] = sum;
      port::sync_block();
      const float inv = 1.0f / red[32];
      // The weighted values, each element over the keys in order.
      float* out = a.f(At::att, t0 + r) + int64_t(h) * d;
      float acc[4] = {0, 0, 0, 0};  // elements tid, tid + T, ... (d <= 4 T)
      for (int j0 = 0; j0 < nk; j0 += int(T)) {
        const int j = j0 + int(tid);
        const float* k = j < nk ? key_of(j) : nullptr;
        float w = k ? port::exp_f(score(k) - mx) * inv : 0.0f;
        wbuf[tid] = rnd ? round_bf16_d(w) : w;
        port::sync_block();
        for (int i = 0; i < int(T) && j0 + i < nk; ++i) {
          const int jj = j0 + i;
          const float* val;
          if (jj < Wn) {
            if (!ring_visible(v, c, jj, anchor)) continue;
            val = v.ring_v + int64_t(jj) * KV + kv_off;
          } else {
            val = a.f(At::v, t0) + int64_t(jj - Wn) * ldv + kv_off;
          }
          for (int u = 0; u < 4; ++u) {
            const int e = int(tid) + u * int(T);
            if (e < d) acc[u] += wbuf[i] * val[e];
          }
        }
        port::sync_block();
      }
      for (int u = 0; u < 4; ++u) {
        const int e = int(tid) + u * int(T);
        if (e < d) out[e] = maybe_round(acc[u], rnd);
      }
      port::sync_block();
    }
  }
}

// [base, w1, w2, tokens, drafts, biased, best]: slot k over vocabulary rows [r0, r1) for every
// sequence: bias = round(w2[r0:r1] w1[prev]) (prev: the anchor for k = 0, else draft k - 1),
// biased = base + bias in fp32, and the block's first maximum as (value, id) in column `seq`.
// Sequences go in groups whose w1 rows fit work() (each group streams the tile's w2 rows).
MD_DEV void draft_markov_tile(const DevStep& s, const plan::Instr& in, const Args& a, Pipe& pipe) {
  using Mk = plan::arg::DraftMarkov;
  const int B = s.batch, k = in.slot, col = in.seq;
  const int64_t rank = s.draft.markov_rank;
  const DevWeight& w1 = a.w(Mk::w1);
  const DevWeight& w2 = a.w(Mk::w2);
  const bool rnd = s.num.round_bf16;
  if (!a.present(Mk::biased)) port::trap("draft plan: the Markov tile needs its biased rows");
  float* e = work() + attn::kGemvReserve;  // [group][rank]: w1 rows of the previous tokens
  const int64_t room = (int64_t(kWorkFloats) - attn::kGemvReserve - 64) / rank;
  const int gB = int(room < int64_t(attn::kGemvReserve) ? room : int64_t(attn::kGemvReserve));
  if (gB < 1) port::trap("draft plan: the Markov rank does not fit the tile's work memory");
  uint64_t* red = reinterpret_cast<uint64_t*>(work() + kWorkFloats - 64);
  for (int b0 = 0; b0 < B; b0 += gB) {
    const int nb = attn::imin(gB, B - b0);
    for (int64_t i = port::thread_id(); i < int64_t(nb) * rank; i += port::block_threads()) {
      const int b = b0 + int(i / rank);
      const int32_t prev = k == 0 ? s.tokens[attn::first_row(s, b)] : a.ints(Mk::drafts, b)[k - 1];
      const int64_t at = int64_t(prev) * w1.cols + i % rank;
      e[i] = w1.dtype == WDType::kF32 ? static_cast<const float*>(w1.data)[at]
                                      : bf16f(static_cast<const uint16_t*>(w1.data)[at]);
    }
    port::sync_block();
    gemv_block(
        w2, in.r0, in.r1, nb, [&](int t) { return e + t * rank; },
        [&](int t, int64_t r, float v) {
          const int row = attn::first_row(s, b0 + t) + k;
          a.f(Mk::biased, row)[r] = a.f(Mk::base, row)[r] + maybe_round(v, rnd);
        },
        pipe, b0 + nb >= B ? then_tile_end() : then_stream(w2, in.r0, in.r1));
    port::sync_block();
    for (int t = 0; t < nb; ++t) {
      const int b = b0 + t;
      const float* row = a.f(Mk::biased, attn::first_row(s, b) + k);
      uint64_t best = 0;
      for (int64_t i = int64_t(in.r0) + port::thread_id(); i < int64_t(in.r1);
           i += port::block_threads()) {
        const uint64_t key =
            uint64_t(ordered_bits(row[i])) << 32 | uint64_t(0xffffffffu - uint32_t(i));
        best = key > best ? key : best;
      }
      best = port::block_max_u64(best, red);
      if (port::thread_id() == 0) {
        const int32_t id = int32_t(0xffffffffu - uint32_t(best));
        float* cell = a.f(Mk::best, b) + 2 * col;
        cell[0] = row[id];
        reinterpret_cast<int32_t*>(cell)[1] = id;
      }
    }
    port::sync_block();
  }
}

// [best, drafts]: sequences [r0, r1), slot k: the first maximum over the vocabulary blocks in
// order (so ties go to the lowest id, as DraftModel's argmax). Thread per sequence.
MD_DEV void draft_pick_tile(const DevStep& s, const plan::Instr& in, const Args& a) {
  using Pk = plan::arg::DraftPick;
  const int T = int(a.a[Pk::best].count / 2);
  for (int b = int(in.r0) + int(port::thread_id()); b < int(in.r1);
       b += int(port::block_threads())) {
    const float* cells = a.f(Pk::best, b);
    int best = 0;
    for (int j = 1; j < T; ++j)
      if (cells[2 * j] > cells[2 * best]) best = j;
    a.ints(Pk::drafts, b)[in.slot] = reinterpret_cast<const int32_t*>(cells)[2 * best + 1];
  }
  (void)s;
  port::sync_block();
}

MD_CUDA_END
