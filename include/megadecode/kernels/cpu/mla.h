// Multi-head latent attention (NoPE) over a latent cache (as transformers' kimi_linear computes it). The cache of one layer
// holds, per token, the normalised latent c[R] (R = kv_lora_rank) followed by k_pe[P]
// (P = qk_rope_head_dim): row width R + P. kv_b_proj [H*(N+V), R] holds per head N "nope" key rows
// then V value rows. Scores use scale 1/sqrt(N + P).
#pragma once
#include <cstddef>
#include <cstdint>

#include "megadecode/base/bf16.h"

namespace md::cpu {

// Cache rows per decode block (kernels walk the cache in whole blocks); a page holds a multiple.
inline constexpr int kMlaBlockRows = 16;

// One sequence's latent cache of one MLA layer: rows of `ld` elements (the first R + P used:
// c then k_pe), bf16 or fp32, in pages of page_rows consecutive rows. Row t lives in page
// pages[t / page_rows] at row t % page_rows; page p starts at base + p * page_stride bytes.
// page_rows is a positive multiple of kMlaBlockRows.
//
// The kernels read either element type with the same arithmetic: a bf16 element widens to fp32
// exactly, so a bf16 cache holding bf16-valued data gives the bits of an fp32 cache of the same
// values. They only read rows below the T (or t1, T0 + Tq) they are given, and throw md::Error
// for a cache that breaks the rules above (or has ld < R + P). With a bf16 cache each thread keeps
// one block of kMlaBlockRows widened rows (grown once, then reused).
struct LatentCache {
  void* base = nullptr;
  int64_t page_stride = 0;         // bytes
  const int32_t* pages = nullptr;  // page ids, in row order
  int page_rows = 0;
  int64_t ld = 0;     // elements per row
  bool bf16 = false;  // element type (else fp32)
  // Address of row t (as bytes; callers cast by element type).
  void* row(int64_t t) const {
    const int64_t p = t / page_rows, r = t - p * page_rows;
    return static_cast<char*>(base) + static_cast<int64_t>(pages[p]) * page_stride +
           r * ld * static_cast<int64_t>(elem_bytes());
  }
  size_t elem_bytes() const { return bf16 ? 2 : 4; }
  // A view of n contiguous fp32 rows of stride ld (one page; for tests and callers with a flat
  // cache).
  static LatentCache contiguous(float* rows, int64_t ld, int64_t n);
};

// Writes row t of the cache from n fp32 values (bf16 storage: rounded to nearest even, which is
// exact for bf16-valued input).
void store_latent_row(const LatentCache& c, int64_t t, const float* x, int64_t n);

struct MlaDims {
  int H;  // heads
  int N;  // qk_nope_head_dim
  int P;  // qk_rope_head_dim
  int V;  // v_head_dim
  int R;  // kv_lora_rank
};

// Weight-absorbed decode for heads [h0, h1) of one query token attending to cache rows [0, T):
//   ql = W_UK_h^T q_nope_h          (R values; W_UK_h = rows h*(N+V) .. +N of kv_b)
//   s_t = (ql . c_t + q_pe_h . kpe_t) * scale,   p = softmax(s) (fp32)
//   ol = sum_t p_t c_t              (R values)
//   out_h = W_UV_h ol               (V values; W_UV_h = rows h*(N+V)+N .. +V)
// q: [H][N+P] for this token; cache: rows [0, T) of the latent cache (ld >= R + P);
// out: [H][V]. scratch: at least T + 2*R floats.
void mla_decode_absorbed(const float* q, const LatentCache& cache, int T, const bf16* kv_b,
                         const MlaDims& d, int h0, int h1, float* out, float* scratch);

// The same decode split over the cache rows (flash-decoding): a partial per (head, split) and a
// merge. mla_decode_absorbed(T) is exactly mla_decode_partial over [0, T) followed by
// mla_decode_merge with S = 1 (same operations, same bits).
//
// mla_decode_partial: heads [h0, h1) over cache rows [t0, t1) (t0 == t1: an empty split), in
// blocks of kMlaBlockRows rows from t0 (any t0; from a t0 that is not a block start, as
// mla_split_rows' are, a block may span two pages, at a second page-table look-up).
// part[(h - h0) * (R + 2) + ...] = {ol[R] = sum_t exp(s_t - m) c_t, m = max_t s_t, sum_t exp(s_t - m)}
// (an empty split writes zeros, m = -inf, sum 0). scratch: mla_partial_scratch_floats(d, h1 - h0).
//
// mla_decode_merge: for heads [h0, h1), the S partials at part + i * split_stride (each laid out
// as above, relative to h0) are combined in ascending i (skipping empty ones) and out_h = W_UV_h
// ol / sum is written to out[h * V ..]. scratch: R floats.
//
// mla_split_rows: the rows [t0, t1) of split i of S over T rows: whole 16-row blocks, contiguous,
// ascending, covering [0, T).
size_t mla_partial_scratch_floats(const MlaDims& d, int heads);
void mla_split_rows(int T, int S, int i, int* t0, int* t1);
void mla_decode_partial(const float* q, const LatentCache& cache, int t0, int t1, const bf16* kv_b,
                        const MlaDims& d, int h0, int h1, float* part, float* scratch);
void mla_decode_merge(const float* part, int64_t split_stride, int S, const bf16* kv_b,
                      const MlaDims& d, int h0, int h1, float* out, float* scratch);

// Prefill with explicit keys and values (the reference's formulation): for heads [h0, h1) and the
// new tokens i in [0, Tq) at absolute positions T0 + i, attending causally to cache rows
// [0, T0 + i] (the cache already holds the new tokens' rows):
//   k_t = [W_UK_h c_t ; kpe_t], v_t = W_UV_h c_t.
// q: [Tq][H*(N+P)] row stride ldq; out: [Tq][H*V] row stride ldo.
// round_bf16: round to bf16 where the bf16 reference does: k_nope and v (outputs of kv_b_proj),
// each score twice (q . k is a bf16 matmul, rounded; times the scale, rounded again:
// s = round(round(q . k) * scale), before the fp32 softmax) and the softmax probabilities (its
// eager attention casts them back to the activation dtype).
// Which copy of the kernels runs at the active ISA level (cpu_features.h): "avx2" from the avx2
// level up, else "portable".
const char* mla_isa();

void mla_prefill(const float* q, int64_t ldq, int Tq, int T0, const LatentCache& cache,
                 const bf16* kv_b, const MlaDims& d, int h0, int h1, float* out, int64_t ldo,
                 bool round_bf16);

}  // namespace md::cpu
