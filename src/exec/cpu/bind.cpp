// Binding the plan's weight table to a loaded model, and the bytes a step moves.
#include "megadecode/base/error.h"
#include "megadecode/exec/executor.h"
#include "tiles.h"

namespace md {
namespace exec {

WeightView bind_weight(const ModelWeights& w, const plan::WeightRef& r) {
  using plan::WeightKind;
  auto mat = [](const Mat& m) {
    return WeightView{m.data,  m.dtype, m.rows,         m.cols,        m.scales,
                      m.quant, m.group, m.int_act_bits, m.zero_points, m.col_perm};
  };
  auto vec = [](const std::vector<float>& v) {
    return WeightView{v.data(), DType::F32, 1, int64_t(v.size()), nullptr};
  };
  const LayerWeights* L = r.layer != plan::kNoLayer ? &w.layers[r.layer] : nullptr;
  switch (r.kind) {
    case WeightKind::kEmbed:
      return mat(w.embed);
    case WeightKind::kLmHead:
      return mat(w.lm_head);
    case WeightKind::kFinalNorm:
      return vec(w.final_norm);
    case WeightKind::kInputNorm:
      return vec(L->input_norm);
    case WeightKind::kPostAttnNorm:
      return vec(L->post_attn_norm);
    case WeightKind::kKdaQ:
      return mat(L->kda.q);
    case WeightKind::kKdaK:
      return mat(L->kda.k);
    case WeightKind::kKdaV:
      return mat(L->kda.v);
    case WeightKind::kKdaFA:
      return mat(L->kda.f_a);
    case WeightKind::kKdaFB:
      return mat(L->kda.f_b);
    case WeightKind::kKdaB:
      return mat(L->kda.b);
    case WeightKind::kKdaGA:
      return mat(L->kda.g_a);
    case WeightKind::kKdaGB:
      return mat(L->kda.g_b);
    case WeightKind::kKdaO:
      return mat(L->kda.o);
    case WeightKind::kKdaQConv:
      return vec(L->kda.q_conv);
    case WeightKind::kKdaKConv:
      return vec(L->kda.k_conv);
    case WeightKind::kKdaVConv:
      return vec(L->kda.v_conv);
    case WeightKind::kKdaALog:
      return vec(L->kda.A_log);
    case WeightKind::kKdaDtBias:
      return vec(L->kda.dt_bias);
    case WeightKind::kKdaONorm:
      return vec(L->kda.o_norm);
    case WeightKind::kMlaQ:
      return mat(L->mla.q);
    case WeightKind::kMlaKvA:
      return mat(L->mla.kv_a);
    case WeightKind::kMlaKvANorm:
      return vec(L->mla.kv_a_norm);
    case WeightKind::kMlaKvB:
      return mat(L->mla.kv_b);
    case WeightKind::kMlaO:
      return mat(L->mla.o);
    case WeightKind::kDenseGate:
      return mat(L->dense.gate);
    case WeightKind::kDenseUp:
      return mat(L->dense.up);
    case WeightKind::kDenseDown:
      return mat(L->dense.down);
    case WeightKind::kRouter:
      return mat(L->moe.router);
    case WeightKind::kRouterBias:
      return vec(L->moe.router_bias);
    case WeightKind::kSharedGate:
      return mat(L->moe.shared.gate);
    case WeightKind::kSharedUp:
      return mat(L->moe.shared.up);
    case WeightKind::kSharedDown:
      return mat(L->moe.shared.down);
    case WeightKind::kExpertGate:
      return mat(L->moe.experts[r.expert].gate);
    case WeightKind::kExpertUp:
      return mat(L->moe.experts[r.expert].up);
    case WeightKind::kExpertDown:
      return mat(L->moe.experts[r.expert].down);
    case WeightKind::kKdaG:
      return mat(L->kda.g);
    case WeightKind::kMlaQA:
      return mat(L->mla.q_a);
    case WeightKind::kMlaQANorm:
      return vec(L->mla.q_a_norm);
    case WeightKind::kMlaQB:
      return mat(L->mla.q_b);
    case WeightKind::kMlaG:
      return mat(L->mla.g);
    case WeightKind::kLatentDown:
      return mat(L->moe.latent_down);
    case WeightKind::kLatentUp:
      return mat(L->moe.latent_up);
    case WeightKind::kLatentNorm:
      return vec(L->moe.latent_norm);
    case WeightKind::kAttnResW:
      return vec(L->attn_res_w);
    case WeightKind::kMlpResW:
      return vec(L->mlp_res_w);
    case WeightKind::kOutputResW:
      return vec(w.output_res_w);
    case WeightKind::kDraftFc:
    case WeightKind::kDraftHiddenNorm:
    case WeightKind::kDraftQ:
    case WeightKind::kDraftK:
    case WeightKind::kDraftV:
    case WeightKind::kDraftO:
    case WeightKind::kDraftQNorm:
    case WeightKind::kDraftKNorm:
    case WeightKind::kMarkovW1:
    case WeightKind::kMarkovW2:
      break;  // the draft's (bind_draft_weight), never a target's
  }
  fail("decode plan: unknown weight kind {}", int(r.kind));
}

}  // namespace exec

StepStats decode_step_bytes(const Model& m, std::span<const int64_t> positions,
                            int distinct_experts, int rows) {
  const std::vector<int> each(positions.size(), rows);
  return decode_step_bytes(m, positions, distinct_experts, std::span<const int>(each));
}

StepStats decode_step_bytes(const Model& m, std::span<const int64_t> positions,
                            int distinct_experts, std::span<const int> rows) {
  MD_CHECK(rows.size() == positions.size(), "decode_step_bytes: {} row counts for {} sequences",
           rows.size(), positions.size());
  const ModelConfig& c = m.config();
  const ModelWeights& w = m.weights();
  // Every matrix but the experts and the embedding table (one row per sequence).
  // A distributed rank reads its vocabulary block of lm_head and holds its experts' slices.
  const auto [v0, v1] = m.shard().vocab(c.vocab_size);
  double fixed = double(w.lm_head.bytes()) * double(v1 - v0) / double(c.vocab_size), expert = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    if (c.attn_kind[size_t(l)] == AttnKind::KDA) {
      const KdaWeights& k = L.kda;
      for (const Mat* x : {&k.q, &k.k, &k.v, &k.f_a, &k.f_b, &k.b, &k.g_a, &k.g_b, &k.g, &k.o})
        fixed += double(x->bytes());
    } else {
      const MlaWeights& a = L.mla;
      for (const Mat* x : {&a.q, &a.q_a, &a.q_b, &a.g, &a.kv_a, &a.kv_b, &a.o})
        fixed += double(x->bytes());
    }
    if (c.ffn_kind[size_t(l)] == FfnKind::Dense) {
      fixed += double(L.dense.bytes());
    } else {
      fixed += double(L.moe.router.bytes());
      if (L.moe.has_shared) fixed += double(L.moe.shared.bytes());
      // K3's latent projections (a distributed rank's block of their rows); an expert's bytes
      // count MXFP4 at 4.25 bits (Mat::bytes).
      for (const Mat* x : {&L.moe.latent_down, &L.moe.latent_up})
        if (x->rows > 0) {
          const auto [r0, r1] = dist::vocab_block(x->rows, m.shard().world(), m.shard().rank);
          fixed += double(x->bytes()) * double(r1 - r0) / double(x->rows);
        }
      for (const FfnWeights& e : L.moe.experts)
        if (e.gate.data) {
          expert = double(e.bytes());
          break;
        }
    }
  }
  StepStats s;
  s.batch = int(positions.size());
  for (int r : rows) {
    s.rows = std::max(s.rows, r);
    s.token_rows += r;
  }
  s.distinct_experts = distinct_experts;
  s.weight_bytes =
      fixed + double(s.token_rows) * double(c.hidden_size) * 2 + double(distinct_experts) * expert;
  const double per_seq_state =
      double(c.num_kda_layers()) *
      (2.0 * 4 * double(c.kda_num_heads) * c.kda_head_dim * c.kda_head_dim +
       2.0 * 4 * 3 * double(c.kda_dim()) * (c.kda_conv_size - 1));
  s.state_bytes = per_seq_state * s.batch;
  // The latent caches in the state pool's storage type (bf16 pages in BF16 precision).
  const double cache_elem = m.numerics().round_bf16 ? 2 : 4;
  for (size_t b = 0; b < positions.size(); ++b)
    s.cache_bytes += double(c.num_mla_layers()) * double(positions[b] + rows[b]) *
                     double(c.mla_cache_width()) * cache_elem;
  return s;
}

}  // namespace md
