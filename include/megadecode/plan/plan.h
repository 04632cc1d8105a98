// The decode plan: one step of a Kimi Linear or Kimi K3 model for a batch of B sequences that each
// feed R consecutive token rows (R = 1: decode; R > 1: a speculative verify or a prefill chunk),
// compiled into fixed-size instructions for W workers (docs/architecture.md "The decode plan",
// "Step shape: token rows"; the ops are described in plan/ops.h).
//
// Everything in a Plan is plain data with no host pointer: instructions name their data through
// a buffer table (arena offsets, weight-table ids, per-sequence state slots, the step's token ids
// and logits), so the same bytes could be copied to a device and interpreted there. An executor
// (exec/) resolves the tables against a loaded Model once, and the per-sequence state slots at
// every step.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/model/config.h"
#include "megadecode/model/draft_config.h"

namespace md {
struct ModelWeights;
}

namespace md::plan {

// What an instruction computes. One opcode per op kind of the decode DAG; several share an
// implementation (e.g. every "Y = round(W X)" row block) but keep their own opcode so that
// counters, summaries and the op-by-op stages are per op.
enum class Op : uint8_t {
  kEmbed,         // per sequence: x0 = embedding row; h = RMSNorm(x0, input_norm[0])
  kKdaProj,       // row block of q | k | v (| g, K3's full-rank gate; head aligned) or of
                  // f_a | g_a | b: Y = round(W h)
  kKdaCore,       // one head of one sequence: f_b/g_b rows, conv + SiLU, decay gate, beta,
                  // delta rule, gated output norm
  kMlaProj,       // row block of q or kv_a (K3: q_a, kv_a or the output gate g)
  kMlaQUp,        // K3's q LoRA: row block of q = round(q_b RMSNorm(q_a h, q_a_layernorm))
  kMlaLatent,     // per sequence: cache row = [RMSNorm(a[:R], kv_a_norm) ; a[R:]]
  kMlaCore,       // head range of one sequence: weight-absorbed attention over the latent cache
                  // (with KV splits: over split `slot`'s cache rows, into partials)
  kMlaMerge,      // head range of one sequence: merges the KV splits' partials, applies W_UV
  kAttnOut,       // row block of o_proj plus the residual: x_mid = round(x + round(W o))
                  // (K3, first layer of a block: x_mid = round(W o), a new partial sum)
  kFfnNorm,       // per sequence: h2 = RMSNorm(x_mid, post_attention_layernorm) (K3: of the
                  // block attention residual mix over the block summaries and x_mid)
  kRouterLogits,  // row block (experts) of the router's logits for every token row: L = W h2,
                  // fp32, never rounded
  kRouter,        // per sequence: sigmoid top-k of its logits -> expert ids and weights
  kDenseGateUp,   // row block of the dense MLP: act = silu(round(G h2)) * round(U h2)
  kDenseDown,     // row block of the dense MLP's down projection
  kSharedGateUp,  // same for the shared expert
  kSharedDown,
  kExpertGateUp,  // (expert slot u, row block): the u-th distinct expert chosen by the batch
  kExpertDown,
  kLatentDown,  // K3's latent MoE: row block of z = round(routed_expert_down_proj h2)
  kLatentNorm,  // per sequence: fp32 weighted routed sum (ascending id), rounded, RMSNorm
  kLatentUp,    // row block of round(routed_expert_up_proj r)
  kCombine,     // per sequence: routed sum (ascending expert id) + shared / dense output +
                // residual, then the next RMSNorm (next layer's input norm, or the final norm)
  kLmHead,      // vocabulary row block -> logits
  kSample,      // per sequence: the next token from its logits (its sampler, or greedy argmax)
  // The speculative draft's plan (compile_draft_plan; docs/speculative.md "The draft plan"):
  kDraftCtxProj,   // row block of fc (over the aux rows) or of a layer's k | v (over the context
                   // rows): Y = round(W X) for every context row
  kDraftCtxNorm,   // context rows: ctx = RMSNorm(fc output, hidden_norm)
  kDraftCtxWrite,  // (layer, sequence): k_norm and RoPE of the context keys at their positions;
                   // keys and values into the sequence's ring (layer 0 also the slot positions)
  kDraftProj,      // row block of a layer's q, k or v over the block rows
  kDraftAttn,      // KV heads of one sequence: q_norm / k_norm and RoPE of the block rows, then
                   // attention over the visible ring slots and causally over the block
  kDraftMarkov,    // (slot k, vocabulary row block): bias = round(markov_w2 markov_w1[prev]),
                   // biased = base logits of block row k + bias, each sequence's best (value, id)
  kDraftPick,      // (slot k, sequences): draft k = the best over the vocabulary blocks
  // A distributed rank's plan (PlanOptions::world > 1; docs/distributed.md "Collectives"):
  kAllReduce,     // the step's token rows of one or two buffers of fp32 partials summed over the
                  // ranks in rank order (dist::Communicator), rounded, and with kFlagResidual
                  // added to the residual: x = round(resid + round(sum))
  kLogitsGather,  // every rank's vocabulary block of the logit rows, so that all hold all logits
  kAllGather,     // the step's token rows of one buffer whose columns are computed in blocks, one
                  // a rank (dist::vocab_block): every block to every rank, exactly (K3's split
                  // latent projections)
  kCount
};
constexpr int kNumOps = int(Op::kCount);
std::string_view op_name(Op op);

constexpr uint32_t kNone = 0xffffffffu;
// K3's block attention residual mixes take at most this many sources (block summaries + the
// partial sum): 93 layers in blocks of 12 need 9.
constexpr int kMaxResSources = 64;
constexpr uint16_t kNoLayer = 0xffff;
// Token rows per sequence in one step. Up to kMaxChainedRows the KDA cores run the recurrence
// row by row (bit-identical to that many decode steps, and what a commit to a prefix replays);
// above, the chunked form of the reference prefill.
constexpr int kMaxRows = 64;
constexpr int kMaxChainedRows = 16;

// A wait is satisfied at step epoch e (the number of steps this plan has completed on this
// executor) when counter >= target + e * counters[counter].per_step. Counters are monotonic and
// never reset; comparisons are modulo 2^32 (int32 difference), so wrap-around is harmless.
struct Wait {
  uint32_t counter = kNone;
  uint32_t target = 0;
};

// Instruction flags: one bit, one meaning (32 bits: room to grow).
inline constexpr uint32_t kFlagMoeCombine =
    1u << 0;  // kCombine: routed experts (else: the dense MLP's output)
inline constexpr uint32_t kFlagSharedExpert = 1u << 1;  // kCombine: add the shared expert's output
inline constexpr uint32_t kFlagResidual = 1u << 2;      // kAttnOut: add the residual
// K3:
inline constexpr uint32_t kFlagFullRankGate =
    1u << 3;  // kKdaCore: the output gate is a full-rank projection (no g_b)
inline constexpr uint32_t kFlagLatentMoe =
    1u << 4;  // kCombine: the routed output is the latent MoE's up-projection
inline constexpr uint32_t kFlagBoundedDecay = 1u << 5;  // kKdaCore: lower-bounded decay gate
inline constexpr uint32_t kFlagOutputGate =
    1u << 6;  // kMlaCore / kMlaMerge: sigmoid output gate on the attention output
inline constexpr uint32_t kFlagAttnRes =
    1u << 7;  // kFfnNorm / kCombine: norm of the block attention residual mix
// Step shape:
inline constexpr uint32_t kFlagLogitRows =
    1u << 8;  // kCombine of the last layer: the final norm's output goes to the
//                                 compact logit-row buffer (only the rows that asked for logits)
// Distributed: the tile writes this rank's fp32 partial sums, unrounded and without the residual
// (kAttnOut, kDenseDown, kSharedDown, kExpertDown); the kAllReduce after it completes them.
inline constexpr uint32_t kFlagPartial = 1u << 9;
inline constexpr uint32_t kFlagTestStall =
    1u << 31;  // test hook: the instruction never completes (watchdog tests)

// Token rows. A step's activations hold N = batch * rows token rows: row t is token t % rows of
// sequence t / rows (at position pos[seq] + t % rows). Per-row tiles take ranges [r0, r1) of
// these rows; the rows whose logits are wanted are compacted into "logit rows" (lm_head and
// sampling run over those only).

// One tile of one op. 64 bytes, trivially copyable, no pointers.
struct alignas(64) Instr {
  Op op = Op::kEmbed;
  uint8_t pad0 = 0;
  uint16_t layer = kNoLayer;
  uint16_t seq = 0;         // sequence index within the batch (per-sequence tiles)
  uint16_t slot = 0;        // expert slot (kExpertGateUp / kExpertDown); KV split (kMlaCore)
  uint32_t r0 = 0, r1 = 0;  // tile range: matrix rows, heads, or token rows (op-specific)
  Wait wait[2];
  uint32_t signal = kNone;  // counter incremented (release) when the tile is done
  uint32_t args = 0;        // operands: buffer-table entries args .. args + nargs - 1
  uint32_t nargs = 0;
  uint32_t id = 0;         // index in Plan::instrs (the global topological order)
  uint32_t est_bytes = 0;  // bytes the tile is expected to move (weights, state, activations)
  uint32_t splits = 0;     // kMlaCore / kMlaMerge: KV splits of the attention (0: unsplit)
  uint32_t flags = 0;      // kFlag* bits
  uint32_t reserved = 0;
};
static_assert(sizeof(Instr) == 64, "an instruction is one 64-byte line");

// The buffer table. An instruction's operands are consecutive entries (Instr::args), with an
// op-specific meaning (see the executors).
enum class BufKind : uint8_t {
  kArena,   // activations: offset bytes into the arena, `stride` bytes per sequence
  kWeight,  // weights: weight-table ids offset .. offset + count - 1 (count > 1: one per expert)
  kState,   // per-sequence state of `layer`: sub = StateKind
  kTokens,  // the step's input token ids [N] (int32), one per token row (a draft plan: the
            // block rows' tokens, the anchor then mask tokens)
  kLogits,  // the step's output logits [logit rows][vocab]
  kNull,    // an absent operand
};
enum class StateKind : uint8_t {
  kKdaState,
  kConvCache,
  kMlaCache,
  kDraftRing,  // a draft plan's: the sequence's ring of context keys and values of `layer`
};

struct BufferDesc {
  BufKind kind = BufKind::kNull;
  uint8_t sub = 0;
  uint16_t layer = kNoLayer;
  uint32_t count = 0;   // weights: entries in the set; arena: elements per sequence
  uint64_t offset = 0;  // arena: byte offset; weights: first weight-table id
  uint64_t stride = 0;  // arena: bytes from one sequence's row to the next
};
static_assert(sizeof(BufferDesc) == 24);

// The weight table: which model tensor each id names. The executor binds it to memory.
enum class WeightKind : uint8_t {
  kEmbed,
  kLmHead,
  kFinalNorm,
  kInputNorm,
  kPostAttnNorm,
  kKdaQ,
  kKdaK,
  kKdaV,
  kKdaFA,
  kKdaFB,
  kKdaB,
  kKdaGA,
  kKdaGB,
  kKdaO,
  kKdaQConv,
  kKdaKConv,
  kKdaVConv,
  kKdaALog,
  kKdaDtBias,
  kKdaONorm,
  kMlaQ,
  kMlaKvA,
  kMlaKvANorm,
  kMlaKvB,
  kMlaO,
  kDenseGate,
  kDenseUp,
  kDenseDown,
  kRouter,
  kRouterBias,
  kSharedGate,
  kSharedUp,
  kSharedDown,
  kExpertGate,
  kExpertUp,
  kExpertDown,
  // Kimi K3.
  kKdaG,   // full-rank output gate g_proj [C, D]
  kMlaQA,  // q LoRA: q_a_proj [Q, D], q_a_layernorm [Q], q_b_proj [H*(N+P), Q]
  kMlaQANorm,
  kMlaQB,
  kMlaG,        // output gate g_proj [H*V, D]
  kLatentDown,  // routed_expert_down_proj [X, D]
  kLatentUp,    // routed_expert_up_proj [D, X]
  kLatentNorm,  // routed_expert_norm [X]
  kAttnResW,    // block attention residual score weights (res_norm * res_proj) [D]
  kMlpResW,
  kOutputResW,
  // The speculative draft (model/draft_weights.h); its embedding, lm_head, norms and MLP use the
  // kinds above (kEmbed, kLmHead, kFinalNorm, kInputNorm, kPostAttnNorm, kDense*).
  kDraftFc,          // fc [D, n_aux * D]
  kDraftHiddenNorm,  // hidden_norm [D]
  kDraftQ,           // q_proj [Hq * d, D]
  kDraftK,           // k_proj, v_proj [Hkv * d, D]
  kDraftV,
  kDraftO,      // o_proj [D, Hq * d]
  kDraftQNorm,  // q_norm, k_norm [d]
  kDraftKNorm,
  kMarkovW1,  // markov_w1, markov_w2 [V, r]
  kMarkovW2,
};
std::string_view weight_kind_name(WeightKind k);

struct WeightRef {
  WeightKind kind = WeightKind::kEmbed;
  uint8_t pad = 0;
  uint16_t layer = kNoLayer;
  uint32_t expert = 0;
};

// A monotonic counter: signalled once by each of `per_step` instructions per step.
struct CounterDesc {
  Op op = Op::kEmbed;
  uint8_t pad = 0;
  uint16_t layer = kNoLayer;
  uint32_t group = 0;  // head group, sequence, expert slot, ... (op-specific)
  uint32_t per_step = 0;
};

// A run of consecutive instructions (in global order) of one op and layer.
struct Stage {
  Op op;
  uint16_t layer;
  uint32_t begin, end;
};

// How the megakernel's queues are built (docs/architecture.md "Scheduling").
enum class Scheduler : uint8_t {
  kPhases,  // the op-by-op phase shares, concatenated (every wait is implied by a barrier)
  kList,    // list scheduling over the whole program with the cost model below
};

struct PlanOptions {
  int batch = 1;
  // Token rows per sequence (1..kMaxRows): 1 is a decode step; more are a speculative verify
  // or a prefill chunk. Every sequence of a step feeds this many rows.
  int rows = 1;
  int workers = 1;
  // Target weight bytes per GEMV tile: row blocks are sized to about this (16-row multiples),
  // and every matrix is split into at least `workers` tiles where its rows allow, but no tile
  // is made smaller than min_tile_bytes.
  size_t tile_bytes = size_t{256} << 10;
  size_t min_tile_bytes = size_t{16} << 10;
  // Fixed cost of one instruction (dispatch, waits, signal) in bytes-equivalent, for the
  // scheduler's cost model.
  size_t instr_overhead_bytes = size_t{16} << 10;
  // Latency of a dependency between two workers (counter and data cross cores), same units.
  size_t sync_cost_bytes = size_t{16} << 10;
  Scheduler scheduler = Scheduler::kPhases;
  // MLA attention split over the cache rows (flash-decoding: a partial per split, then a merge
  // per head range). 0: automatic (split only when there are at least 4 workers per head range
  // of the batch, i.e. wide GPUs; never on a few CPU cores); 1: never; n: n splits. The merge
  // changes the fp32 summation order, so a split plan agrees with Model::forward within fp32
  // rounding, not bitwise (both executors still agree bitwise with each other).
  int mla_kv_splits = 0;
  // A distributed run (dist/shard.h): `world` ranks, this plan being rank `rank`'s, for the
  // rank's sharded model (its config and weights). world > 1 makes the row-parallel projections
  // write partial sums (kFlagPartial) and adds the collectives: an all-reduce after o_proj and
  // one after the FFN's down projections, and the gather of the rank's vocabulary block of the
  // logits (lm_head computes only that block).
  int world = 1, rank = 0;
};

struct Plan {
  int batch = 0, rows = 1, workers = 0;
  int token_rows() const { return batch * rows; }
  ModelConfig cfg;
  PlanOptions options;

