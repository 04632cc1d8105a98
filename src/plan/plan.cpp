// The decode-plan compiler: walks the layers in the reference path's op order (engine/model.cpp),
// tiles every op, wires the counters, lays out the activation arena and schedules the tiles onto
// W workers. See docs/architecture.md "The decode plan" for the format and the deadlock argument.
#include "megadecode/plan/plan.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <tuple>

#include "megadecode/base/dtype.h"
#include "megadecode/base/error.h"
#include "megadecode/model/weights.h"

namespace md::plan {

namespace {

constexpr uint64_t kAlign = 64;

uint64_t align_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}
int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Rows per tile for a matrix of `rows` x `row_bytes`: about `target` bytes, but at least
// `min_bytes` (smaller tiles cost more in synchronisation than they gain in balance), small enough
// that the matrix gives at least `workers` tiles (counting `copies` independent instances of it
// that run in parallel, e.g. the expert slots of a layer), a multiple of 16 rows, and evened out
// so that the tiles of a matrix have about the same size.
int64_t tile_rows(int64_t rows, double row_bytes, const PlanOptions& o, int workers,
                  int copies = 1) {
  row_bytes = std::max(row_bytes, 1.0);
  int64_t rb = int64_t(double(o.tile_bytes) / row_bytes);
  const int64_t cap = ceil_div(ceil_div(rows * copies, workers), copies);
  rb = std::min(rb, cap);
  rb = std::max<int64_t>(rb, int64_t(double(o.min_tile_bytes) / row_bytes));
  rb = int64_t(align_up(uint64_t(std::max<int64_t>(rb, 1)), 16));
  if (rb >= rows) return std::max<int64_t>(rows, 1);
  const int64_t n = ceil_div(rows, rb);
  return std::min<int64_t>(rows, int64_t(align_up(uint64_t(ceil_div(rows, n)), 16)));
}

// Head-aligned tiling of a [heads * per_head, cols] matrix: either `group` whole heads per tile
// or each head cut in `split` equal parts.
struct HeadTiling {
  int group = 1;  // heads per tile (split == 1)
  int split = 1;  // parts per head (group == 1)
};
HeadTiling head_tiling(int heads, int per_head, double row_bytes, const PlanOptions& o,
                       int workers) {
  const int64_t rb = tile_rows(int64_t(heads) * per_head, row_bytes, o, workers);
  HeadTiling t;
  if (rb >= per_head) {
    t.group = int(std::clamp<int64_t>(rb / per_head, 1, heads));
    return t;
  }
  // Smallest split whose parts fit the target; prefer parts that are multiples of 16 rows.
  for (int s = 2; s <= per_head; ++s) {
    if (per_head % s) continue;
    const int part = per_head / s;
    if (part <= rb && (part % 16 == 0 || part < 16)) {
      t.split = s;
      return t;
    }
  }
  return t;  // no good divisor: whole heads
}

class Builder {
 public:
  Builder(Plan& p, const ModelConfig& c, const ModelWeights* w)
      : p_(p), c_(c), w_(w), B_(p.batch), W_(p.workers) {}

  // ---- tables -------------------------------------------------------------------------------

  BufferDesc arena(int64_t elems_per_seq, size_t elt = 4) {
    BufferDesc d;
    d.kind = BufKind::kArena;
    d.count = uint32_t(elems_per_seq);
    d.stride = align_up(uint64_t(elems_per_seq) * elt, kAlign);
    d.offset = p_.arena_bytes;
    p_.arena_bytes += align_up(d.stride * uint64_t(B_), kAlign);
    return d;
  }
  uint32_t weight_id(WeightKind k, int layer, int expert = 0) {
    auto key = std::make_tuple(int(k), layer, expert);
    auto it = wid_.find(key);
    if (it != wid_.end()) return it->second;
    const uint32_t id = uint32_t(p_.weights.size());
    p_.weights.push_back(WeightRef{k, 0, uint16_t(layer < 0 ? kNoLayer : layer), uint32_t(expert)});
    wid_[key] = id;
    return id;
  }
  BufferDesc weight(WeightKind k, int layer = -1) {
    BufferDesc d;
    d.kind = BufKind::kWeight;
    d.layer = uint16_t(layer < 0 ? kNoLayer : layer);
    d.count = 1;
    d.offset = weight_id(k, layer);
    return d;
  }
  // A set of per-expert matrices: ids are consecutive, expert e at offset + e.
  BufferDesc expert_weights(WeightKind k, int layer) {
    BufferDesc d;
    d.kind = BufKind::kWeight;
    d.layer = uint16_t(layer);
    d.count = uint32_t(c_.num_experts);
    d.offset = weight_id(k, layer, 0);
    for (int e = 1; e < c_.num_experts; ++e)
      MD_CHECK(weight_id(k, layer, e) == d.offset + e, "plan: expert weight ids not consecutive");
    return d;
  }
  static BufferDesc state(StateKind s, int layer) {
    BufferDesc d;
    d.kind = BufKind::kState;
    d.sub = uint8_t(s);
    d.layer = uint16_t(layer);
    return d;
  }
  static BufferDesc io(BufKind k) {
    BufferDesc d;
    d.kind = k;
    return d;
  }
  static BufferDesc null() { return BufferDesc{}; }

