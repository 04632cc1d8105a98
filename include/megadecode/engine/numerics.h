// One numeric policy per loaded model: where the official implementation rounds, which router,
// activation and residual stream it uses. Derived once from the ModelConfig and the
// ModelOptions (numerics_of) and read by the reference path (engine/), the plan (plan/) and every
// tile of every backend (exec/), so that none of them re-derives it from config proxies. Plain
// data: a device backend copies it as it is.
//
// The shared elementwise helpers that the reference path and the tiles both apply (the rounded
// residual add, the gated activation) live here too, so the two cannot drift apart.
#pragma once
#include <cstdint>

#include "megadecode/engine/quantize.h"
#include "megadecode/model/mapped_file.h"
#include "megadecode/base/bf16.h"
#include "megadecode/base/dtype.h"
#include "megadecode/engine/state_pool.h"
#include "megadecode/kernels/cpu/ops.h"
#include "megadecode/model/config.h"

namespace md {

// Where activations are rounded. BF16 rounds to bf16 at every point the official implementation
// does for a bf16 model (the default: what the checkpoints are); FP32 keeps fp32 activations
// throughout, matching the official implementation run in float32 (used by the golden tests to
// check the math tightly).
enum class Precision { BF16, FP32 };

struct ModelOptions {
  Precision precision = Precision::BF16;
  int threads = 0;  // 0: one per CPU
  bool pin_threads = true;
  bool router_biased_weights = false;  // the original remote code's expert-weight variant
  PoolOptions states;  // the reference path's state pool (Model::new_sequence)
  QuantizeOptions quantize;  // load-time quantization (engine/quantize.h)
  // How the checkpoint's bytes come in: mapped (default) or copied into huge-page memory
  // (--no-mmap; model/mapped_file.h). Its progress callback sees the copy's bytes.
  LoadOptions load;
};

enum class ResidualKind : uint8_t {
  kPlain,           // x += attn(norm(x)); x += ffn(norm(x))
  kBlockAttention,  // Kimi K3's block attention residuals (softmax mixes of block summaries)
};

struct Numerics {
  ModelVariant variant = ModelVariant::kKimiLinear;
  // Activations are rounded to bf16 at the official bf16 model's points (Precision::BF16).
  bool round_bf16 = true;
  // beta = sigmoid(b) rounded to bf16: transformers' kimi_linear in bf16 does; K3's official
  // code takes the sigmoid inside its fla kernel in fp32 and does not.
  bool round_beta = true;
  // The bf16 Kimi Linear reference holds A_log in bf16 (not among the modules it keeps in fp32),
  // so a checkpoint's F32 A_log is rounded at load; dt_bias stays fp32. K3 reads A_log in fp32.
  bool round_a_log = true;
  float eps = 0;         // rms_norm_eps
  float latent_eps = 0;  // kv_a / q_a layernorms (the reference's default 1e-6, not rms_norm_eps)
  cpu::RouterParams router;
  Activation activation = Activation::kSilu;
  float situ_beta = 1.0f, situ_linear_beta = 0.0f;
  ResidualKind residual = ResidualKind::kPlain;
};

Numerics numerics_of(const ModelConfig& c, const ModelOptions& o);

// x = round(x + y) with rounding, x += y without: the reference's residual / partial-sum add
// (the residual is the left operand).
inline void add_inplace(float* x, const float* y, int64_t n, bool round) {
  if (round)
    for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i] + y[i]);
  else
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// The gated MLP's activation: out = act(gate) * up (SiLU-GLU, or K3's SiTU); out may be gate.
inline void glu(const Numerics& n, const float* gate, const float* up, int64_t count, float* out) {
  if (n.activation == Activation::kSitu)
    cpu::situ_mul(gate, up, count, n.situ_beta, n.situ_linear_beta, out, n.round_bf16);
  else
    cpu::silu_mul(gate, up, count, out, n.round_bf16);
}

}  // namespace md