  std::vector<Instr> instrs;  // the whole program in a global topological order
  std::vector<Stage> stages;  // instrs split by (op, layer), in order
  std::vector<CounterDesc> counters;
  std::vector<BufferDesc> buffers;
  std::vector<WeightRef> weights;
  uint64_t arena_bytes = 0;

  // Megakernel: per worker, indices into instrs (increasing, i.e. a subsequence of the global
  // order) and the same instructions as a contiguous array (what a device would receive).
  std::vector<std::vector<uint32_t>> queue_ids;
  std::vector<std::vector<Instr>> queues;

  // Op by op: barrier phases. A phase is a run of consecutive stages none of which waits on a
  // counter signalled inside the phase; phase_instrs[p][w] lists worker w's share (indices,
  // increasing), balanced by estimated bytes within the phase.
  std::vector<std::pair<uint32_t, uint32_t>> phases;  // [first stage, last stage + 1)
  std::vector<std::vector<std::vector<uint32_t>>> phase_instrs;

  // Arena offsets the executor needs outside the instruction stream: the router output of each
  // MoE layer (expert ids, int32 [B][k]) for the step statistics; kNone where absent.
  std::vector<uint32_t> router_ids_buffer;  // per layer: buffer-table index
  // The sampled next token of each logit row (int32 [N], written by the kSample tiles).
  uint32_t next_ids_buffer = kNone;  // buffer-table index
  // Per layer l, the residual stream entering it (fp32 [N][hidden]): layer 0's is the embedding
  // (kEmbed's x0), layer l's the x_next of layer l - 1's kCombine (Kimi K3: the current block's
  // partial sum, the reference's prefix). Like every arena buffer it is written once per step
  // and never overwritten in it, so after a step it holds the stream of every token row: what
  // StepOptions::aux copies out (docs/speculative.md "Aux capture in the plan executors").
  // Each is an entry of its own in the buffer table, which no instruction names.
  std::vector<uint32_t> residual_buffer;  // per layer: buffer-table index