  // Appends an operand list; returns (first entry, count).
  std::pair<uint32_t, uint32_t> args(std::initializer_list<BufferDesc> list) {
    const uint32_t first = uint32_t(p_.buffers.size());
    for (const BufferDesc& d : list) p_.buffers.push_back(d);
    return {first, uint32_t(list.size())};
  }

  uint32_t counter(Op op, int layer, uint32_t group = 0) {
    CounterDesc d;
    d.op = op;
    d.layer = uint16_t(layer < 0 ? kNoLayer : layer);
    d.group = group;
    p_.counters.push_back(d);
    return uint32_t(p_.counters.size() - 1);
  }
  // A wait for every signal the counter receives in a step (known once all its producers have
  // been emitted, which the emission order guarantees before any consumer).
  Wait all_of(uint32_t ctr) const { return Wait{ctr, p_.counters[ctr].per_step}; }

  void emit(Instr in, std::pair<uint32_t, uint32_t> a, uint64_t bytes) {
    in.args = a.first;
    in.nargs = a.second;
    in.id = uint32_t(p_.instrs.size());
    in.est_bytes = uint32_t(std::min<uint64_t>(bytes, 0xffffffffu));
    if (in.signal != kNone) ++p_.counters[in.signal].per_step;
    for (const Wait& wt : in.wait)
      if (wt.counter != kNone)
        MD_CHECK(wt.target > 0, "plan: internal error: wait on a counter with no producer yet");
    if (p_.stages.empty() || p_.stages.back().op != in.op || p_.stages.back().layer != in.layer)
      p_.stages.push_back(Stage{in.op, in.layer, in.id, in.id});
    p_.instrs.push_back(in);
    p_.stages.back().end = in.id + 1;
  }

  // Per-sequence ops (embed, norms, router, latent row, combine) take ranges of sequences: one
  // sequence per tile at small batch, up to B / (2W) at large batch, so that their instruction
  // count does not grow with B faster than the work warrants.
  std::vector<std::pair<int, int>> seq_ranges() const {
    const int per = std::max(1, B_ / (2 * W_));
    std::vector<std::pair<int, int>> r;
    for (int b = 0; b < B_; b += per) r.emplace_back(b, std::min(B_, b + per));
    return r;
  }
  static void set_seqs(Instr& in, std::pair<int, int> r) {
    in.seq = uint16_t(r.first);
    in.r0 = uint32_t(r.first);
    in.r1 = uint32_t(r.second);
  }

  static Instr make(Op op, int layer, std::initializer_list<Wait> waits, uint32_t signal) {
    Instr in;
    in.op = op;
    in.layer = uint16_t(layer < 0 ? kNoLayer : layer);
    int i = 0;
    for (const Wait& w : waits) in.wait[i++] = w;
    in.signal = signal;
    return in;
  }

  // ---- sizes --------------------------------------------------------------------------------

  size_t elt(const Mat* m, DType dflt = DType::BF16) const {
    return dtype_size(m && m->data ? m->dtype : dflt);
  }
  const LayerWeights* lw(int l) const { return w_ ? &w_->layers[l] : nullptr; }

  // ---- the program --------------------------------------------------------------------------

  // Y[b][r0:r1] = round(W X[b]) row blocks of one matrix; returns nothing, signals `sig`.
  void gemv_tiles(Op op, int layer, const BufferDesc& wbuf, int64_t rows, int64_t cols, size_t e,
                  const BufferDesc& x, const BufferDesc& y, Wait wt, uint32_t sig,
                  int64_t rb_override = 0, uint8_t flags = 0, const BufferDesc* resid = nullptr,
                  const BufferDesc* out = nullptr) {
    const int64_t rb =
        rb_override > 0 ? rb_override : tile_rows(rows, double(cols) * double(e), p_.options, W_);
    auto a = resid ? args({wbuf, x, *resid, *out}) : args({wbuf, x, y});
    for (int64_t r = 0; r < rows; r += rb) {
      Instr in = make(op, layer, {wt}, sig);
      in.flags = flags;
      in.r0 = uint32_t(r);
      in.r1 = uint32_t(std::min(rows, r + rb));
      emit(in, a,
           uint64_t(in.r1 - in.r0) * uint64_t(cols) * e +
               uint64_t(B_) * uint64_t(cols + (in.r1 - in.r0)) * 4);
    }
  }

