// A rank's slice of a model (dist/shard.h): the layout checks, the rank's config and its weights
// (row slices in place, column slices copied).
#include "megadecode/dist/shard.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "megadecode/base/error.h"

namespace md::dist {

std::pair<int, int> Shard::experts(const ModelConfig& full) const {
  if (full.num_experts == 0) return {0, 0};
  const int per = full.num_experts / layout.ep;
  return {expert_group() * per, (expert_group() + 1) * per};
}

std::string describe_shard(const Shard& s) {
  return fmt::format("tp {} x ep {}, rank {} of {}", s.layout.tp, s.layout.ep, s.rank, s.world());
}

void check_layout(const ModelConfig& c, const Shard& s) {
  const ShardLayout& l = s.layout;
  MD_CHECK(l.tp >= 1 && l.ep >= 1 && l.world() <= 4096,
           "layout: --tp {} --ep {} is not a layout (each at least 1)", l.tp, l.ep);
  MD_CHECK(s.rank >= 0 && s.rank < l.world(), "layout: rank {} is outside the {} ranks of {}",
           s.rank, l.world(), describe_shard(s));
  const int W = l.world();
  auto divides = [&](int64_t n, int by, const char* what) {
    MD_CHECK(n % by == 0,
             "layout --tp {} --ep {}: the model's {} {} do not divide over {} ranks "
             "(docs/distributed.md \"Layouts\")",
             l.tp, l.ep, n, what, by);
  };
  if (c.num_kda_layers() > 0) divides(c.kda_num_heads, W, "KDA heads");
  if (c.num_mla_layers() > 0) divides(c.mla_num_heads, W, "MLA heads");
  bool dense = false, moe = false;
  for (FfnKind k : c.ffn_kind) (k == FfnKind::Dense ? dense : moe) = true;
  if (dense) divides(c.intermediate_size, W, "dense-FFN channels");
  if (moe) {
    if (c.num_shared_experts > 0) divides(c.shared_intermediate(), W, "shared-expert channels");
    divides(c.num_experts, l.ep, "routed experts (by --ep)");
    divides(c.moe_intermediate_size, l.tp, "routed-expert channels (by --tp)");
    // An MXFP4 expert's down projection is cut between its 32-value scale groups.
    if (c.experts_mxfp4 && l.tp > 1)
      MD_CHECK((c.moe_intermediate_size / l.tp) % 32 == 0,
               "layout --tp {}: the MXFP4 experts' {} channels give slices of {}, not a multiple "
               "of the 32-value scale groups",
               l.tp, c.moe_intermediate_size, c.moe_intermediate_size / l.tp);
  }
}

ModelConfig shard_config(const ModelConfig& full, const Shard& s) {
  check_layout(full, s);
  ModelConfig c = full;
  const int W = s.world();
  c.kda_num_heads = full.kda_num_heads / W;
  c.mla_num_heads = full.mla_num_heads / W;
  c.intermediate_size = full.intermediate_size / W;
  c.shared_intermediate_size = full.shared_intermediate() / W;
  c.moe_intermediate_size = full.moe_intermediate_size / s.layout.tp;
  return c;
}

namespace {

size_t code_row_bytes(const Mat& m) {
  return m.code_row_bytes();
}
void release(const void* p, size_t n) {
  release_mapped(p, n);
}

class Slicer {
 public:
  Slicer(ModelWeights& out, ShardBytes& b, bool release_sources)
      : out_(out), b_(b), release_sources_(release_sources) {}

