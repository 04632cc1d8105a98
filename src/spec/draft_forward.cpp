// The DSpark draft's forward on the CPU (spec/draft_model.h; semantics and their sources in
// docs/speculative.md). Rounding points, in Precision::BF16, are those of the seed's bf16
// reference (kimi/dspark.py reference_*): every linear output, RMSNorm (the normalised value,
// then the weight product), RoPE's tables, products and sum, the attention probabilities and
// output, SiLU and the gate product, the residual adds, the base logits and the Markov bias.
// Statistics, scores, softmax and the biased logits are fp32.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <initializer_list>

#include "../engine/forward.h"
#include "megadecode/base/error.h"
#include "megadecode/base/threads.h"
#include "megadecode/kernels/cpu/gqa_attention.h"
#include "megadecode/kernels/cpu/ops.h"
#include "megadecode/kernels/cpu/rope.h"
#include "megadecode/model/config.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/spec/draft_model.h"

namespace md {

void DraftState::reset() {
  std::fill(keys.begin(), keys.end(), 0.0f);
  std::fill(values.begin(), values.end(), 0.0f);
  std::fill(positions.begin(), positions.end(), -1);
  rows_written = 0;
}

DraftModel::DraftModel(const std::string& dir, const ModelConfig& target, const ModelOptions& opt,
                       ThreadPool* pool) {
  namespace fs = std::filesystem;
  MD_CHECK(fs::is_directory(dir), "draft directory {} does not exist or is not a directory", dir);
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  cfg_ = load_draft_config_file(cfg_path);
  validate_draft_for_target(cfg_, target, cfg_path);
  ckpt_ = std::make_unique<Checkpoint>(dir);
  w_ = bind_draft_weights(cfg_, *ckpt_);
  round_ = opt.precision == Precision::BF16;
  if (!pool) {
    own_pool_ = std::make_unique<ThreadPool>(opt.threads, opt.pin_threads);
    pool = own_pool_.get();
  }
  pool_ = pool;
}

DraftModel::~DraftModel() = default;

DraftState DraftModel::new_state() const {
  DraftState s;
  const size_t n = size_t(cfg_.num_layers) * size_t(cfg_.window) * size_t(cfg_.kv_width());
  s.keys.assign(n, 0.0f);
  s.values.assign(n, 0.0f);
  s.positions.assign(size_t(cfg_.window), -1);
  return s;
}

namespace {

struct Ops {
  const DraftConfig& c;
  bool rnd;
  ThreadPool& pool;