  void build() {
    const ModelConfig& c = c_;
    const int L = c.num_layers;
    const int64_t D = c.hidden_size;
    p_.router_ids_buffer.assign(size_t(L), kNone);

    // Residual stream and normed input of layer 0.
    BufferDesc x = arena(D), h = arena(D);
    uint32_t ready = counter(Op::kEmbed, -1);  // h (and x) of the current layer input complete
    {
      auto a = args({io(BufKind::kTokens), weight(WeightKind::kEmbed), x,
                     weight(WeightKind::kInputNorm, 0), h});
      for (auto r : seq_ranges()) {
        Instr in = make(Op::kEmbed, -1, {}, ready);
        set_seqs(in, r);
        emit(in, a, uint64_t(r.second - r.first) * uint64_t(D) * 14);
      }
    }

    for (int l = 0; l < L; ++l) {
      BufferDesc att;  // attention output before o_proj, [B][C]
      uint32_t core_done;
      int64_t att_w;
      const Mat* o_mat = nullptr;
      if (c.attn_kind[l] == AttnKind::KDA)
        std::tie(att, core_done, att_w, o_mat) = kda_layer(l, h, ready);
      else
        std::tie(att, core_done, att_w, o_mat) = mla_layer(l, h, ready);

      // o_proj + residual.
      BufferDesc x_mid = arena(D);
      uint32_t attn_done = counter(Op::kAttnOut, l);
      const BufferDesc o_w =
          weight(c.attn_kind[l] == AttnKind::KDA ? WeightKind::kKdaO : WeightKind::kMlaO, l);
      gemv_tiles(Op::kAttnOut, l, o_w, D, att_w, elt(o_mat), att, x_mid, all_of(core_done),
                 attn_done, 0, kFlagResidual, &x, &x_mid);

      // FFN input norm.
      BufferDesc h2 = arena(D);
      uint32_t norm_done = counter(Op::kFfnNorm, l);
      {
        auto a = args({x_mid, weight(WeightKind::kPostAttnNorm, l), h2});
        for (auto r : seq_ranges()) {
          Instr in = make(Op::kFfnNorm, l, {all_of(attn_done)}, norm_done);
          set_seqs(in, r);
          emit(in, a, uint64_t(r.second - r.first) * uint64_t(D) * 12);
        }
      }

      // Next layer's input (or the final norm's output).
      BufferDesc x_next = arena(D), h_next = arena(D);
      const BufferDesc next_norm =
          l + 1 < L ? weight(WeightKind::kInputNorm, l + 1) : weight(WeightKind::kFinalNorm);
      const uint32_t combined = counter(Op::kCombine, l);
      if (c.ffn_kind[l] == FfnKind::Dense)
        dense_ffn(l, x_mid, h2, norm_done, x_next, next_norm, h_next, combined);
      else
        moe_ffn(l, x_mid, h2, norm_done, x_next, next_norm, h_next, combined);
      x = x_next;
      h = h_next;
      ready = combined;
    }

    // lm_head over the final normed hidden states, straight into the caller's logits.
    const Mat* lm = w_ ? &w_->lm_head : nullptr;
    const uint32_t logits_done = counter(Op::kLmHead, -1);
    gemv_tiles(Op::kLmHead, -1, weight(WeightKind::kLmHead), c.vocab_size, D, elt(lm), h,
               io(BufKind::kLogits), all_of(ready), logits_done);

    // Sampling, per sequence range: every vocabulary block of the batch must be in.
    BufferDesc next = arena(1, 4);
    auto a = args({io(BufKind::kLogits), next});
    p_.next_ids_buffer = a.first + 1;
    const uint32_t sampled = counter(Op::kSample, -1);
    for (auto r : seq_ranges()) {
      Instr in = make(Op::kSample, -1, {all_of(logits_done)}, sampled);
      set_seqs(in, r);
      emit(in, a, uint64_t(r.second - r.first) * uint64_t(c.vocab_size) * 4);
    }
  }