  // Rows [r0, r1): a view into the mapping.
  Mat rows(const Mat& m, int64_t r0, int64_t r1) {
    if (!m.data) return m;
    MD_CHECK(r0 >= 0 && r1 <= m.rows && r0 <= r1, "shard: rows [{}, {}) of a [{}, {}] matrix", r0,
             r1, m.rows, m.cols);
    Mat v = m;
    v.data = static_cast<const uint8_t*>(m.data) + size_t(r0) * code_row_bytes(m);
    if (m.quantized()) v.scales = m.scales + size_t(r0) * m.scale_row_bytes();
    v.rows = r1 - r0;
    b_.mapped += double(v.bytes());
    return v;
  }
  // The whole matrix, replicated on every rank (a view).
  Mat whole(const Mat& m) { return rows(m, 0, m.rows); }
  // Columns [c0, c1) of every row: copied (strided in the mapping), unless they are all.
  Mat cols(const Mat& m, int64_t c0, int64_t c1) {
    if (!m.data) return m;
    if (c0 == 0 && c1 == m.cols) return whole(m);
    MD_CHECK(c0 >= 0 && c1 <= m.cols && c0 < c1, "shard: columns [{}, {}) of a [{}, {}] matrix", c0,
             c1, m.rows, m.cols);
    Mat v = m;
    v.cols = c1 - c0;
    const size_t src_row = code_row_bytes(m), dst_row = code_row_bytes(v);
    // Quantized formats: whole scale groups only (a group straddling two ranks has no owner).
    MD_CHECK(!m.quantized() || (c0 % m.group == 0 && c1 % m.group == 0),
             "shard: columns [{}, {}) of a [{}, {}] matrix split its scale groups of {}", c0, c1,
             m.rows, m.cols, m.group);
    const size_t at = m.code_bytes(c0);
    const size_t scale_cols = v.scale_row_bytes();
    const size_t scale_at = m.scale_bytes(c0);
    auto buf = std::make_shared<std::vector<uint8_t>>(size_t(m.rows) * (dst_row + scale_cols));
    uint8_t* codes = buf->data();
    uint8_t* scales = codes + size_t(m.rows) * dst_row;
    const auto* src = static_cast<const uint8_t*>(m.data);
    for (int64_t r = 0; r < m.rows; ++r) {
      std::memcpy(codes + size_t(r) * dst_row, src + size_t(r) * src_row + at, dst_row);
      if (m.quantized())
        std::memcpy(scales + size_t(r) * scale_cols,
                    m.scales + size_t(r) * m.scale_row_bytes() + scale_at, scale_cols);
    }
    v.data = codes;
    v.scales = m.quantized() ? scales : nullptr;
    out_.owned.push_back(std::move(buf));
    // The copy read every page of the source (its rows interleave the ranks' columns); let them
    // go from this process, so that its resident memory is its slice (they stay in the page
    // cache for the other ranks, and a later read would fault them back in).
    if (release_sources_) {
      release(m.data, size_t(m.rows) * src_row);
      if (m.quantized()) release(m.scales, size_t(m.rows) * m.scale_row_bytes());
    }
    b_.copied += double(v.bytes());
    return v;
  }
  // Elements [e0, e1) of a vector (copied; small).
  std::vector<float> vec(const std::vector<float>& v, size_t e0, size_t e1) {
    MD_CHECK(e1 <= v.size() && e0 <= e1, "shard: elements [{}, {}) of a vector of {}", e0, e1,
             v.size());
    b_.copied += double(e1 - e0) * 4;
    return std::vector<float>(v.begin() + ptrdiff_t(e0), v.begin() + ptrdiff_t(e1));
  }
  std::vector<float> vec(const std::vector<float>& v) { return vec(v, 0, v.size()); }