  void round(float* x, int64_t n) const {
    if (rnd) cpu::round_bf16_inplace(x, n);
  }
  // Y [B][rows of each job] = W X, outputs rounded (every linear of the reference).
  void linear(std::initializer_list<fwd::MatJob> jobs) const {
    fwd::run_matmuls(pool, std::span<const fwd::MatJob>(jobs.begin(), jobs.size()), rnd);
    for (const fwd::MatJob& j : jobs)
      for (int b = 0; b < j.B; ++b) round(j.y + b * j.ldy, j.w->rows);
  }
  void norm_rows(const float* x, const std::vector<float>& w, int rows, int64_t n, float* y) const {
    for (int r = 0; r < rows; ++r)
      cpu::rmsnorm(x + r * n, w.data(), n, float(c.rms_norm_eps), y + r * n, rnd);
  }
  // Per-head RMSNorm (q_norm / k_norm over head_dim) and RoPE at each row's position, in place.
  void norm_rope(float* x, int rows, int heads, const std::vector<float>& w,
                 const int64_t* positions) const {
    for (int r = 0; r < rows; ++r) {
      float* row = x + int64_t(r) * heads * c.head_dim;
      for (int h = 0; h < heads; ++h)
        cpu::rmsnorm(row + h * c.head_dim, w.data(), c.head_dim, float(c.rms_norm_eps),
                     row + h * c.head_dim, rnd);
      cpu::rope_neox(row, heads, c.head_dim, positions[r], c.rope_theta, rnd);
    }
  }
};

void embed_rows(const Mat& table, std::span<const int32_t> ids, float* out) {
  for (size_t r = 0; r < ids.size(); ++r) {
    const bf16* row = static_cast<const bf16*>(table.row(ids[r]));
    for (int64_t j = 0; j < table.cols; ++j) out[int64_t(r) * table.cols + j] = bf16_to_f32(row[j]);
  }
}

}  // namespace

void DraftModel::update_context(DraftState& s, std::span<const float> aux,
                                std::span<const int32_t> positions) const {
  const DraftConfig& c = cfg_;
  const int64_t D = c.hidden_size, CW = c.context_width(), KV = c.kv_width();
  const int R = int(positions.size());
  MD_CHECK(s.positions.size() == size_t(c.window) &&
               s.keys.size() == size_t(c.num_layers) * size_t(c.window) * size_t(KV),
           "draft update_context: the state is not one of this draft (new_state)");
  MD_CHECK(aux.size() == size_t(R) * size_t(CW),
           "draft update_context: {} aux values for {} rows (expected rows x {} = {} aux layers x "
           "hidden {})",
           aux.size(), R, CW, c.aux_layer_ids.size(), D);
  for (int32_t p : positions) MD_CHECK(p >= 0, "draft update_context: position {} is negative", p);
  if (R == 0) return;
  const Ops ops{c, round_, *pool_};
  std::vector<float> x(aux.begin(), aux.end()), ctx(size_t(R) * D), feat(size_t(R) * D);
  ops.round(x.data(), int64_t(x.size()));  // the seed casts the aux rows to bf16
  ops.linear({{&w_.fc, x.data(), CW, feat.data(), D, R}});
  ops.norm_rows(feat.data(), w_.hidden_norm, R, D, ctx.data());
  std::vector<int64_t> pos(positions.begin(), positions.end());
  std::vector<float> k(size_t(R) * KV), v(size_t(R) * KV);
  for (int l = 0; l < c.num_layers; ++l) {
    const DraftLayerWeights& L = w_.layers[size_t(l)];
    ops.linear({{&L.k, ctx.data(), D, k.data(), KV, R}, {&L.v, ctx.data(), D, v.data(), KV, R}});
    ops.norm_rope(k.data(), R, c.num_kv_heads, L.k_norm, pos.data());
    for (int r = 0; r < R; ++r) {
      const int64_t slot = pos[size_t(r)] % c.window;
      const size_t at = (size_t(l) * size_t(c.window) + size_t(slot)) * size_t(KV);
      std::copy_n(k.data() + int64_t(r) * KV, KV, s.keys.begin() + int64_t(at));
      std::copy_n(v.data() + int64_t(r) * KV, KV, s.values.begin() + int64_t(at));
    }
  }
  for (int r = 0; r < R; ++r) s.positions[size_t(pos[size_t(r)] % c.window)] = positions[size_t(r)];
  s.rows_written += R;
}

void DraftModel::draft(const DraftState& s, int32_t anchor_token, int64_t anchor_position,
                       std::span<int32_t> tokens, const DraftOutputs& out) const {
  const DraftConfig& c = cfg_;
  const int B = int(tokens.size());
  const int64_t D = c.hidden_size, V = c.vocab_size, Q = c.q_width(), KV = c.kv_width(),
                I = c.intermediate_size;
  MD_CHECK(B >= 1 && B <= kDraftMaxBlockRows, "draft: {} tokens asked (1 .. {})", B,
           kDraftMaxBlockRows);
  MD_CHECK(anchor_token >= 0 && anchor_token < V,
           "draft: anchor token {} is outside the vocabulary [0, {})", anchor_token, V);
  MD_CHECK(anchor_position >= 0, "draft: anchor position {} is negative", anchor_position);
  MD_CHECK(s.positions.size() == size_t(c.window),
           "draft: the state is not one of this draft (new_state)");
  const Ops ops{c, round_, *pool_};

  std::vector<int32_t> ids(size_t(B), int32_t(c.mask_token_id));
  ids[0] = anchor_token;
  std::vector<float> x(size_t(B) * D), h(size_t(B) * D), o(size_t(B) * D);
  embed_rows(w_.embed, ids, x.data());
  std::vector<int64_t> pos(static_cast<size_t>(B));
  for (int r = 0; r < B; ++r) pos[size_t(r)] = anchor_position + r;
  // The ring slots the block may see (the seed's context_allowed): filled, before the anchor,
  // and within the window.
  std::vector<int32_t> visible;
  for (int32_t slot = 0; slot < c.window; ++slot) {
    const int64_t p = s.positions[size_t(slot)];
    if (p >= 0 && p < anchor_position && p >= anchor_position - c.window) visible.push_back(slot);
  }
  std::vector<float> q(size_t(B) * Q), k(size_t(B) * KV), v(size_t(B) * KV), att(size_t(B) * Q);
  std::vector<float> gate(size_t(B) * I), up(size_t(B) * I);
  const float scale = float(1.0 / std::sqrt(double(c.head_dim)));
  for (int l = 0; l < c.num_layers; ++l) {
    const DraftLayerWeights& L = w_.layers[size_t(l)];
    ops.norm_rows(x.data(), L.input_norm, B, D, h.data());
    ops.linear({{&L.q, h.data(), D, q.data(), Q, B},
                {&L.k, h.data(), D, k.data(), KV, B},
                {&L.v, h.data(), D, v.data(), KV, B}});
    ops.norm_rope(q.data(), B, c.num_heads, L.q_norm, pos.data());
    ops.norm_rope(k.data(), B, c.num_kv_heads, L.k_norm, pos.data());
    const size_t layer_off = size_t(l) * size_t(c.window) * size_t(KV);
    // Row r sees the visible ring slots and block rows 0..r (causal within the block).
    pool_->parallel_for(size_t(B) * size_t(c.num_heads), [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const int r = int(i / size_t(c.num_heads)), hd = int(i % size_t(c.num_heads));
        const cpu::KvSegment seg[2] = {{s.keys.data() + layer_off, s.values.data() + layer_off, KV,
                                        visible.data(), int64_t(visible.size())},
                                       {k.data(), v.data(), KV, nullptr, r + 1}};
        cpu::gqa_attend(q.data() + r * Q, c.num_heads, c.num_kv_heads, c.head_dim, hd, hd + 1, seg,
                        scale, round_, att.data() + r * Q);
      }
    });
    ops.round(att.data(), int64_t(att.size()));
    ops.linear({{&L.o, att.data(), Q, o.data(), D, B}});
    add_inplace(x.data(), o.data(), B * D, round_);
    ops.norm_rows(x.data(), L.post_attn_norm, B, D, h.data());
    ops.linear(
        {{&L.mlp.gate, h.data(), D, gate.data(), I, B}, {&L.mlp.up, h.data(), D, up.data(), I, B}});
    cpu::silu_mul(gate.data(), up.data(), B * I, gate.data(), round_);
    ops.linear({{&L.mlp.down, gate.data(), I, o.data(), D, B}});
    add_inplace(x.data(), o.data(), B * D, round_);
  }
  ops.norm_rows(x.data(), w_.final_norm, B, D, h.data());
  if (out.hidden) std::copy(h.begin(), h.end(), out.hidden);
  std::vector<float> base(size_t(B) * size_t(V)), bias(static_cast<size_t>(V)),
      e(static_cast<size_t>(c.markov_rank));
  ops.linear({{&w_.lm_head, h.data(), D, base.data(), V, B}});
  if (out.base_logits) std::copy(base.begin(), base.end(), out.base_logits);
  // Left to right: each slot's bias depends on the previous slot's pick.
  int32_t prev = anchor_token;
  for (int r = 0; r < B; ++r) {
    embed_rows(w_.markov_w1, std::span(&prev, 1), e.data());
    ops.linear({{&w_.markov_w2, e.data(), c.markov_rank, bias.data(), V, 1}});
    float* row = base.data() + int64_t(r) * V;
    for (int64_t t = 0; t < V; ++t) row[t] += bias[size_t(t)];
    int64_t best = 0;
    for (int64_t t = 1; t < V; ++t)
      if (row[t] > row[best]) best = t;
    prev = tokens[size_t(r)] = int32_t(best);
  }
  if (out.biased_logits) std::copy(base.begin(), base.end(), out.biased_logits);
}

}  // namespace md