  std::tuple<BufferDesc, uint32_t, int64_t, const Mat*> kda_layer(int l, const BufferDesc& h,
                                                                  uint32_t ready) {
    const ModelConfig& c = c_;
    const int H = c.kda_num_heads, K = c.kda_head_dim;
    const int64_t C = c.kda_dim(), D = c.hidden_size;
    const LayerWeights* L = lw(l);
    BufferDesc q = arena(C), k = arena(C), v = arena(C), fa = arena(K), ga = arena(K),
               braw = arena(H), o = arena(C);
    const Wait in_ready = all_of(ready);

    // Low-rank gate inputs and beta (every head needs them): f_a, g_a, b.
    const uint32_t lowrank = counter(Op::kKdaProj, l, uint32_t(H));
    gemv_tiles(Op::kKdaProj, l, weight(WeightKind::kKdaFA, l), K, D, elt(L ? &L->kda.f_a : nullptr),
               h, fa, in_ready, lowrank);
    gemv_tiles(Op::kKdaProj, l, weight(WeightKind::kKdaGA, l), K, D, elt(L ? &L->kda.g_a : nullptr),
               h, ga, in_ready, lowrank);
    gemv_tiles(Op::kKdaProj, l, weight(WeightKind::kKdaB, l), H, D, elt(L ? &L->kda.b : nullptr), h,
               braw, in_ready, lowrank);

    // The cores work on ranges of consecutive heads of one sequence: enough ranges to occupy
    // the workers at small batch, and contiguous, so that two workers rarely write neighbouring
    // heads of one sequence's conv cache and state (which the sequence stores unaligned: false
    // sharing).
    const int ranges = int(std::clamp<int64_t>(ceil_div(2 * int64_t(W_), B_), 1, H));
    const int hpr = int(ceil_div(H, ranges));
    // q, k, v row blocks aligned to heads and nested in the core ranges; one counter per range.
    const size_t e = elt(L ? &L->kda.q : nullptr);
    HeadTiling ht = head_tiling(H, K, double(D) * double(e), p_.options, W_);
    if (ht.group > 1) {
      ht.group = std::min(ht.group, hpr);
      while (hpr % ht.group) --ht.group;
    }
    auto aq = args({weight(WeightKind::kKdaQ, l), h, q});
    auto ak = args({weight(WeightKind::kKdaK, l), h, k});
    auto av = args({weight(WeightKind::kKdaV, l), h, v});
    std::vector<uint32_t> range_ctr;
    for (int r0 = 0; r0 < H; r0 += hpr) {
      const int r1 = std::min(H, r0 + hpr);
      const uint32_t ctr = counter(Op::kKdaProj, l, uint32_t(r0));
      range_ctr.push_back(ctr);
      for (int h0 = r0; h0 < r1; h0 += ht.group) {
        const int h1 = std::min(r1, h0 + ht.group);
        // One tile of whole heads [h0, h1), or one head in `split` parts.
        const int64_t step = ht.split > 1 ? int64_t(K) / ht.split : int64_t(h1 - h0) * K;
        for (auto* a : {&aq, &ak, &av}) {
          for (int64_t r = int64_t(h0) * K; r < int64_t(h1) * K; r += step) {
            Instr in = make(Op::kKdaProj, l, {in_ready}, ctr);
            in.r0 = uint32_t(r);
            in.r1 = uint32_t(r + step);
            emit(in, *a, uint64_t(step) * uint64_t(D) * e + uint64_t(B_) * uint64_t(D + step) * 4);
          }
        }
      }
    }

    // Per head range and sequence: conv + gates + delta rule + gated norm.
    const uint32_t core_done = counter(Op::kKdaCore, l);
    auto a = args({q, k, v, fa, ga, braw, o, weight(WeightKind::kKdaFB, l),
                   weight(WeightKind::kKdaGB, l), weight(WeightKind::kKdaQConv, l),
                   weight(WeightKind::kKdaKConv, l), weight(WeightKind::kKdaVConv, l),
                   weight(WeightKind::kKdaALog, l), weight(WeightKind::kKdaDtBias, l),
                   weight(WeightKind::kKdaONorm, l), state(StateKind::kKdaState, l),
                   state(StateKind::kConvCache, l)});
    const uint64_t head_bytes = 2ull * K * K * 4 + 2ull * K * K * 2 +
                                6ull * K * uint64_t(c.kda_conv_size) * 4 + 8ull * K * 4;
    for (size_t r = 0; r < range_ctr.size(); ++r)
      for (int b = 0; b < B_; ++b) {
        Instr in = make(Op::kKdaCore, l, {all_of(range_ctr[r]), all_of(lowrank)}, core_done);
        in.seq = uint16_t(b);
        in.r0 = uint32_t(int(r) * hpr);
        in.r1 = uint32_t(std::min(H, int(r + 1) * hpr));
        emit(in, a, head_bytes * (in.r1 - in.r0));
      }
    return {o, core_done, C, L ? &L->kda.o : nullptr};
  }