  // A draft plan (compile_draft_plan; `draft` is set): one step of the speculative draft for
  // `batch` sequences, each appending up to ctx_rows context rows to its ring, then drafting
  // `rows` tokens from a block of `rows` rows (0: the context update only). cfg is then the
  // draft's geometry in a ModelConfig's terms (draft_model_config): hidden, vocabulary,
  // layers, the MLP and eps, so that the shared tiles (embed, attn_out, ffn_norm, the dense
  // MLP, combine, lm_head) run the draft's rows unchanged.
  struct Draft {
    bool on = false;
    DraftConfig cfg;
    int ctx_rows = 0;
    // Buffer-table entries the executor fills before the step or reads after it.
    uint32_t aux = kNone;      // fp32 [batch * ctx_rows][context width]: the rows' aux states
    uint32_t ctx_pos = kNone;  // int32 [batch * ctx_rows]: each context row's position, -1: none
    uint32_t drafts = kNone;   // int32 [batch][rows]: the drafted tokens
    uint32_t hidden = kNone;   // fp32 [batch * rows][D]: the final-normed block rows
    uint32_t base = kNone;     // fp32 [batch * rows][V]: lm_head of the block rows
    uint32_t biased = kNone;   // fp32 [batch * rows][V]: base + the Markov bias
  } draft;
};

// The schedulers' cost of one tile in bytes-equivalent (estimated bytes, scaled up for
// compute-heavy tiles, plus PlanOptions::instr_overhead_bytes).
double tile_cost(const Instr& in, const PlanOptions& o);

// How one op-by-op phase's instructions (costs in global order) are shared among `workers`:
// positions into `cost`, each share increasing. Contiguous runs of about equal cost where they
// balance (the longest within 2% of what longest-processing-time-first gives), else LPT. Runs
// keep a worker's consecutive GEMV tiles on consecutive rows of one matrix, so each tile's
// weight prefetch, which streams past its last row, lands in the worker's own next tile
// (docs/architecture.md, "Sharing a phase among the workers").
std::vector<std::vector<uint32_t>> split_phase(const std::vector<double>& cost, int workers);

// Compiles one decode step. `w` (optional) supplies the stored dtypes; without it matrices are
// taken as bf16, the router as fp32 (Kimi Linear) or bf16 (K3) and K3's routed experts as MXFP4
// when the config says so (what make-model writes). Throws md::Error on options out
// of range (batch 1..1024, workers 1..4096).
Plan compile_decode_plan(const ModelConfig& cfg, const ModelWeights* w, const PlanOptions& opt);

// The speculative draft's step as a plan (docs/speculative.md "The draft plan"): opt.batch
// sequences, each appending up to ctx_rows (0..kMaxRows) context rows, then a block of opt.rows
// (0..kDraftMaxBlockRows; 0: no block) rows drafting that many tokens. Throws md::Error on a
// shape out of range (ctx_rows above the window, nothing to do).
Plan compile_draft_plan(const DraftConfig& d, const PlanOptions& opt, int ctx_rows);
// The draft's geometry as a ModelConfig (what a draft plan's cfg holds): hidden, vocabulary,
// layers (all dense, SiLU), intermediate size and rms_norm_eps.
ModelConfig draft_model_config(const DraftConfig& d);

// Every structural property the executors rely on; returns the problems found (empty: valid).
//  * every wait names an existing counter, its target is <= the counter's per-step signals, and
//    all of that counter's signallers come before the waiter in the global order;
//  * per_step of every counter equals the number of instructions signalling it;
//  * every queue is strictly increasing in global order and the queues partition instrs;
//  * every phase's waits are on counters signalled only in earlier phases;
//  * operands are in range, their count and kinds are those of the op table (plan/ops.h), and
//    flags are the op's own; the arena fits;
//  * residual_buffer names, per layer, the buffer kEmbed writes as x0 (layer 0) or the previous
//    layer's kCombine writes as x_next.
std::vector<std::string> validate_plan(const Plan& p);

// Summary figures.
struct PlanStats {
  std::vector<int> instrs_per_op;        // [kNumOps]
  std::vector<double> bytes_per_op;      // [kNumOps]
  std::vector<double> bytes_per_worker;  // megakernel queues
  std::vector<int> instrs_per_worker;
  double total_bytes = 0;
  // Longest chain of dependent instructions, weighted by estimated bytes.
  double critical_path_bytes = 0;
  std::vector<uint32_t> critical_path;  // instruction ids, first to last
  // The scheduler's simulated makespan (bytes-equivalent incl. instruction overhead) and the
  // ideal total / W.
  double est_makespan = 0, est_ideal = 0;
};
PlanStats plan_stats(const Plan& p);

// Human-readable summary (counts per op, bytes per worker, critical path) and, with dump, every
// queue one instruction per line.
std::string describe_plan(const Plan& p, bool dump);
std::string describe_instr(const Plan& p, const Instr& in);
// The instruction's operands by slot name (plan/ops.h), e.g. "w=kda.q@L0 x=arena+0 y=arena+512".
std::string describe_operands(const Plan& p, const Instr& in);

}  // namespace md::plan
