// The numeric policy of a model (engine/numerics.h), derived once.
#include "megadecode/engine/numerics.h"

namespace md {

Numerics numerics_of(const ModelConfig& c, const ModelOptions& o) {
  Numerics n;
  const bool k3 = c.variant == ModelVariant::kKimiK3;
  n.variant = c.variant;
  n.round_bf16 = o.precision == Precision::BF16;
  n.round_beta = n.round_bf16 && !k3;
  n.round_a_log = n.round_bf16 && !k3;
  n.eps = float(c.rms_norm_eps);
  n.latent_eps = float(c.latent_norm_eps);
  n.router = cpu::RouterParams{
      c.num_experts,     c.num_experts_per_token,        c.num_expert_group,     c.topk_group,
      c.moe_renormalize, float(c.routed_scaling_factor), o.router_biased_weights};
  n.activation = c.activation;
  n.situ_beta = float(c.situ_beta);
  n.situ_linear_beta = float(c.situ_linear_beta);
  n.residual = c.attn_res_block_size > 0 ? ResidualKind::kBlockAttention : ResidualKind::kPlain;
  return n;
}

}  // namespace md