 private:
  ModelWeights& out_;
  ShardBytes& b_;
  bool release_sources_;
};

}  // namespace

ModelWeights shard_weights(const ModelConfig& c, const ModelWeights& full, const Shard& s,
                           ShardBytes* bytes, bool release_sources) {
  const ModelConfig local = shard_config(c, s);
  ShardBytes b;
  ModelWeights w;
  Slicer cut(w, b, release_sources);
  const int r = s.rank;
  // The embedding is read one row per token and lm_head by this rank's vocabulary block only:
  // both stay whole mappings, counted at the share the rank reads (the lm_head block).
  w.embed = full.embed;
  w.lm_head = full.lm_head;
  {
    const auto [v0, v1] = s.vocab(c.vocab_size);
    b.mapped += double(v1 - v0) * double(code_row_bytes(full.lm_head));
  }
  w.final_norm = cut.vec(full.final_norm);
  w.output_res_w = cut.vec(full.output_res_w);
  w.ignored_tensors = full.ignored_tensors;
  w.note = full.note;
  w.owned = full.owned;
  w.layers.resize(full.layers.size());
  for (size_t l = 0; l < full.layers.size(); ++l) {
    const LayerWeights& F = full.layers[l];
    LayerWeights& L = w.layers[l];
    L.input_norm = cut.vec(F.input_norm);
    L.post_attn_norm = cut.vec(F.post_attn_norm);
    L.attn_res_w = cut.vec(F.attn_res_w);
    L.mlp_res_w = cut.vec(F.mlp_res_w);
    if (c.attn_kind[l] == AttnKind::KDA) {
      // Heads [h0, h1): channels [c0, c1) of q, k, v (and K3's gate), f_b, g_b, conv taps and
      // dt_bias; rows of b; the columns of o_proj. f_a, g_a and o_norm are shared by the heads.
      const int64_t K = c.kda_head_dim, Hl = local.kda_num_heads, h0 = r * Hl, h1 = h0 + Hl;
      const int64_t c0 = h0 * K, c1 = h1 * K, W = c.kda_conv_size;
      const KdaWeights& f = F.kda;
      KdaWeights& k = L.kda;
      k.q = cut.rows(f.q, c0, c1);
      k.k = cut.rows(f.k, c0, c1);
      k.v = cut.rows(f.v, c0, c1);
      k.g = cut.rows(f.g, c0, c1);
      k.f_a = cut.whole(f.f_a);
      k.f_b = cut.rows(f.f_b, c0, c1);
      k.g_a = cut.whole(f.g_a);
      k.g_b = cut.rows(f.g_b, c0, c1);
      k.b = cut.rows(f.b, h0, h1);
      k.q_conv = cut.vec(f.q_conv, size_t(c0 * W), size_t(c1 * W));
      k.k_conv = cut.vec(f.k_conv, size_t(c0 * W), size_t(c1 * W));
      k.v_conv = cut.vec(f.v_conv, size_t(c0 * W), size_t(c1 * W));
      k.dt_bias = cut.vec(f.dt_bias, size_t(c0), size_t(c1));
      k.A_log = cut.vec(f.A_log, size_t(h0), size_t(h1));
      k.o_norm = cut.vec(f.o_norm);
      k.o = cut.cols(f.o, c0, c1);
    } else {
      // Heads [h0, h1) of q (or q_b), kv_b, the output gate and o_proj; the latent projection
      // and its norms are every head's (each rank keeps the whole latent cache).
      const int64_t N = c.qk_nope_head_dim, P = c.qk_rope_head_dim, V = c.v_head_dim;
      const int64_t Hl = local.mla_num_heads, h0 = r * Hl, h1 = h0 + Hl;
      const MlaWeights& f = F.mla;
      MlaWeights& m = L.mla;
      m.q = cut.rows(f.q, h0 * (N + P), h1 * (N + P));
      m.q_a = cut.whole(f.q_a);
      m.q_a_norm = cut.vec(f.q_a_norm);
      m.q_b = cut.rows(f.q_b, h0 * (N + P), h1 * (N + P));
      m.g = cut.rows(f.g, h0 * V, h1 * V);
      m.kv_a = cut.whole(f.kv_a);
      m.kv_a_norm = cut.vec(f.kv_a_norm);
      m.kv_b = cut.rows(f.kv_b, h0 * (N + V), h1 * (N + V));
      m.o = cut.cols(f.o, h0 * V, h1 * V);
    }
    auto ffn_slice = [&](const FfnWeights& f, int64_t i0, int64_t i1) {
      FfnWeights o;
      o.gate = cut.rows(f.gate, i0, i1);
      o.up = cut.rows(f.up, i0, i1);
      o.down = cut.cols(f.down, i0, i1);
      return o;
    };
    if (c.ffn_kind[l] == FfnKind::Dense) {
      const int64_t Il = local.intermediate_size;
      L.dense = ffn_slice(F.dense, r * Il, (r + 1) * Il);
      continue;
    }
    const MoeWeights& f = F.moe;
    MoeWeights& m = L.moe;
    m.router = cut.whole(f.router);
    m.router_bias = cut.vec(f.router_bias);
    // K3's latent projections: the rank computes its block of each one's output rows (the
    // plan gathers the blocks), so they stay whole mappings counted at the block, as lm_head.
    m.latent_down = f.latent_down;
    m.latent_up = f.latent_up;
    for (const Mat* p : {&f.latent_down, &f.latent_up})
      if (p->data) {
        const auto [r0, r1] = vocab_block(p->rows, s.world(), r);
        b.mapped += double(r1 - r0) * double(p->bytes()) / double(p->rows);
      }
    m.latent_norm = cut.vec(f.latent_norm);
    m.has_shared = f.has_shared;
    if (f.has_shared) {
      const int64_t Is = local.shared_intermediate();
      m.shared = ffn_slice(f.shared, r * Is, (r + 1) * Is);
    }
    // The group's experts, channels [i0, i1) of each; the others stay empty (null).
    m.experts.resize(f.experts.size());
    const auto [e0, e1] = s.experts(c);
    const int64_t Il = local.moe_intermediate_size, i0 = s.expert_slice() * Il, i1 = i0 + Il;
    for (int e = e0; e < e1; ++e) m.experts[size_t(e)] = ffn_slice(f.experts[size_t(e)], i0, i1);
  }
  if (bytes) *bytes = b;
  return w;
}

}  // namespace md::dist