  std::tuple<BufferDesc, uint32_t, int64_t, const Mat*> mla_layer(int l, const BufferDesc& h,
                                                                  uint32_t ready) {
    const ModelConfig& c = c_;
    const int H = c.mla_num_heads, N = c.qk_nope_head_dim, P = c.qk_rope_head_dim, V = c.v_head_dim,
              R = c.kv_lora_rank;
    const int64_t D = c.hidden_size, QW = int64_t(H) * (N + P), CW = R + P;
    const LayerWeights* L = lw(l);
    BufferDesc q = arena(QW), a_out = arena(CW), att = arena(int64_t(H) * V);
    const Wait in_ready = all_of(ready);

    const uint32_t kva_done = counter(Op::kMlaProj, l, 1);
    gemv_tiles(Op::kMlaProj, l, weight(WeightKind::kMlaKvA, l), CW, D,
               elt(L ? &L->mla.kv_a : nullptr), h, a_out, in_ready, kva_done);
    const uint32_t q_done = counter(Op::kMlaProj, l, 0);
    gemv_tiles(Op::kMlaProj, l, weight(WeightKind::kMlaQ, l), QW, D, elt(L ? &L->mla.q : nullptr),
               h, q, in_ready, q_done);

    // Latent cache row per sequence (the executor grows the cache before the step).
    std::vector<uint32_t> latent(static_cast<size_t>(B_));  // counter of b's range
    {
      auto a = args({a_out, weight(WeightKind::kMlaKvANorm, l), state(StateKind::kMlaCache, l)});
      for (auto r : seq_ranges()) {
        const uint32_t ctr = counter(Op::kMlaLatent, l, uint32_t(r.first));
        for (int b = r.first; b < r.second; ++b) latent[size_t(b)] = ctr;
        Instr in = make(Op::kMlaLatent, l, {all_of(kva_done)}, ctr);
        set_seqs(in, r);
        emit(in, a, uint64_t(r.second - r.first) * uint64_t(CW) * 12);
      }
    }

    // Attention by head range per sequence: enough tiles to occupy the workers at small batch,
    // few enough that the latent cache is not re-read more than needed. When the batch's head
    // ranges still cannot occupy the workers (few heads, many workers: a GPU), each range is
    // also split over the cache rows, and a merge per range combines the splits.
    const int tiles = int(std::clamp<int64_t>(ceil_div(2 * int64_t(W_), B_), 1, H));
    const int per = int(ceil_div(H, tiles));
    const int ranges = int(ceil_div(H, per));
    int S = p_.options.mla_kv_splits;
    if (S <= 0) {
      // Automatic: split only when the head ranges would leave most workers idle (at least 4
      // workers per range: wide GPUs). On a few CPU cores the merge costs more than it gains.
      const int64_t units = int64_t(B_) * ranges;
      S = 4 * units <= W_ ? int(std::clamp<int64_t>(ceil_div(W_, units), 1, 16)) : 1;
    }
    const size_t e = elt(L ? &L->mla.kv_b : nullptr);
    if (S == 1) {
      const uint32_t core_done = counter(Op::kMlaCore, l);
      auto a = args({q, weight(WeightKind::kMlaKvB, l), state(StateKind::kMlaCache, l), att});
      for (int b = 0; b < B_; ++b)
        for (int h0 = 0; h0 < H; h0 += per) {
          Instr in = make(Op::kMlaCore, l, {all_of(q_done), all_of(latent[size_t(b)])}, core_done);
          in.seq = uint16_t(b);
          in.r0 = uint32_t(h0);
          in.r1 = uint32_t(std::min(H, h0 + per));
          emit(in, a, uint64_t(in.r1 - in.r0) * uint64_t(N + V) * uint64_t(R) * e);
        }
      return {att, core_done, int64_t(H) * V, L ? &L->mla.o : nullptr};
    }
    // Partials [S][H][R + 2] per sequence: split i of head h at (i * H + h) * (R + 2).
    BufferDesc parts = arena(int64_t(S) * H * (R + 2));
    auto a = args({q, weight(WeightKind::kMlaKvB, l), state(StateKind::kMlaCache, l), parts});
    std::vector<uint32_t> range_ctr;
    for (int b = 0; b < B_; ++b)
      for (int h0 = 0; h0 < H; h0 += per) {
        const uint32_t ctr = counter(Op::kMlaCore, l, uint32_t(b * ranges + h0 / per));
        range_ctr.push_back(ctr);
        for (int i = 0; i < S; ++i) {
          Instr in = make(Op::kMlaCore, l, {all_of(q_done), all_of(latent[size_t(b)])}, ctr);
          in.seq = uint16_t(b);
          in.slot = uint16_t(i);
          in.splits = uint32_t(S);
          in.r0 = uint32_t(h0);
          in.r1 = uint32_t(std::min(H, h0 + per));
          // The absorbed query is recomputed by every split (N x R per head); the cache rows
          // are the split's share (counted in the step's bytes, not here: unknown at compile).
          emit(in, a, uint64_t(in.r1 - in.r0) * uint64_t(N) * uint64_t(R) * e);
        }
      }
    const uint32_t merge_done = counter(Op::kMlaMerge, l);
    auto am = args({parts, weight(WeightKind::kMlaKvB, l), att});
    size_t r = 0;
    for (int b = 0; b < B_; ++b)
      for (int h0 = 0; h0 < H; h0 += per) {
        Instr in = make(Op::kMlaMerge, l, {all_of(range_ctr[r++])}, merge_done);
        in.seq = uint16_t(b);
        in.splits = uint32_t(S);
        in.r0 = uint32_t(h0);
        in.r1 = uint32_t(std::min(H, h0 + per));
        emit(in, am,
             uint64_t(in.r1 - in.r0) * (uint64_t(V) * uint64_t(R) * e +
                                        uint64_t(S) * uint64_t(R + 2) * 4));
      }
    return {att, merge_done, int64_t(H) * V, L ? &L->mla.o : nullptr};
  }

