// One instruction of the decode plan on CUDA: the dispatch over the op table (the twin of
// exec::run_instr, src/exec/cpu/tiles.cpp). Every thread of a kTileThreads block calls it.
#pragma once
#include "tiles_attention.cuh"
#include "tiles_dense.cuh"
#include "tiles_dist.cuh"
#include "tiles_draft.cuh"
#include "tiles_sample.cuh"

MD_CUDA_BEGIN

// Ops whose [r0, r1) are token rows (plan/ops.cpp): a step may have fewer rows than its plan.
MD_DEV bool token_row_op(plan::Op op) {
  using plan::Op;
  return op == Op::kEmbed || op == Op::kFfnNorm || op == Op::kRouter || op == Op::kLatentNorm ||
         op == Op::kCombine || op == Op::kAllReduce || op == Op::kAllGather;
}

// The first weight rows a tile streams, which may stream in before the tile may start (its inputs
// are not needed for them): the GEMV ops, o_proj and the gate of the gated MLPs. Expert tiles
// learn their weights from the router's output: none.
MD_DEV StreamRef first_stream(const DevStep& s, const plan::Instr& in) {
  using plan::Op;
  const plan::BufferDesc* a = s.buffers + in.args;
  auto w = [&](int i) { return StreamRef{&s.weights[a[i].offset], in.r0, in.r1, false}; };
  switch (in.op) {
    case Op::kKdaProj:
    case Op::kMlaProj:
    case Op::kDenseDown:
    case Op::kSharedDown:
    case Op::kLatentDown:
    case Op::kLatentUp:
    case Op::kLmHead:
    case Op::kDraftCtxProj:
    case Op::kDraftProj:
    case Op::kRouterLogits:
      return w(plan::arg::Gemv::w);
    case Op::kDraftMarkov:
      return w(plan::arg::DraftMarkov::w2);
    case Op::kAttnOut:
      return w(plan::arg::AttnOut::w);
    case Op::kDenseGateUp:
    case Op::kSharedGateUp:
      return w(plan::arg::GateUp::gate);
    default:
      return {};
  }
}

// Tiles that never stream weights through the stages (norms, attention over the caches, the
// combine, the sampler): while one runs, the stages can take the next instruction's chunks.
MD_DEV bool streams_weights(plan::Op op) {
  using plan::Op;
  switch (op) {
    case Op::kEmbed:
    case Op::kLatentNorm:
    case Op::kMlaLatent:
    case Op::kMlaCore:
    case Op::kMlaMerge:
    case Op::kFfnNorm:
    case Op::kRouter:
    case Op::kCombine:
    case Op::kSample:
    case Op::kDraftCtxNorm:
    case Op::kDraftCtxWrite:
    case Op::kDraftAttn:
    case Op::kDraftPick:
    case Op::kAllReduce:
    case Op::kLogitsGather:
    case Op::kAllGather:
      return false;
    default:
      return true;
  }
}

// The tile's first stream, issued now (unless the previous tile's tail already did).
MD_DEV void prefetch_tile(const DevStep& s, const plan::Instr& in, Pipe& pipe) {
  const StreamRef f = first_stream(s, in);
  if (f.w) prefetch(*f.w, f.r0, f.r1, pipe);
}

MD_DEV void run_tile_ops(const DevStep& s, plan::Instr in, Pipe& pipe);

// One instruction; a prefetch the tile did not use is waited out after it (not the next
// instruction's, which its tail issued).
MD_DEV void run_tile(const DevStep& s, const plan::Instr& in, Pipe& pipe) {
  run_tile_ops(s, in, pipe);
  if (pipe.pre_n && !pipe.pre_next) drain(pipe);
}

MD_DEV void run_tile_ops(const DevStep& s, plan::Instr in, Pipe& pipe) {
  using plan::Op;
  if (token_row_op(in.op) && in.r1 > uint32_t(s.n)) {
    if (in.r0 >= uint32_t(s.n)) return;
    in.r1 = uint32_t(s.n);
  }
  const Args a{s, s.buffers + in.args, in.layer};
  switch (in.op) {
    case Op::kEmbed:
      return embed_tile(s, in, a);
    case Op::kKdaProj:
    case Op::kMlaProj:
    case Op::kDenseDown:
    case Op::kSharedDown:
    case Op::kLatentDown:
    case Op::kLatentUp:
    case Op::kLmHead:
      return gemv_tile(s, in, a, pipe);
    case Op::kMlaQUp:
      return mla_q_up_tile(s, in, a, pipe);
    case Op::kLatentNorm:
      return latent_norm_tile(s, in, a);
    case Op::kKdaCore:
      return kda_core_tile(s, in, a, pipe);
    case Op::kMlaLatent:
      return mla_latent_tile(s, in, a);
    case Op::kMlaCore:
      return mla_core_tile(s, in, a);
    case Op::kMlaMerge:
      return mla_merge_tile(s, in, a);
    case Op::kAttnOut:
      return attn_out_tile(s, in, a, pipe);
    case Op::kFfnNorm:
      return ffn_norm_tile(s, in, a);
    case Op::kRouterLogits:
      return router_logits_tile(s, in, a, pipe);
    case Op::kRouter:
      return router_tile(s, in, a);
    case Op::kDenseGateUp:
    case Op::kSharedGateUp:
      return gate_up_tile(s, in, a, pipe);
    case Op::kExpertGateUp:
      return expert_gate_up_tile(s, in, a, pipe);
    case Op::kExpertDown:
      return expert_down_tile(s, in, a, pipe);
    case Op::kCombine:
      return combine_tile(s, in, a);
    case Op::kSample:
      return sample_tile(s, in, a);
    case Op::kDraftCtxProj:
      return draft_ctx_proj_tile(s, in, a, pipe);
    case Op::kDraftCtxNorm:
      return draft_ctx_norm_tile(s, in, a);
    case Op::kDraftCtxWrite:
      return draft_ctx_write_tile(s, in, a);
    case Op::kDraftProj:
      return gemv_tile(s, in, a, pipe);
    case Op::kDraftAttn:
      return draft_attn_tile(s, in, a);
    case Op::kDraftMarkov:
      return draft_markov_tile(s, in, a, pipe);
    case Op::kDraftPick:
      return draft_pick_tile(s, in, a);
    case Op::kAllReduce:
      return all_reduce_tile(s, in, a);
    case Op::kLogitsGather:  // the host gathered every rank's block into the logits
    case Op::kAllGather:     // the host gathered every rank's block in place
      return;
    case Op::kCount:
      break;
  }
  port::trap("decode plan: unknown opcode");
}

MD_CUDA_END
