// Load-time quantization (engine/quantize.h): one pass over the eligible matrices, rows in
// parallel over the model's thread pool, each matrix written into one owned buffer (codes, then
// scales) and its source pages released from the process.
#include "megadecode/engine/quantize.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/base/threads.h"
#include "megadecode/base/util.h"
#include "megadecode/kernels/cpu/int4.h"
#include "megadecode/kernels/cpu/int8.h"
#include "megadecode/kernels/cpu/mxfp4.h"
#include "megadecode/model/config.h"
#include "megadecode/model/presets.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/model/weights.h"

namespace md {

std::optional<QuantScheme> parse_quant_scheme(std::string_view name) {
  if (name == "none") return QuantScheme::kNone;
  if (name == "int4") return QuantScheme::kInt4;
  if (name == "int4-asym") return QuantScheme::kInt4Asym;
  if (name == "int8") return QuantScheme::kInt8;
  if (name == "mxfp4") return QuantScheme::kMxfp4;
  return std::nullopt;
}

std::string_view quant_scheme_name(QuantScheme s) {
  switch (s) {
    case QuantScheme::kInt4:
      return "int4";
    case QuantScheme::kInt4Asym:
      return "int4-asym";
    case QuantScheme::kInt8:
      return "int8";
    case QuantScheme::kMxfp4:
      return "mxfp4";
    case QuantScheme::kNone:
      break;
  }
  return "none";
}

WeightQuant quant_format(QuantScheme s) {
  switch (s) {
    case QuantScheme::kInt4:
    case QuantScheme::kInt4Asym:
      return WeightQuant::kInt4;
    case QuantScheme::kInt8:
      return WeightQuant::kInt8;
    case QuantScheme::kMxfp4:
      return WeightQuant::kMxfp4;
    case QuantScheme::kNone:
      break;
  }
  return WeightQuant::kNone;
}

int effective_quant_group(QuantScheme s, int requested) {
  if (s == QuantScheme::kMxfp4) {
    MD_CHECK(requested == -1 || requested == 32,
             "--quant-group {}: MXFP4 has one E8M0 scale per 32 columns (the format's group; "
             "leave --quant-group out or give 32)",
             requested);
    return 32;
  }
  if (requested == -1) return 128;
  MD_CHECK(requested == 0 || (requested >= 32 && requested % 32 == 0),
           "--quant-group {}: the {} kernels need a positive multiple of 32 (or 0: one scale per "
           "row)",
           requested, quant_scheme_name(s));
  return requested;
}

namespace {

struct Target {
  Mat* m;
  std::string name;
};

// Every linear layer's matrix that load-time quantization or the integer activations concern
// (quantize.h lists them), named as in the checkpoint (without ".weight"); lm_head last.
template <class Fn>
void for_each_linear(ModelWeights& w, Fn&& add) {
  auto ffn = [&](FfnWeights& f, const std::string& p) {
    add(f.gate, p + ".gate_proj");
    add(f.up, p + ".up_proj");
    add(f.down, p + ".down_proj");
  };
  for (size_t l = 0; l < w.layers.size(); ++l) {
    LayerWeights& L = w.layers[l];
    const std::string p = "model.layers." + std::to_string(l);
    KdaWeights& k = L.kda;
    for (auto [m, n] : {std::pair{&k.q, "q_proj"},
                        {&k.k, "k_proj"},
                        {&k.v, "v_proj"},
                        {&k.f_a, "f_a_proj"},
                        {&k.f_b, "f_b_proj"},
                        {&k.b, "b_proj"},
                        {&k.g_a, "g_a_proj"},
                        {&k.g_b, "g_b_proj"},
                        {&k.g, "g_proj"},
                        {&k.o, "o_proj"}})
      add(*m, p + ".self_attn." + n);
    MlaWeights& a = L.mla;
    for (auto [m, n] : {std::pair{&a.q, "q_proj"},
                        {&a.q_a, "q_a_proj"},
                        {&a.q_b, "q_b_proj"},
                        {&a.g, "g_proj"},
                        {&a.kv_a, "kv_a_proj_with_mqa"},
                        {&a.o, "o_proj"}})
      add(*m, p + ".self_attn." + n);
    ffn(L.dense, p + ".mlp");
    for (size_t e = 0; e < L.moe.experts.size(); ++e)
      ffn(L.moe.experts[e], p + ".mlp.experts." + std::to_string(e));
    if (L.moe.has_shared) ffn(L.moe.shared, p + ".mlp.shared_experts");
    add(L.moe.latent_down, p + ".mlp.latent_down");
    add(L.moe.latent_up, p + ".mlp.latent_up");
  }
  add(w.lm_head, "lm_head");
}

// The eligible matrices of load-time quantization.
std::vector<Target> targets(ModelWeights& w, bool lm_head) {
  std::vector<Target> t;
  for_each_linear(w, [&](Mat& m, const std::string& name) {
    if (&m == &w.lm_head && !lm_head) return;
    if (m.data && !m.quantized() && m.dtype == DType::BF16) t.push_back({&m, name});
  });
  return t;
}

}  // namespace

int use_int_activations(ModelWeights& w, int bits) {
  MD_CHECK(bits == 8 || bits == 16, "--act-quant: int8 or int16 (got {} bits)", bits);
  int n = 0;
  for_each_linear(w, [&](Mat& m, const std::string&) {
    if (m.data && (m.quant == WeightQuant::kInt4 || m.quant == WeightQuant::kInt8 ||
                   m.quant == WeightQuant::kMxfp4)) {
      m.int_act_bits = static_cast<uint8_t>(bits);
      ++n;
    }
  });
  MD_CHECK(n > 0,
           "--act-quant int{}: the model has no int4, int8 or MXFP4 linear layers to run with "
           "integer activations (load a quantized checkpoint, or add --quantize int4|int8|mxfp4)",
           bits);
  return n;
}

QuantizeReport quantize_weights(const ModelConfig& cfg, ModelWeights& w, const QuantizeOptions& opt,
                                ThreadPool& pool, Checkpoint* ck) {
  (void)cfg;
  QuantizeReport rep;
  if (opt.scheme == QuantScheme::kNone) return rep;
  const int req_group = effective_quant_group(opt.scheme, opt.group);
  const std::string scheme(quant_scheme_name(opt.scheme));
  rep.group = req_group;
  const double t0 = now_seconds();
  std::vector<Target> all = targets(w, opt.lm_head), ts;
  // A matrix whose columns the group does not divide (or that are not a multiple of 32) stays as
  // loaded, as llama.cpp keeps such tensors in a wider type; it is reported, and a group that
  // fits no matrix at all is an error.
  double total = 0;
  for (const Target& t : all) {
    const int64_t g = req_group ? req_group : t.m->cols;
    if (t.m->cols % 32 == 0 && t.m->cols % g == 0) {
      ts.push_back(t);
      total += double(t.m->bytes());
    } else {
      ++rep.kept;
      if (rep.first_kept.empty())
        rep.first_kept = t.name + " (" + std::to_string(t.m->cols) + " columns)";
    }
  }
  MD_CHECK(all.empty() || !ts.empty(),
           "--quantize {} --quant-group {}: the group divides the columns of none of the {} "
           "matrices to quantize (e.g. {}); choose a multiple of 32 that divides them, or 0 for "
           "one scale per row",
           scheme, req_group, all.size(), rep.first_kept);
  const bool tty = opt.progress && isatty(2);
  double done = 0, last_print = 0;
  for (const Target& t : ts) {
    Mat& m = *t.m;
    const int group = int(req_group ? req_group : m.cols);
    Mat q = m;
    q.dtype = DType::U8;
    q.quant = quant_format(opt.scheme);
    q.group = group;
    const size_t code_row = q.code_row_bytes(), scale_row = q.scale_row_bytes();
    const bool zero_points = opt.scheme == QuantScheme::kInt4Asym;
    const size_t zp_row = zero_points ? size_t(m.cols / group) : 0;
    if (const RandomInit* src = ck ? ck->device_only(m.data) : nullptr) {
      MD_CHECK(!zero_points,
               "--quantize int4-asym: {} exists only as a recipe for the device (random weights "
               "generated on the GPU), which is drawn in a format, not quantized: use --quantize "
               "int4",
               t.name);
      // Random weights that exist only as a recipe for the device: drawn in the format.
      const QuantRecipes r = random_quantized_init(q.quant, m.rows, m.cols, group,
                                                   random_init_rms(*src), src->seed);
      q.data = ck->add_device_only(r.codes, size_t(m.rows) * code_row);
      q.scales = static_cast<const uint8_t*>(ck->add_device_only(r.scales, size_t(m.rows) * scale_row));
      rep.bytes_before += double(m.bytes());
      rep.bytes_after += double(q.bytes());
      m = q;
      ++rep.matrices;
      ++rep.drawn;
      continue;
    }
    auto buf = weight_buffer(size_t(m.rows) * (code_row + scale_row + zp_row));
    uint8_t* codes = buf->data();
    uint8_t* scales = codes + size_t(m.rows) * code_row;
    auto* zps = reinterpret_cast<int8_t*>(scales + size_t(m.rows) * scale_row);
    std::atomic<int64_t> bad_row{-1};
    pool.parallel_for(size_t(m.rows), [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r) {
        const bf16* src = m.bf16_data() + r * size_t(m.cols);
        for (int64_t k = 0; k < m.cols; ++k) {
          if ((src[k] & 0x7f80) == 0x7f80) {  // inf or NaN
            bad_row.store(int64_t(r));
            return;
          }
        }
        uint8_t* c = codes + r * code_row;
        uint8_t* sc = scales + r * scale_row;
        switch (q.quant) {
          case WeightQuant::kInt4:
            cpu::quantize_int4_row(src, m.cols, group, c, reinterpret_cast<bf16*>(sc),
                                   zero_points ? zps + r * zp_row : nullptr);
            break;
          case WeightQuant::kInt8:
            cpu::quantize_int8_row(src, m.cols, group, c, reinterpret_cast<bf16*>(sc));
            break;
          default:
            cpu::quantize_mxfp4_row(src, m.cols, c, sc);
            break;
        }
      }
    });
    MD_CHECK(bad_row.load() < 0, "--quantize {}: {} row {} holds a weight that is not finite",
             scheme, t.name, bad_row.load());
    q.data = codes;
    q.scales = scales;
    if (zero_points) q.zero_points = zps;
    rep.bytes_before += double(m.bytes());
    rep.bytes_after += double(q.bytes());
    if (m.data != w.embed.data) release_mapped(m.data, m.bytes());  // (tied lm_head: still read)
    rep.done.push_back({m.data, q});
    w.owned.push_back(std::move(buf));
    m = q;
    ++rep.matrices;
    done += double(m.rows) * double(m.cols) * 2;
    if (tty && (done - last_print > total / 100 || done >= total)) {
      last_print = done;
      std::fprintf(stderr, "\rquantizing to %s (group %s): %3.0f%%", scheme.c_str(),
                   req_group ? std::to_string(req_group).c_str() : "per row",
                   total > 0 ? 100.0 * done / total : 100.0);
    }
  }
  if (tty) std::fprintf(stderr, "\n");
  rep.seconds = now_seconds() - t0;
  return rep;
}

}  // namespace md