  void dense_ffn(int l, const BufferDesc& x_mid, const BufferDesc& h2, uint32_t norm_done,
                 const BufferDesc& x_next, const BufferDesc& next_norm, const BufferDesc& h_next,
                 uint32_t combined) {
    const int64_t D = c_.hidden_size, I = c_.intermediate_size;
    const LayerWeights* L = lw(l);
    BufferDesc act = arena(I), out = arena(D);
    const uint32_t gu = counter(Op::kDenseGateUp, l), dn = counter(Op::kDenseDown, l);
    gate_up_tiles(Op::kDenseGateUp, l, weight(WeightKind::kDenseGate, l),
                  weight(WeightKind::kDenseUp, l), I, elt(L ? &L->dense.gate : nullptr), h2, act,
                  all_of(norm_done), gu);
    gemv_tiles(Op::kDenseDown, l, weight(WeightKind::kDenseDown, l), D, I,
               elt(L ? &L->dense.down : nullptr), act, out, all_of(gu), dn);
    auto a = args({x_mid, out, x_next, next_norm, h_next});
    for (auto r : seq_ranges()) {
      Instr in = make(Op::kCombine, l, {all_of(dn)}, combined);
      set_seqs(in, r);
      emit(in, a, uint64_t(r.second - r.first) * uint64_t(D) * 20);
    }
  }

  void gate_up_tiles(Op op, int l, const BufferDesc& g, const BufferDesc& u, int64_t I, size_t e,
                     const BufferDesc& x, const BufferDesc& act, Wait wt, uint32_t sig) {
    const int64_t D = c_.hidden_size;
    const int64_t rb = tile_rows(I, 2.0 * double(D) * double(e), p_.options, W_);
    auto a = args({g, u, x, act});
    for (int64_t r = 0; r < I; r += rb) {
      Instr in = make(op, l, {wt}, sig);
      in.r0 = uint32_t(r);
      in.r1 = uint32_t(std::min(I, r + rb));
      emit(in, a, 2ull * (in.r1 - in.r0) * uint64_t(D) * e + uint64_t(B_) * uint64_t(D) * 4);
    }
  }

  void moe_ffn(int l, const BufferDesc& x_mid, const BufferDesc& h2, uint32_t norm_done,
               const BufferDesc& x_next, const BufferDesc& next_norm, const BufferDesc& h_next,
               uint32_t combined) {
    const ModelConfig& c = c_;
    const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
    const int E = c.num_experts, k = c.num_experts_per_token;
    const LayerWeights* L = lw(l);
    const bool shared = c.num_shared_experts > 0;
    const int64_t IS = I * c.num_shared_experts;
    BufferDesc ids = arena(k, 4), wts = arena(k), act = arena(int64_t(k) * I),
               dn = arena(int64_t(k) * D);
    BufferDesc sact = shared ? arena(IS) : null(), sout = shared ? arena(D) : null();

    // Router, per sequence.
    const uint32_t routed = counter(Op::kRouter, l);
    {
      const size_t re = elt(L ? &L->moe.router : nullptr, DType::F32);
      auto a =
          args({h2, weight(WeightKind::kRouter, l), weight(WeightKind::kRouterBias, l), ids, wts});
      p_.router_ids_buffer[size_t(l)] = a.first + 3;
      for (auto r : seq_ranges()) {
        Instr in = make(Op::kRouter, l, {all_of(norm_done)}, routed);
        set_seqs(in, r);
        emit(in, a,
             uint64_t(E) * uint64_t(D) * re + uint64_t(r.second - r.first - 1) * uint64_t(E) * 64);
      }
    }

    // Shared expert gate/up: needs only the normed input, so it overlaps the routing.
    uint32_t sgu = kNone, sdn = kNone;
    const size_t se = elt(L && shared ? &L->moe.shared.gate : nullptr);
    if (shared) {
      sgu = counter(Op::kSharedGateUp, l);
      gate_up_tiles(Op::kSharedGateUp, l, weight(WeightKind::kSharedGate, l),
                    weight(WeightKind::kSharedUp, l), IS, se, h2, sact, all_of(norm_done), sgu);
    }

    // Routed experts by slot: slot u runs the u-th distinct expert the batch selected (in
    // ascending id) for every sequence that selected it, so each selected expert is read once
    // per step. Slots beyond the number of distinct experts are empty at run time.
    const int U = std::min(B_ * k, E);
    const size_t ee = elt(L ? &L->moe.experts[0].gate : nullptr);
    const int64_t rb_gu = tile_rows(I, 2.0 * double(D) * double(ee), p_.options, W_, U);
    const int64_t rb_dn = tile_rows(D, double(I) * double(ee), p_.options, W_, U);
    std::vector<uint32_t> slot_gu(static_cast<size_t>(U));
    {
      auto a = args({ids, h2, expert_weights(WeightKind::kExpertGate, l),
                     expert_weights(WeightKind::kExpertUp, l), act});
      for (int u = 0; u < U; ++u) {
        slot_gu[size_t(u)] = counter(Op::kExpertGateUp, l, uint32_t(u));
        for (int64_t r = 0; r < I; r += rb_gu) {
          Instr in = make(Op::kExpertGateUp, l, {all_of(routed)}, slot_gu[size_t(u)]);
          in.slot = uint16_t(u);
          in.r0 = uint32_t(r);
          in.r1 = uint32_t(std::min(I, r + rb_gu));
          emit(in, a, 2ull * (in.r1 - in.r0) * uint64_t(D) * ee);
        }
      }
    }
    if (shared) {
      sdn = counter(Op::kSharedDown, l);
      gemv_tiles(Op::kSharedDown, l, weight(WeightKind::kSharedDown, l), D, IS, se, sact, sout,
                 all_of(sgu), sdn);
    }
    const uint32_t expert_done = counter(Op::kExpertDown, l);
    {
      auto a = args({ids, act, expert_weights(WeightKind::kExpertDown, l), dn});
      for (int u = 0; u < U; ++u)
        for (int64_t r = 0; r < D; r += rb_dn) {
          Instr in = make(Op::kExpertDown, l, {all_of(slot_gu[size_t(u)])}, expert_done);
          in.slot = uint16_t(u);
          in.r0 = uint32_t(r);
          in.r1 = uint32_t(std::min(D, r + rb_dn));
          emit(in, a, uint64_t(in.r1 - in.r0) * uint64_t(I) * ee);
        }
    }

    // Weighted sum in ascending expert id, shared expert, residual, next norm.
    auto a = args({x_mid, wts, dn, sout, x_next, next_norm, h_next});
    for (auto r : seq_ranges()) {
      Instr in =
          make(Op::kCombine, l, {all_of(expert_done), shared ? all_of(sdn) : Wait{}}, combined);
      set_seqs(in, r);
      in.flags = uint8_t(kFlagMoeCombine | (shared ? kFlagSharedExpert : 0));
      emit(in, a, uint64_t(r.second - r.first) * uint64_t(k + 4) * uint64_t(D) * 4);
    }
  }

