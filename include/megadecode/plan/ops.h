// The op table: every op of the decode plan described once (docs/architecture.md "Ops").
//
// For each op: its name, the meaning of an instruction's r0/r1, the named operand slots (what
// the builder puts at each position of the instruction's operand list, what every backend's tile
// reads there, what validate_plan checks and what `megadecode plan --dump` prints), the
// scheduler's cost factor, and which operands the weight prefetcher streams. Adding an op touches
// this table, the builder rule that emits it, and one tile per backend.
#pragma once
#include <cstdint>
#include <span>
#include <string_view>

#include "megadecode/plan/plan.h"

namespace md::plan {

// Named operand slots per op family: position i of an instruction's operand list.
namespace arg {
// Y[t][r0:r1] = round(W X[t]): kKdaProj, kMlaProj, kDenseDown, kSharedDown, kLatentDown,
// kLatentUp, kLmHead (y: the logits); a draft plan's kDraftCtxProj (t: context rows),
// kDraftProj.
struct Gemv {
  enum : uint8_t { w, x, y, count };
};
struct Embed {
  enum : uint8_t { tokens, embed, x0, norm, h0, count };
};
struct KdaCore {
  enum : uint8_t {
    q,
    k,
    v,
    fa,
    ga,
    braw,
    o,
    f_b,
    g_b,
    q_conv,
    k_conv,
    v_conv,
    a_log,
    dt_bias,
    o_norm,
    kda_state,
    conv_cache,
    count
  };
};
struct MlaQUp {
  enum : uint8_t { q_b, qa, q_a_norm, q, count };
};
struct MlaLatent {
  enum : uint8_t { a, kv_a_norm, mla_cache, count };
};
// out: the attention output [H*V] (unsplit) or the split partials.
struct MlaCore {
  enum : uint8_t { q, kv_b, mla_cache, out, gate, count };
};
struct MlaMerge {
  enum : uint8_t { parts, kv_b, att, gate, count };
};
// out = round(resid + round(W x)), or round(W x) without resid (K3: a new block's partial sum).
struct AttnOut {
  enum : uint8_t { w, x, resid, out, count };
};
struct FfnNorm {
  enum : uint8_t { x, norm, h, count };  // then K3's mix tail
};
// kRouterLogits is a GEMV ([w, x, y]); kRouter reads its logits.
struct Router {
  enum : uint8_t { logits, bias, ids, wts, count };
};
struct GateUp {  // kDenseGateUp, kSharedGateUp
  enum : uint8_t { gate, up, x, act, count };
};
struct ExpertGateUp {
  enum : uint8_t { ids, x, gate, up, act, count };
};
struct ExpertDown {
  enum : uint8_t { ids, act, down, out, count };
};
struct LatentNorm {
  enum : uint8_t { wts, dn, norm, r, count };
};
// out: the routed experts' outputs [k][D] (kFlagMoeCombine without kFlagLatentMoe: weighted by
// wts), or one [D] vector (the dense MLP's output, or K3's latent up-projection).
struct Combine {
  enum : uint8_t { x_mid, wts, out, shared, x_next, norm, h_next, count };  // then the mix tail
};
struct Sample {
  enum : uint8_t { logits, next, count };
};
// The draft plan's (Plan::draft). ctx_pos: int32 per context row (-1: no row).
struct DraftCtxWrite {
  enum : uint8_t { k, v, k_norm, ctx_pos, ring, count };
};
struct DraftAttn {
  enum : uint8_t { q, k, v, q_norm, k_norm, att, ring, count };
};
// Slot `slot` (= k) of every sequence over vocabulary rows [r0, r1); `seq` is the tile's index
// among the slot's tiles (its column of `best`). prev: the anchor (tokens) for k = 0, else the
// pick of slot k - 1 (drafts). best: per sequence (value, id as int32 bits) per tile.
struct DraftMarkov {
  enum : uint8_t { base, w1, w2, tokens, drafts, biased, best, count };
};
struct DraftPick {
  enum : uint8_t { best, drafts, count };
};
// A distributed rank's collectives: x (and x2) summed over the ranks; resid with kFlagResidual.
struct AllReduce {
  enum : uint8_t { x, x2, resid, count };
};
struct LogitsGather {
  enum : uint8_t { logits, count };
};
// Columns [c0, c1) of x (dist::vocab_block of its width, this rank's) to every rank.
struct AllGather {
  enum : uint8_t { x, count };
};
// K3's block attention residual mix, appended to kFfnNorm / kCombine (kFlagAttnRes): the score
// weights, then the sources (block summaries, then the partial sum).
struct MixTail {
  enum : uint8_t { res_w, first_source };
};
}  // namespace arg

// What may stand in an operand slot.
enum class Slot : uint8_t {
  kAct,        // an arena buffer (BufKind::kArena)
  kActOpt,     // an arena buffer or absent (kNull)
  kWeight,     // one weight-table entry
  kWeightOpt,  // one weight-table entry or absent
  kWeightSet,  // num_experts consecutive entries (one per expert)
  kKdaState,   // BufKind::kState, StateKind::kKdaState
  kConvCache,  // BufKind::kState, StateKind::kConvCache
  kMlaCache,   // BufKind::kState, StateKind::kMlaCache
  kDraftRing,  // BufKind::kState, StateKind::kDraftRing
  kTokens,
  kLogits,
  kActOrLogits,  // Gemv's y: an arena buffer, or the logits (kLmHead)
};

struct OperandDesc {
  std::string_view name;
  Slot slot;
};

// How the prefetcher finds a tile's weight rows (exec/cpu Prefetcher; a device's loader too).
enum class Stream : uint8_t {
  kNone,       // small tiles: nothing streamed
  kRows,       // rows [r0, r1) of the `stream` operands
  kKdaHeads,   // heads [r0, r1) of f_b / g_b (K rows each) and the sequence's state
  kMlaHeads,   // heads [r0, r1) of kv_b (N + V rows each)
  kMlaValues,  // the W_UV rows of heads [r0, r1) of kv_b
  kExpert,     // rows [r0, r1) of the slot's expert in the `stream` weight sets (once the
               // router's ids are visible)
};

struct OpDesc {
  std::string_view name;
  std::string_view ranges;  // what [r0, r1) counts: "matrix rows", "heads", "token rows", ...
  std::span<const OperandDesc> operands;  // the fixed slots, in order
  bool mix_tail = false;                  // kFlagAttnRes appends arg::MixTail (1 + sources)
  double cost_factor = 1;  // the scheduler's bytes-equivalent scale for compute-heavy tiles
  Stream stream = Stream::kNone;
  uint8_t stream_operands[2] = {0xff, 0xff};  // slots streamed (0xff: none)
  uint32_t flags = 0;  // the kFlag* bits this op may carry (besides kFlagTestStall)
};

const OpDesc& op_desc(Op op);

// The operand slot name of position i of an instruction of this op (the mix tail included).
std::string_view operand_name(Op op, uint32_t i);

}  // namespace md::plan
