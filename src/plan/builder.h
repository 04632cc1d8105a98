// Internal to plan/: the decode-plan builder shared by the compiler's parts (plan.cpp: tables,
// the layer loop, the residual stream and scheduling; plan_attention.cpp: KDA and MLA;
// plan_ffn.cpp: dense MLP and MoE, Kimi Linear's and K3's latent MoE).
#pragma once
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "megadecode/base/dtype.h"
#include "megadecode/base/error.h"
#include "megadecode/dist/shard.h"
#include "megadecode/model/weights.h"
#include "megadecode/plan/ops.h"
#include "megadecode/plan/plan.h"

namespace md::plan::detail {

constexpr uint64_t kAlign = 64;

inline uint64_t align_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}
inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Rows per tile for a matrix of `rows` x `row_bytes`: about `target` bytes, but at least
// `min_bytes` (smaller tiles cost more in synchronisation than they gain in balance), small enough
// that the matrix gives at least `workers` tiles (counting `copies` independent instances of it
// that run in parallel, e.g. the expert slots of a layer), a multiple of 16 rows, and evened out
// so that the tiles of a matrix have about the same size.
inline int64_t tile_rows(int64_t rows, double row_bytes, const PlanOptions& o, int workers,
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
inline HeadTiling head_tiling(int heads, int per_head, double row_bytes, const PlanOptions& o,
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
      : p_(p), c_(c), w_(w), B_(p.batch), R_(p.rows), N_(p.batch * p.rows), W_(p.workers) {}

  // ---- tables -------------------------------------------------------------------------------

  // An activation buffer of `elems_per_row` elements for each of the step's N token rows.
  BufferDesc arena(int64_t elems_per_row, size_t elt = 4) {
    BufferDesc d;
    d.kind = BufKind::kArena;
    d.count = uint32_t(elems_per_row);
    d.stride = align_up(uint64_t(elems_per_row) * elt, kAlign);
    d.offset = p_.arena_bytes;
    p_.arena_bytes += align_up(d.stride * uint64_t(N_), kAlign);
    return d;
  }
  // The same for `rows` rows (a draft plan's context rows, or one row per sequence).
  BufferDesc arena_rows(int64_t elems_per_row, int64_t rows, size_t elt = 4) {
    BufferDesc d;
    d.kind = BufKind::kArena;
    d.count = uint32_t(elems_per_row);
    d.stride = align_up(uint64_t(elems_per_row) * elt, kAlign);
    d.offset = p_.arena_bytes;
    p_.arena_bytes += align_up(d.stride * uint64_t(std::max<int64_t>(rows, 1)), kAlign);
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

  std::pair<uint32_t, uint32_t> args(const std::vector<BufferDesc>& list) {
    const uint32_t first = uint32_t(p_.buffers.size());
    p_.buffers.insert(p_.buffers.end(), list.begin(), list.end());
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
    check_operands(in);
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

  // The operand list against the op table (plan/ops.h): a builder rule that disagrees with the
  // table is a bug, reported when the plan is compiled.
  void check_operands(const Instr& in) const {
    const OpDesc& d = op_desc(in.op);
    const size_t n = d.operands.size();
    const bool mix = d.mix_tail && (in.flags & kFlagAttnRes);
    MD_CHECK(mix ? in.nargs >= n + 2 : in.nargs == n,
             "plan: internal error: {} has {} operands, the op table says {}{}", d.name, in.nargs,
             n, mix ? " + a mix" : "");
    MD_CHECK((in.flags & ~(d.flags | kFlagTestStall)) == 0,
             "plan: internal error: {} carries flags {:#x} outside its own", d.name, in.flags);
  }

  // Per-row ops (embed, norms, router, latent rows, combine, sampling) take ranges of token
  // rows: one row per tile when there are few, up to N / (2W) when there are many, so that their
  // instruction count does not grow with N faster than the work warrants.
  std::vector<std::pair<int, int>> row_ranges() const {
    const int per = std::max(1, N_ / (2 * W_));
    std::vector<std::pair<int, int>> r;
    for (int t = 0; t < N_; t += per) r.emplace_back(t, std::min(N_, t + per));
    return r;
  }
  // Row ranges made of whole sequences (ops whose consumers wait per sequence).
  std::vector<std::pair<int, int>> seq_row_ranges() const {
    const int per = std::max(1, B_ / (2 * W_));
    std::vector<std::pair<int, int>> r;
    for (int b = 0; b < B_; b += per) r.emplace_back(b * R_, std::min(B_, b + per) * R_);
    return r;
  }
  void set_rows(Instr& in, std::pair<int, int> r) const {
    in.seq = uint16_t(r.first / R_);  // the first row's sequence (informational)
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

  // Bytes per weight of a matrix as stored: its codes and scales (MXFP4 4.25 bits, int4 with
  // group g 4 + 16/g bits), so tiles and the step's byte counts follow the real traffic.
  static double elt(const Mat* m, DType dflt = DType::BF16) {
    if (m && m->data && m->rows > 0 && m->cols > 0)
      return double(m->bytes()) / (double(m->rows) * double(m->cols));
    return double(dtype_size(m && m->data ? m->dtype : dflt));
  }
  // The same for a routed expert matrix, whose default (no weights: a plan for a config alone)
  // follows the config's expert format.
  double expert_elt(const Mat* m) const {
    if (m && m->data) return elt(m);
    return c_.experts_mxfp4 ? 17.0 / 32.0 : 2.0;
  }
  const LayerWeights* lw(int l) const { return w_ ? &w_->layers[l] : nullptr; }

  // ---- the program --------------------------------------------------------------------------

  // Y[b][r0:r1] = round(W X[b]) row blocks of one matrix; returns nothing, signals `sig`.
  void gemv_tiles(Op op, int layer, const BufferDesc& wbuf, int64_t rows, int64_t cols, double e,
                  const BufferDesc& x, const BufferDesc& y, Wait wt, uint32_t sig,
                  int64_t rb_override = 0, uint32_t flags = 0, const BufferDesc* resid = nullptr,
                  const BufferDesc* out = nullptr) {
    gemv_block(op, layer, wbuf, {0, rows}, cols, e, x, y, wt, sig, rb_override, flags, resid, out);
  }
  // The same over rows [block.first, block.second) of the matrix only (a distributed rank's
  // block of a matrix split by rows, gathered afterwards); no tiles for an empty block.
  void gemv_block(Op op, int layer, const BufferDesc& wbuf, std::pair<int64_t, int64_t> block,
                  int64_t cols, double e, const BufferDesc& x, const BufferDesc& y, Wait wt,
                  uint32_t sig, int64_t rb_override = 0, uint32_t flags = 0,
                  const BufferDesc* resid = nullptr, const BufferDesc* out = nullptr) {
    const auto [r_begin, r_end] = block;
    const int64_t rb = rb_override > 0 ? rb_override
                                       : tile_rows(std::max<int64_t>(r_end - r_begin, 1),
                                                   double(cols) * double(e), p_.options, W_);
    // kAttnOut: [w, x, resid (or absent), out]; the other row-block ops: [w, x, y].
    auto a = op == Op::kAttnOut ? args({wbuf, x, resid ? *resid : null(), resid ? *out : y})
                                : args({wbuf, x, y});
    for (int64_t r = r_begin; r < r_end; r += rb) {
      Instr in = make(op, layer, {wt}, sig);
      in.flags = flags;
      in.r0 = uint32_t(r);
      in.r1 = uint32_t(std::min(r_end, r + rb));
      emit(in, a,
           uint64_t(double(in.r1 - in.r0) * double(cols) * e) +
               uint64_t(N_) * uint64_t(cols + (in.r1 - in.r0)) * 4);
    }
  }

  // Per-row tiles (row_ranges) of one op over the operand list `a`, each of `bytes_per_row`.
  void row_tiles(Op op, int layer, std::pair<uint32_t, uint32_t> a, std::initializer_list<Wait> w,
                 uint32_t sig, uint64_t bytes_per_row, uint32_t flags = 0) {
    for (auto r : row_ranges()) {
      Instr in = make(op, layer, w, sig);
      set_rows(in, r);
      in.flags = flags;
      emit(in, a, uint64_t(r.second - r.first) * bytes_per_row);
    }
  }
  // The embedding of every token row into x and layer 0's normed input h; returns the counter
  // its tiles signal.
  uint32_t embed_tiles(const BufferDesc& x, const BufferDesc& h) {
    const uint32_t ready = counter(Op::kEmbed, -1);
    row_tiles(Op::kEmbed, -1,
              args({io(BufKind::kTokens), weight(WeightKind::kEmbed), x,
                    weight(WeightKind::kInputNorm, 0), h}),
              {}, ready, uint64_t(c_.hidden_size) * 14);
    return ready;
  }

  // ---- collectives (a distributed rank's plan) ------------------------------------------------

  bool distributed() const { return p_.options.world > 1; }
  // The all-reduce of x (and x2) over the step's token rows, after the partial-sum tiles the
  // waits name: one instruction (docs/distributed.md "Collectives"); returns its counter. With
  // resid: x = round(resid + round(sum)) (o_proj's residual add).
  uint32_t all_reduce(int layer, const BufferDesc& x, const BufferDesc& x2, const BufferDesc* resid,
                      std::initializer_list<Wait> waits) {
    const uint32_t done = counter(Op::kAllReduce, layer);
    Instr in = make(Op::kAllReduce, layer, waits, done);
    in.r0 = 0;
    in.r1 = uint32_t(N_);
    in.flags = resid ? kFlagResidual : 0;
    const uint64_t width = uint64_t(x.count) + (x2.kind == BufKind::kNull ? 0 : x2.count);
    emit(in, args({x, x2, resid ? *resid : null()}),
         uint64_t(N_) * width * 4 * uint64_t(p_.options.world));
    return done;
  }

  // The all-gather of x's columns over the step's token rows: each rank computed its block
  // (dist::vocab_block of x's width) in the tiles the waits name, and afterwards every rank holds
  // every block. Exact (no arithmetic). Returns its counter.
  uint32_t all_gather(int layer, const BufferDesc& x, std::initializer_list<Wait> waits) {
    const uint32_t done = counter(Op::kAllGather, layer);
    Instr in = make(Op::kAllGather, layer, waits, done);
    in.r0 = 0;
    in.r1 = uint32_t(N_);
    emit(in, args({x}), uint64_t(N_) * uint64_t(x.count) * 4);
    return done;
  }
  // This rank's block of n rows or columns split over the ranks (dist::vocab_block).
  std::pair<int64_t, int64_t> rank_block(int64_t n) const {
    return dist::vocab_block(n, p_.options.world, p_.options.rank);
  }

  // ---- the program (plan.cpp) ---------------------------------------------------------------

  void build();
  // The speculative draft's step (plan_draft.cpp; p.draft is set, c_ is draft_model_config).
  void build_draft();

  // ---- attention (plan_attention.cpp) -------------------------------------------------------
  // Each returns the attention output before o_proj [B][width], the counter its producers
  // signal, its width and o_proj's matrix (for sizes; null without weights).
  std::tuple<BufferDesc, uint32_t, int64_t, const Mat*> kda_layer(int l, const BufferDesc& h,
                                                                  uint32_t ready);
  std::tuple<BufferDesc, uint32_t, int64_t, const Mat*> mla_layer(int l, const BufferDesc& h,
                                                                  uint32_t ready);

  // ---- FFN (plan_ffn.cpp) -------------------------------------------------------------------
  // The FFN of layer l reads h2 (ready at norm_done) and ends in the combine tiles: x_next =
  // x_mid + FFN output, h_next = next_norm(x_next, or K3's residual mix with `next_res`).
  struct FfnIo {
    BufferDesc x_mid, h2;
    uint32_t norm_done;
    BufferDesc x_next, next_norm, h_next;
    BufferDesc next_res;  // K3: the next mix's score weights (kNull: plain residual stream)
    uint32_t combined;
  };
  void dense_ffn(int l, const FfnIo& io);
  // Layer l's FFN outputs: the residual stream and normed input of the next layer (the final
  // norm after the last), and the combine counter (next_res is the caller's).
  FfnIo ffn_io(int l, const BufferDesc& x_mid, const BufferDesc& h2, uint32_t norm_done) {
    FfnIo io;
    io.x_mid = x_mid;
    io.h2 = h2;
    io.norm_done = norm_done;
    io.x_next = arena(c_.hidden_size);
    io.h_next = arena(c_.hidden_size);
    io.next_norm = l + 1 < c_.num_layers ? weight(WeightKind::kInputNorm, l + 1)
                                         : weight(WeightKind::kFinalNorm);
    io.combined = counter(Op::kCombine, l);
    return io;
  }
  void moe_ffn(int l, const FfnIo& io);
  void gate_up_tiles(Op op, int l, const BufferDesc& g, const BufferDesc& u, int64_t I, double e,
                     const BufferDesc& x, const BufferDesc& act, Wait wt, uint32_t sig);
  // The per-sequence combine tiles: `base` operands (ending in x_next, next_norm, h_next), then
  // K3's mix operands.
  void combine_tiles(int l, const FfnIo& io, std::vector<BufferDesc> base, uint32_t flags,
                     std::initializer_list<Wait> waits);

  // K3's block attention residuals: the mix operands [score weights, block summaries...,
  // partial sum] appended to a per-sequence op's operands (empty without res weights).
  void append_mix(std::vector<BufferDesc>& a, const BufferDesc& res_w,
                  const BufferDesc& partial) const {
    if (res_w.kind == BufKind::kNull) return;
    MD_CHECK(int(blocks_.size()) + 1 <= kMaxResSources,
             "plan: {} block attention residual sources exceed the limit {}", blocks_.size() + 1,
             kMaxResSources);
    a.push_back(res_w);
    a.insert(a.end(), blocks_.begin(), blocks_.end());
    a.push_back(partial);
  }

 private:
  Plan& p_;
  const ModelConfig& c_;
  const ModelWeights* w_;
  int B_, R_, N_, W_;  // sequences, token rows per sequence, token rows, workers
  std::map<std::tuple<int, int, int>, uint32_t> wid_;
  // K3: the completed block summaries of the residual stream (the embedding first): arena
  // buffers written earlier in the step, read by every later mix.
  std::vector<BufferDesc> blocks_;
};

}  // namespace md::plan::detail