 private:
  Plan& p_;
  const ModelConfig& c_;
  const ModelWeights* w_;
  int B_, W_;
  std::map<std::tuple<int, int, int>, uint32_t> wid_;
};

// ---- scheduling -----------------------------------------------------------------------------

}  // namespace

// The cost model of both schedulers, in bytes-equivalent: bytes moved, scaled for tiles whose
// arithmetic outweighs their bytes (the delta rule and gates of a KDA head run at about a third
// of the GEMV byte rate, the MLA cores at about half; measured on the reference machine), plus a
// fixed overhead per instruction.
double tile_cost(const Instr& in, const PlanOptions& o) {
  double f = 1.0;
  if (in.op == Op::kKdaCore) f = 3.0;
  if (in.op == Op::kMlaCore || in.op == Op::kMlaMerge) f = 2.0;
  return double(in.est_bytes) * f + double(o.instr_overhead_bytes);
}

namespace {

// List scheduling in the global order: each instruction goes to the worker on which it would
// start earliest under the cost model (estimated bytes + a fixed overhead per instruction, all
// workers equal), its ready time being the latest simulated finish among the producers it waits
// for, plus a synchronisation cost when a producer ran on another worker (the counter and the
// data cross cores). Ties go to the less loaded worker. Queues are therefore subsequences of the
// global order (see the deadlock argument in executor.cpp).
void schedule_megakernel(Plan& p) {
  const int W = p.workers;
  const double sync = double(p.options.sync_cost_bytes);
  std::vector<double> free_at(static_cast<size_t>(W), 0.0), load(static_cast<size_t>(W), 0.0);
  std::vector<double> done_at(p.counters.size(), 0.0);
  std::vector<int> owner(p.counters.size(), -1);  // the one worker signalling it, or -2: several
  p.queue_ids.assign(size_t(W), {});
  for (const Instr& in : p.instrs) {
    int best = 0;
    double best_start = 0;
    for (int w = 0; w < W; ++w) {
      double ready = 0;
      for (const Wait& wt : in.wait)
        if (wt.counter != kNone)
          ready = std::max(ready, done_at[wt.counter] + (owner[wt.counter] == w ? 0.0 : sync));
      const double start = std::max(free_at[size_t(w)], ready);
      if (w == 0 || start < best_start ||
          (start == best_start && load[size_t(w)] < load[size_t(best)])) {
        best = w;
        best_start = start;
      }
    }
    const double cost = tile_cost(in, p.options);
    free_at[size_t(best)] = best_start + cost;
    load[size_t(best)] += cost;
    if (in.signal != kNone) {
      done_at[in.signal] = std::max(done_at[in.signal], free_at[size_t(best)]);
      int& o = owner[in.signal];
      o = o == -1 || o == best ? best : -2;
    }
    p.queue_ids[size_t(best)].push_back(in.id);
  }
  p.queues.assign(size_t(W), {});
  for (int w = 0; w < W; ++w)
    for (uint32_t id : p.queue_ids[size_t(w)]) p.queues[size_t(w)].push_back(p.instrs[id]);
}

// Barrier phases for the op-by-op executor: consecutive stages are merged while none of them
// waits on a counter signalled in the phase (independent ops share one barrier, as a good
// launch-per-op baseline fuses them). Within a phase, instructions go to workers by longest
// processing time first, then each share is put back in global order.
void schedule_opbyop(Plan& p) {
  const int W = p.workers;
  std::vector<char> in_phase(p.counters.size(), 0);
  std::vector<uint32_t> touched;
  size_t first = 0;
  auto close_phase = [&](size_t end) {
    p.phases.emplace_back(uint32_t(first), uint32_t(end));
    std::vector<uint32_t> ids;
    for (size_t s = first; s < end; ++s)
      for (uint32_t i = p.stages[s].begin; i < p.stages[s].end; ++i) ids.push_back(i);
    std::stable_sort(ids.begin(), ids.end(), [&](uint32_t a, uint32_t b) {
      return tile_cost(p.instrs[a], p.options) > tile_cost(p.instrs[b], p.options);
    });
    std::vector<double> load(size_t(W), 0.0);
    std::vector<std::vector<uint32_t>> share(static_cast<size_t>(W));
    for (uint32_t i : ids) {
      const size_t w = size_t(std::min_element(load.begin(), load.end()) - load.begin());
      load[w] += tile_cost(p.instrs[i], p.options);
      share[w].push_back(i);
    }
    for (auto& s : share) std::sort(s.begin(), s.end());
    p.phase_instrs.push_back(std::move(share));
    for (uint32_t c : touched) in_phase[c] = 0;
    touched.clear();
    first = end;
  };
  for (size_t s = 0; s < p.stages.size(); ++s) {
    bool depends = false;
    for (uint32_t i = p.stages[s].begin; i < p.stages[s].end && !depends; ++i)
      for (const Wait& w : p.instrs[i].wait)
        if (w.counter != kNone && in_phase[w.counter]) depends = true;
    if (depends) close_phase(s);
    for (uint32_t i = p.stages[s].begin; i < p.stages[s].end; ++i) {
      const uint32_t c = p.instrs[i].signal;
      if (c != kNone && !in_phase[c]) {
        in_phase[c] = 1;
        touched.push_back(c);
      }
    }
  }
  if (first < p.stages.size()) close_phase(p.stages.size());
}

}  // namespace

Plan compile_decode_plan(const ModelConfig& cfg, const ModelWeights* w, const PlanOptions& opt) {
  MD_CHECK(opt.batch >= 1 && opt.batch <= 1024, "plan: batch {} is outside 1..1024", opt.batch);
  MD_CHECK(opt.workers >= 1 && opt.workers <= 4096, "plan: workers {} is outside 1..4096",
           opt.workers);
  MD_CHECK(cfg.num_layers >= 1 && cfg.num_layers < int(kNoLayer), "plan: bad layer count {}",
           cfg.num_layers);
  MD_CHECK(opt.tile_bytes >= 1024 && opt.min_tile_bytes <= opt.tile_bytes,
           "plan: tile_bytes {} / min_tile_bytes {} out of range", opt.tile_bytes,
           opt.min_tile_bytes);
  MD_CHECK(opt.mla_kv_splits >= 0 && opt.mla_kv_splits <= 256,
           "plan: mla_kv_splits {} is outside 0..256", opt.mla_kv_splits);
  MD_CHECK(!cfg.has_k3_extensions(),
           "plan: the decode plan does not yet cover Kimi K3's ops (model_type '{}'); use the "
           "reference path (--executor reference)",
           cfg.model_type);
  Plan p;
  p.batch = opt.batch;
  p.workers = opt.workers;
  p.cfg = cfg;
  p.options = opt;
  Builder(p, cfg, w).build();
  MD_CHECK(p.buffers.size() < kNone && p.instrs.size() < kNone, "plan: too many instructions");
  schedule_opbyop(p);
  if (opt.scheduler == Scheduler::kList) {
    schedule_megakernel(p);
  } else {
    // The op-by-op phase shares, concatenated: each queue is increasing in the global order,
    // and every wait is implied by a barrier op by op, so the megakernel only ever waits less.
    p.queue_ids.assign(size_t(p.workers), {});
    for (const auto& shares : p.phase_instrs)
      for (int w = 0; w < p.workers; ++w)
        p.queue_ids[size_t(w)].insert(p.queue_ids[size_t(w)].end(), shares[size_t(w)].begin(),
                                      shares[size_t(w)].end());
    p.queues.assign(size_t(p.workers), {});
    for (int w = 0; w < p.workers; ++w)
      for (uint32_t id : p.queue_ids[size_t(w)]) p.queues[size_t(w)].push_back(p.instrs[id]);
  }
  return p;
}

}  // namespace md::plan
