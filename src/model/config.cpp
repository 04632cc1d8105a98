#include "megadecode/model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/kda.h"
#include "megadecode/kernels/cpu/ops.h"

namespace md {

using nlohmann::json;

namespace {

// Field readers: a missing or mistyped field is an error that names it (with its JSON path).
const json& field(const json& j, const std::string& path, const char* key) {
  auto it = j.find(key);
  MD_CHECK(it != j.end() && !it->is_null(), "config.json: missing field '{}{}'", path, key);
  return *it;
}

int64_t get_int(const json& j, const std::string& path, const char* key) {
  const json& v = field(j, path, key);
  MD_CHECK(v.is_number_integer(), "config.json: field '{}{}' must be an integer, got {}", path, key,
           v.dump());
  return v.get<int64_t>();
}

int64_t get_int_or(const json& j, const std::string& path, const char* key, int64_t dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  return get_int(j, path, key);
}

double get_num(const json& j, const std::string& path, const char* key) {
  const json& v = field(j, path, key);
  MD_CHECK(v.is_number(), "config.json: field '{}{}' must be a number, got {}", path, key,
           v.dump());
  return v.get<double>();
}

double get_num_or(const json& j, const std::string& path, const char* key, double dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  return get_num(j, path, key);
}

bool get_bool_or(const json& j, const std::string& path, const char* key, bool dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  MD_CHECK(it->is_boolean(), "config.json: field '{}{}' must be true or false, got {}", path, key,
           it->dump());
  return it->get<bool>();
}

std::string get_str_or(const json& j, const std::string& path, const char* key,
                       const std::string& dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  MD_CHECK(it->is_string(), "config.json: field '{}{}' must be a string, got {}", path, key,
           it->dump());
  return it->get<std::string>();
}

int positive(int64_t v, const std::string& path, const char* key, int64_t max = 1 << 30) {
  MD_CHECK(v > 0 && v <= max, "config.json: field '{}{}' must be in [1, {}], got {}", path, key,
           max, v);
  return static_cast<int>(v);
}

std::vector<int64_t> get_int_list(const json& j, const std::string& path, const char* key) {
  const json& v = field(j, path, key);
  MD_CHECK(v.is_array(), "config.json: field '{}{}' must be a list of integers", path, key);
  std::vector<int64_t> out;
  for (const auto& e : v) {
    MD_CHECK(e.is_number_integer(), "config.json: field '{}{}' must be a list of integers, got {}",
             path, key, e.dump());
    out.push_back(e.get<int64_t>());
  }
  return out;
}

}  // namespace

int ModelConfig::num_kda_layers() const {
  return static_cast<int>(std::count(attn_kind.begin(), attn_kind.end(), AttnKind::KDA));
}
int ModelConfig::num_mla_layers() const {
  return static_cast<int>(std::count(attn_kind.begin(), attn_kind.end(), AttnKind::MLA));
}

namespace {

// Python's re.match (anchored at the start) through PCRE2, whose syntax covers the patterns
// compressed-tensors configs use. Returns -1 when the pattern does not compile, else 0 / 1.
// (std::regex is avoided: GCC 12's <regex> trips -Wmaybe-uninitialized under ASan.)
int regex_match_at_start(const std::string& pattern, const std::string& subject) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_ANCHORED, &err, &off, nullptr);
  if (!code) return -1;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  const int rc = md ? pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(subject.data()),
                                  subject.size(), 0, 0, md, nullptr)
                    : PCRE2_ERROR_NOMEMORY;
  pcre2_match_data_free(md);
  pcre2_code_free(code);
  return rc >= 0 ? 1 : 0;
}

// The `ignore` list: strings, valid patterns.
std::vector<std::string> parse_ignore(const json& q, const std::string& p) {
  std::vector<std::string> ignore;
  auto it = q.find("ignore");
  if (it == q.end() || it->is_null()) return ignore;
  MD_CHECK(it->is_array(), "config.json: field '{}ignore' must be a list of strings", p);
  for (const auto& e : *it) {
    MD_CHECK(e.is_string(), "config.json: field '{}ignore' must be a list of strings, got {}", p,
             e.dump());
    const std::string s = e.get<std::string>();
    if (s.rfind("re:", 0) == 0) {
      MD_CHECK(regex_match_at_start(s.substr(3), "") >= 0,
               "config.json: field '{}ignore' holds an invalid regular expression '{}'", p, s);
    }
    ignore.push_back(s);
  }
  return ignore;
}

// pack-quantized int4 / int8 weights: 4- or 8-bit signed integers, symmetric (or 4-bit with zero
// points), a static scale per group of columns (or per row). Sets the format and the group (0: per
// row).
void parse_int_weights(const json& w, const std::string& wp, ModelConfig& c) {
  const int64_t bits = get_int(w, wp, "num_bits");
  MD_CHECK(bits == 4 || bits == 8,
           "config.json: field '{}num_bits' is {}: pack-quantized loads 4- and 8-bit weights", wp,
           bits);
  c.linear_quant = bits == 4 ? WeightQuant::kInt4 : WeightQuant::kInt8;
  const std::string type = get_str_or(w, wp, "type", "int");
  MD_CHECK(type == "int", "config.json: field '{}type' must be \"int\" for pack-quantized, got '{}'",
           wp, type);
  c.quant_asymmetric = !get_bool_or(w, wp, "symmetric", true);
  MD_CHECK(!c.quant_asymmetric || bits == 4,
           "config.json: field '{}symmetric' is false with num_bits 8: asymmetric 8-bit weights "
           "(zero points) are not supported yet (asymmetric 4-bit are)",
           wp);
  MD_CHECK(!get_bool_or(w, wp, "dynamic", false),
           "config.json: field '{}dynamic' must be false (static weight scales)", wp);
  // compressed-tensors' ActivationOrdering: "weight" (alias "static") reorders only the GPTQ pass,
  // the groups stay contiguous (the plain layout); "group" (alias "dynamic") stores a group index
  // per column (weight_g_idx).
  if (auto a = w.find("actorder"); a != w.end() && !a->is_null()) {
    const std::string v = a->is_string() ? a->get<std::string>() : a->dump();
    MD_CHECK(v == "static" || v == "weight" || v == "group" || v == "dynamic",
             "config.json: field '{}actorder' is {}: expected null, \"weight\" (\"static\") or "
             "\"group\" (\"dynamic\")",
             wp, a->dump());
    c.quant_actorder = v == "group" || v == "dynamic";
  }
  const std::string strategy = get_str_or(w, wp, "strategy", "group");
  if (strategy == "channel") {
    MD_CHECK(!c.quant_actorder,
             "config.json: field '{}actorder' is group with strategy channel (one scale a row has "
             "no groups to order)",
             wp);
    c.quant_group = 0;
    return;
  }
  MD_CHECK(strategy == "group",
           "config.json: field '{}strategy' must be \"group\" or \"channel\" for pack-quantized, "
           "got '{}'",
           wp, strategy);
  const int64_t gs = get_int(w, wp, "group_size");
  MD_CHECK(gs >= 32 && gs % 32 == 0 && gs <= (1 << 20),
           "config.json: field '{}group_size' is {}: the int{} kernels need a positive multiple of "
           "32",
           wp, gs, bits);
  c.quant_group = int(gs);
}

// compressed-tensors `quantization_config`: pack-quantized int4 / int8 (W4A16 / W8A16) or
// mxfp4-pack-quantized (4-bit float e2m1 codes, one E8M0 scale per 32 inputs, symmetric, static)
// on the linear layers the `ignore` list leaves. Call after the rest of the config is parsed.

// The block [rows, cols] of an FP8 scale: cols a multiple of 32 (the kernels' sub-groups).
void set_fp8_block(const json& b, const std::string& name, ModelConfig& c) {
  MD_CHECK(b.is_array() && b.size() == 2 && b[0].is_number_integer() && b[1].is_number_integer(),
           "config.json: field '{}' must be a list of two integers, got {}", name, b.dump());
  const int64_t br = b[0].get<int64_t>(), bc = b[1].get<int64_t>();
  MD_CHECK(br >= 1 && br <= (1 << 20) && bc >= 32 && bc % 32 == 0 && bc <= (1 << 20),
           "config.json: field '{}' is [{}, {}]: the FP8 kernels need blocks of a positive number "
           "of rows and a positive multiple of 32 columns",
           name, br, bc);
  c.quant_block_rows = int(br);
  c.quant_group = int(bc);
}

// DeepSeek-style FP8 (`quant_method: "fp8"`, as Kimi K2 and DeepSeek V3 are released): e4m3
// weights, `weight_scale_inv` F32 per block of `weight_block_size`, activations quantized
// dynamically by engines that run W8A8 (here they stay bf16: W8A16).
void parse_fp8(const json& q, const std::string& p, ModelConfig& c) {
  const std::string fmt_ = get_str_or(q, p, "fmt", "e4m3");
  MD_CHECK(fmt_ == "e4m3", "config.json: field '{}fmt' is '{}': only e4m3 FP8 is supported", p,
           fmt_);
  const std::string act = get_str_or(q, p, "activation_scheme", "dynamic");
  MD_CHECK(act == "dynamic",
           "config.json: field '{}activation_scheme' is '{}': static activation scales are not "
           "supported (megadecode keeps activations in bf16)",
           p, act);
  set_fp8_block(field(q, p, "weight_block_size"), p + "weight_block_size", c);
  c.linear_quant = WeightQuant::kFp8;
  c.quant_scale_name = "weight_scale_inv";
  if (auto it = q.find("modules_to_not_convert"); it != q.end() && !it->is_null()) {
    MD_CHECK(it->is_array(), "config.json: field '{}modules_to_not_convert' must be a list", p);
    for (const auto& e : *it) {
      MD_CHECK(e.is_string(), "config.json: field '{}modules_to_not_convert' must hold strings", p);
      c.quant_ignore.push_back(e.get<std::string>());
    }
  }
}

// compressed-tensors float-quantized weights: 8-bit e4m3, symmetric, static scales per channel,
// block or tensor. Activation settings may say dynamic FP8 (W8A8 in engines that run it); they
// stay bf16 here.
void parse_float_weights(const json& g, const std::string& gp, ModelConfig& c) {
  const json& w = field(g, gp, "weights");
  const std::string wp = gp + "weights.";
  MD_CHECK(w.is_object(), "config.json: field '{}weights' must be an object", gp);
  const int64_t bits = get_int(w, wp, "num_bits");
  MD_CHECK(bits == 8, "config.json: field '{}num_bits' must be 8 for float-quantized, got {}", wp,
           bits);
  const std::string type = get_str_or(w, wp, "type", "");
  MD_CHECK(type == "float", "config.json: field '{}type' must be \"float\", got '{}'", wp, type);
  MD_CHECK(get_bool_or(w, wp, "symmetric", true),
           "config.json: field '{}symmetric' must be true for FP8 weights", wp);
  MD_CHECK(!get_bool_or(w, wp, "dynamic", false),
           "config.json: field '{}dynamic' must be false (static weight scales)", wp);
  const std::string strategy = get_str_or(w, wp, "strategy", "channel");
  if (strategy == "block") {
    set_fp8_block(field(w, wp, "block_structure"), wp + "block_structure", c);
  } else {
    MD_CHECK(strategy == "channel" || strategy == "tensor",
             "config.json: field '{}strategy' is '{}': FP8 weights load with channel, block or "
             "tensor scales",
             wp, strategy);
    c.quant_block_rows = strategy == "channel" ? 1 : 0;
    c.quant_group = 0;
  }
  if (auto a = g.find("input_activations"); a != g.end() && !a->is_null())
    MD_CHECK(a->is_object() && get_bool_or(*a, gp + "input_activations.", "dynamic", false),
             "config.json: {}input_activations has static scales: not supported (megadecode "
             "keeps activations in bf16; dynamic activation quantization is ignored)",
             gp);
  MD_CHECK(!g.contains("output_activations") || g["output_activations"].is_null(),
           "config.json: {}output_activations is set: not supported", gp);
  c.linear_quant = WeightQuant::kFp8;
  c.quant_scale_name = "weight_scale";
}

void parse_quantization(const json& q, const std::string& p, ModelConfig& c) {
  const std::string self = p.substr(0, p.size() - 1);
  MD_CHECK(q.is_object(), "config.json: field '{}' must be an object", self);
  const std::string method = get_str_or(q, p, "quant_method", "");
  if (method == "fp8") return parse_fp8(q, p, c);
  MD_CHECK(method == "compressed-tensors",
           "config.json: unsupported {}quant_method '{}' (supported: compressed-tensors, fp8)", p,
           method);
  const std::string format = get_str_or(q, p, "format", "");
  MD_CHECK(format == "mxfp4-pack-quantized" || format == "pack-quantized" ||
               format == "float-quantized",
           "config.json: unsupported {}format '{}' (supported: mxfp4-pack-quantized, "
           "pack-quantized, float-quantized)",
           p, format);
  const std::string status = get_str_or(q, p, "quantization_status", "compressed");
  MD_CHECK(status == "compressed",
           "config.json: {}quantization_status '{}': only compressed checkpoints are supported", p,
           status);
  const json& groups = field(q, p, "config_groups");
  MD_CHECK(groups.is_object() && !groups.empty(),
           "config.json: field '{}config_groups' must be a non-empty object", p);
  MD_CHECK(format == "mxfp4-pack-quantized" || groups.size() == 1,
           "config.json: {}config_groups has {} groups: {} loads one scheme for every quantized "
           "linear",
           p, groups.size(), format);
  for (const auto& [name, g] : groups.items()) {
    const std::string gp = p + "config_groups." + name + ".";
    MD_CHECK(g.is_object(), "config.json: field '{}' must be an object",
             gp.substr(0, gp.size() - 1));
    const std::string gf = get_str_or(g, gp, "format", format);
    MD_CHECK(gf == format, "config.json: {}format '{}' differs from the checkpoint's '{}'", gp, gf,
             format);
    const json& targets = field(g, gp, "targets");
    MD_CHECK(targets == json::array({"Linear"}),
             "config.json: field '{}targets' must be [\"Linear\"], got {}", gp, targets.dump());
    if (format == "float-quantized") {
      parse_float_weights(g, gp, c);
      continue;
    }
    for (const char* k : {"input_activations", "output_activations"})
      MD_CHECK(!g.contains(k) || g[k].is_null(),
               "config.json: {}{} is set: activation quantization is not supported", gp, k);
    const json& w = field(g, gp, "weights");
    const std::string wp = gp + "weights.";
    MD_CHECK(w.is_object(), "config.json: field '{}weights' must be an object", gp);
    if (format == "pack-quantized") {
      parse_int_weights(w, wp, c);
      continue;
    }
    const int64_t bits = get_int(w, wp, "num_bits");
    MD_CHECK(bits == 4, "config.json: field '{}num_bits' must be 4 for MXFP4, got {}", wp, bits);
    const std::string type = get_str_or(w, wp, "type", "");
    MD_CHECK(type == "float", "config.json: field '{}type' must be \"float\" for MXFP4, got '{}'",
             wp, type);
    const int64_t gs = get_int(w, wp, "group_size");
    MD_CHECK(gs == 32, "config.json: field '{}group_size' must be 32 for MXFP4, got {}", wp, gs);
    const std::string strategy = get_str_or(w, wp, "strategy", "group");
    MD_CHECK(strategy == "group",
             "config.json: field '{}strategy' must be \"group\" for MXFP4, got '{}'", wp, strategy);
    MD_CHECK(get_bool_or(w, wp, "symmetric", true),
             "config.json: field '{}symmetric' must be true for MXFP4", wp);
    MD_CHECK(!get_bool_or(w, wp, "dynamic", false),
             "config.json: field '{}dynamic' must be false (static weight scales)", wp);
    const std::string sd = get_str_or(w, wp, "scale_dtype", "torch.uint8");
    MD_CHECK(sd == "torch.uint8",
             "config.json: field '{}scale_dtype' must be \"torch.uint8\" (E8M0), got '{}'", wp, sd);
  }
  c.quant_ignore = parse_ignore(q, p);
  // (Which linears: model/binder.h, by the list; FP8 ones also by their dtype.)
  if (format == "pack-quantized" || format == "float-quantized") return;
  c.linear_quant = WeightQuant::kMxfp4;
  c.quant_group = 32;
  // The routed experts are MXFP4 unless the list names them (K3's release); other linears are
  // when the checkpoint packs them.
  c.experts_mxfp4 =
      c.num_experts > 0 &&
      !quant_ignored(c.quant_ignore, c.tensor_prefix + "model.layers.1.block_sparse_moe.experts.0.w1");
  MD_CHECK(!c.experts_mxfp4 || (c.expert_dim() % 32 == 0 && c.moe_intermediate_size % 32 == 0),
           "config.json: MXFP4 experts need the expert input width ({}) and moe_intermediate_size "
           "({}) to be multiples of the group size 32",
           c.expert_dim(), c.moe_intermediate_size);
}

// The kimi_linear schema: the whole file for Kimi Linear, `text_config` for K3. `p` is the JSON
// path prefix used in messages ("" or "text_config.").
void parse_text(const json& root, const std::string& p, ModelConfig& c) {
  c.vocab_size = positive(get_int(root, p, "vocab_size"), p, "vocab_size");
  c.hidden_size = positive(get_int(root, p, "hidden_size"), p, "hidden_size", 1 << 20);
  c.num_layers = positive(get_int(root, p, "num_hidden_layers"), p, "num_hidden_layers", 4096);
  c.rms_norm_eps = get_num(root, p, "rms_norm_eps");
  MD_CHECK(c.rms_norm_eps > 0 && c.rms_norm_eps < 1,
           "config.json: field 'rms_norm_eps' must be in (0, 1), got {}", c.rms_norm_eps);
  c.tie_word_embeddings = get_bool_or(root, p, "tie_word_embeddings", false);
  const std::string act = get_str_or(root, p, "hidden_act", "silu");
  MD_CHECK(act == "silu" || act == "situ",
           "config.json: unsupported {}hidden_act '{}' (supported: silu, situ)", p, act);
  c.activation = act == "situ" ? Activation::kSitu : Activation::kSilu;
  if (c.uses_situ()) {
    // The official code uses `beta or 1.0` and applies the linear soft cap only when set.
    c.situ_beta = get_num_or(root, p, "activation_situ_beta", 1.0);
    MD_CHECK(c.situ_beta > 0 && std::isfinite(c.situ_beta),
             "config.json: field '{}activation_situ_beta' must be a positive number, got {}", p,
             c.situ_beta);
    c.situ_linear_beta = get_num_or(root, p, "activation_situ_linear_beta", 0.0);
    MD_CHECK(c.situ_linear_beta >= 0 && std::isfinite(c.situ_linear_beta),
             "config.json: field '{}activation_situ_linear_beta' must be null or a positive "
             "number, got {}",
             p, c.situ_linear_beta);
  }

  // Linear attention block. Layer lists are 1-indexed in the released config.
  const json& la = field(root, p, "linear_attn_config");
  MD_CHECK(la.is_object(), "config.json: field 'linear_attn_config' must be an object");
  const std::string lp = p + "linear_attn_config.";
  c.kda_num_heads = positive(get_int(la, lp, "num_heads"), lp, "num_heads", 4096);
  c.kda_head_dim = positive(get_int(la, lp, "head_dim"), lp, "head_dim", 4096);
  c.kda_conv_size = positive(get_int_or(la, lp, "short_conv_kernel_size", 4), lp,
                             "short_conv_kernel_size", cpu::kMaxShortConvWidth);
  auto full = get_int_list(la, lp, "full_attn_layers");
  auto kda = get_int_list(la, lp, "kda_layers");
  c.attn_kind.assign(c.num_layers, AttnKind::KDA);
  std::vector<int> seen(c.num_layers, 0);
  for (auto [list, kind, name] : {std::tuple{&full, AttnKind::MLA, "full_attn_layers"},
                                  std::tuple{&kda, AttnKind::KDA, "kda_layers"}}) {
    for (int64_t l : *list) {
      MD_CHECK(l >= 1 && l <= c.num_layers,
               "config.json: linear_attn_config.{} entry {} is outside 1..{} (the lists are "
               "1-indexed)",
               name, l, c.num_layers);
      MD_CHECK(seen[l - 1] == 0,
               "config.json: layer {} (1-indexed) appears twice in linear_attn_config "
               "full_attn_layers/kda_layers",
               l);
      seen[l - 1] = 1;
      c.attn_kind[l - 1] = kind;
    }
  }
  for (int l = 0; l < c.num_layers; ++l)
    MD_CHECK(seen[l],
             "config.json: layer {} (1-indexed) is in neither full_attn_layers nor "
             "kda_layers",
             l + 1);
  c.kda_full_rank_gate = get_bool_or(la, lp, "use_full_rank_gate", false);
  if (auto it = la.find("gate_lower_bound"); it != la.end() && !it->is_null()) {
    c.kda_bounded_decay = true;
    c.kda_gate_lower_bound = get_num(la, lp, "gate_lower_bound");
    MD_CHECK(c.kda_gate_lower_bound < 0 && c.kda_gate_lower_bound >= -1e4,
             "config.json: field '{}gate_lower_bound' must be negative (a log-decay bound), got {}",
             lp, c.kda_gate_lower_bound);
  }

  // MLA.
  c.mla_num_heads =
      positive(get_int(root, p, "num_attention_heads"), p, "num_attention_heads", 4096);
  int64_t kvh = get_int_or(root, p, "num_key_value_heads", c.mla_num_heads);
  MD_CHECK(kvh == c.mla_num_heads,
           "config.json: num_key_value_heads ({}) must equal num_attention_heads ({}) for MLA", kvh,
           c.mla_num_heads);
  const int64_t qlr = get_int_or(root, p, "q_lora_rank", 0);
  MD_CHECK(qlr >= 0 && qlr <= (1 << 20),
           "config.json: field '{}q_lora_rank' must be null or "
           "positive, got {}",
           p, qlr);
  c.q_lora_rank = static_cast<int>(qlr);
  c.kv_lora_rank = positive(get_int(root, p, "kv_lora_rank"), p, "kv_lora_rank", 1 << 16);
  c.qk_nope_head_dim = positive(get_int(root, p, "qk_nope_head_dim"), p, "qk_nope_head_dim", 4096);
  c.qk_rope_head_dim = positive(get_int(root, p, "qk_rope_head_dim"), p, "qk_rope_head_dim", 4096);
  c.v_head_dim = positive(get_int(root, p, "v_head_dim"), p, "v_head_dim", 4096);
  MD_CHECK(get_bool_or(root, p, "mla_use_nope", true),
           "config.json: mla_use_nope=false (rotary MLA) is not supported; Kimi Linear uses NoPE");
  c.mla_output_gate = get_bool_or(root, p, "mla_use_output_gate", false);

  // FFN / MoE.
  c.intermediate_size = positive(get_int(root, p, "intermediate_size"), p, "intermediate_size");
  int first_dense = static_cast<int>(get_int_or(root, p, "first_k_dense_replace", 1));
  MD_CHECK(first_dense >= 0 && first_dense <= c.num_layers,
           "config.json: first_k_dense_replace ({}) must be in 0..num_hidden_layers ({})",
           first_dense, c.num_layers);
  int64_t freq = get_int_or(root, p, "moe_layer_freq", 1);
  MD_CHECK(freq >= 1, "config.json: moe_layer_freq must be >= 1, got {}", freq);
  c.ffn_kind.assign(c.num_layers, FfnKind::Dense);
  bool any_moe = false;
  for (int l = first_dense; l < c.num_layers; ++l) {
    if ((l - first_dense) % freq == 0) {
      c.ffn_kind[l] = FfnKind::MoE;
      any_moe = true;
    }
  }
  if (any_moe) {
    // The CPU router works in fixed buffers of kMaxRouterExperts (no allocation per token).
    c.num_experts =
        positive(get_int(root, p, "num_experts"), p, "num_experts", cpu::kMaxRouterExperts);
    c.num_experts_per_token =
        positive(get_int(root, p, "num_experts_per_token"), p, "num_experts_per_token", 1 << 16);
    MD_CHECK(c.num_experts_per_token <= c.num_experts,
             "config.json: num_experts_per_token ({}) exceeds num_experts ({})",
             c.num_experts_per_token, c.num_experts);
    c.moe_intermediate_size =
        positive(get_int(root, p, "moe_intermediate_size"), p, "moe_intermediate_size");
    c.num_shared_experts = static_cast<int>(get_int_or(root, p, "num_shared_experts", 0));
    MD_CHECK(c.num_shared_experts >= 0 && c.num_shared_experts <= 64,
             "config.json: num_shared_experts must be in 0..64, got {}", c.num_shared_experts);
    std::string act = get_str_or(root, p, "moe_router_activation_func", "sigmoid");
    MD_CHECK(act == "sigmoid",
             "config.json: unsupported moe_router_activation_func '{}' (supported: sigmoid)", act);
    c.moe_renormalize = get_bool_or(root, p, "moe_renormalize", true);
    c.routed_scaling_factor = get_num_or(root, p, "routed_scaling_factor", 1.0);
    MD_CHECK(c.routed_scaling_factor > 0, "config.json: routed_scaling_factor must be > 0");
    if (get_bool_or(root, p, "use_grouped_topk", false)) {
      c.num_expert_group = positive(get_int_or(root, p, "num_expert_group", 1), p,
                                    "num_expert_group", c.num_experts);
      c.topk_group =
          positive(get_int_or(root, p, "topk_group", 1), p, "topk_group", c.num_expert_group);
      MD_CHECK(c.num_experts % c.num_expert_group == 0,
               "config.json: num_experts ({}) is not divisible by num_expert_group ({})",
               c.num_experts, c.num_expert_group);
      MD_CHECK(c.num_expert_group == 1 || c.num_experts / c.num_expert_group >= 2,
               "config.json: grouped top-k needs at least 2 experts per group");
      MD_CHECK(c.num_experts_per_token <= c.topk_group * (c.num_experts / c.num_expert_group),
               "config.json: num_experts_per_token ({}) exceeds the experts in topk_group groups",
               c.num_experts_per_token);
    }
    // Present (not null) switches the latent MoE on, as in the official code.
    if (auto it = root.find("routed_expert_hidden_size"); it != root.end() && !it->is_null())
      c.latent_size = positive(get_int(root, p, "routed_expert_hidden_size"), p,
                               "routed_expert_hidden_size", 1 << 20);
    c.latent_norm = get_bool_or(root, p, "latent_moe_use_norm", false);
    MD_CHECK(!c.latent_norm || c.latent_size > 0,
             "config.json: {}latent_moe_use_norm is true but routed_expert_hidden_size is not set",
             p);
  }
  if (auto it = root.find("attn_res_block_size"); it != root.end() && !it->is_null())
    c.attn_res_block_size =
        positive(get_int(root, p, "attn_res_block_size"), p, "attn_res_block_size", 1 << 20);

  c.bos_token_id = get_int_or(root, p, "bos_token_id", -1);
  c.pad_token_id = get_int_or(root, p, "pad_token_id", -1);
  if (auto it = root.find("eos_token_id"); it != root.end() && !it->is_null()) {
    if (it->is_array()) {
      c.eos_token_ids = get_int_list(root, p, "eos_token_id");
    } else {
      c.eos_token_ids.push_back(get_int(root, p, "eos_token_id"));
    }
  }
  for (int64_t id : c.eos_token_ids)
    MD_CHECK(id >= 0 && id < c.vocab_size, "config.json: eos_token_id {} is outside the vocabulary",
             id);
  MD_CHECK(c.bos_token_id < c.vocab_size, "config.json: bos_token_id {} is outside the vocabulary",
           c.bos_token_id);
}

}  // namespace

ModelConfig parse_config(const json& root) {
  MD_CHECK(root.is_object(), "config.json: top level must be a JSON object");
  ModelConfig c;
  const std::string type = get_str_or(root, "", "model_type", "");
  if (type == "kimi_linear") {
    c.variant = ModelVariant::kKimiLinear;
    parse_text(root, "", c);
    if (auto it = root.find("quantization_config"); it != root.end() && !it->is_null())
      parse_quantization(*it, "quantization_config.", c);
    return c;
  }
  MD_CHECK(type == "kimi_k3",
           "config.json: unsupported model_type '{}' (supported: kimi_linear, kimi_k3)", type);
  c.variant = ModelVariant::kKimiK3;
  // K3: a multimodal wrapper whose language model is a kimi_linear config under text_config.
  const json& text = field(root, "", "text_config");
  MD_CHECK(text.is_object(), "config.json: field 'text_config' must be an object");
  const std::string inner = get_str_or(text, "text_config.", "model_type", "kimi_linear");
  MD_CHECK(inner == "kimi_linear",
           "config.json: unsupported text_config.model_type '{}' (a kimi_k3 file holds a "
           "kimi_linear text_config)",
           inner);
  json t = text;
  // Token ids and tie_word_embeddings may be given only at the top level.
  for (const char* k : {"bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"})
    if ((!t.contains(k) || t[k].is_null()) && root.contains(k)) t[k] = root[k];
  parse_text(t, "text_config.", c);
  c.tensor_prefix = "language_model.";
  // The released file has quantization_config inside text_config; accept it at the top too.
  if (auto it = text.find("quantization_config"); it != text.end() && !it->is_null())
    parse_quantization(*it, "text_config.quantization_config.", c);
  else if (auto it2 = root.find("quantization_config"); it2 != root.end() && !it2->is_null())
    parse_quantization(*it2, "quantization_config.", c);
  return c;
}

std::string_view model_type_name(ModelVariant v) {
  return v == ModelVariant::kKimiK3 ? "kimi_k3" : "kimi_linear";
}

bool ModelConfig::has_k3_extensions() const {
  return !tensor_prefix.empty() || kda_full_rank_gate || kda_bounded_decay || mla_output_gate ||
         latent_size > 0 || latent_norm || uses_situ() || attn_res_block_size > 0 ||
         experts_mxfp4 || q_lora_rank > 0;
}

ModelConfig parse_config_text(std::string_view text, const std::string& source) {
  // Real configs nest four levels at most. Copying or printing a json value recurses once per
  // level, so a deeply nested document is refused while parsing, before it can exhaust the stack.
  constexpr int kMaxDepth = 64;
  json j;
  try {
    j = json::parse(text, [&](int depth, json::parse_event_t, json&) {
      MD_CHECK(depth <= kMaxDepth, "{}: JSON nested deeper than {} levels", source, kMaxDepth);
      return true;
    });
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", source, e.what());
  }
  try {
    return parse_config(j);
  } catch (const Error& e) {
    fail("{}: {}", source, e.what());
  }
}

ModelConfig load_config_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MD_CHECK(f.good(), "cannot open {}", path);
  std::ostringstream text;
  text << f.rdbuf();
  MD_CHECK(!f.bad(), "{}: read error", path);
  return parse_config_text(text.str(), path);
}

bool quant_ignored(const std::vector<std::string>& ignore, const std::string& module) {
  for (const std::string& s : ignore) {
    if (s.rfind("re:", 0) == 0) {
      // compressed-tensors matches with Python's re.match: anchored at the start.
      if (regex_match_at_start(s.substr(3), module) == 1) return true;
    } else if (s == module || s == "Linear") {
      return true;
    }
  }
  return false;
}

json config_to_json(const ModelConfig& c) {
  json la;
  std::vector<int> full, kda;
  for (int l = 0; l < c.num_layers; ++l)
    (c.attn_kind[l] == AttnKind::MLA ? full : kda).push_back(l + 1);
  la["full_attn_layers"] = full;
  la["kda_layers"] = kda;
  la["num_heads"] = c.kda_num_heads;
  la["head_dim"] = c.kda_head_dim;
  la["short_conv_kernel_size"] = c.kda_conv_size;
  if (c.kda_full_rank_gate) la["use_full_rank_gate"] = true;
  if (c.kda_bounded_decay) la["gate_lower_bound"] = c.kda_gate_lower_bound;
  int first_dense = 0;
  while (first_dense < c.num_layers && c.ffn_kind[first_dense] == FfnKind::Dense) ++first_dense;
  json j = {
      {"architectures", {"KimiLinearForCausalLM"}},
      {"model_type", "kimi_linear"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.mla_num_heads},
      {"num_key_value_heads", c.mla_num_heads},
      {"hidden_act", c.uses_situ() ? "situ" : "silu"},
      {"rms_norm_eps", c.rms_norm_eps},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"linear_attn_config", la},
      {"q_lora_rank", c.q_lora_rank > 0 ? json(c.q_lora_rank) : json(nullptr)},
      {"kv_lora_rank", c.kv_lora_rank},
      {"qk_nope_head_dim", c.qk_nope_head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim},
      {"v_head_dim", c.v_head_dim},
      {"mla_use_nope", true},
      {"num_experts", c.num_experts},
      {"num_experts_per_token", c.num_experts_per_token},
      {"num_shared_experts", c.num_shared_experts},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"moe_router_activation_func", "sigmoid"},
      {"moe_renormalize", c.moe_renormalize},
      {"routed_scaling_factor", c.routed_scaling_factor},
      {"first_k_dense_replace", first_dense},
      {"moe_layer_freq", 1},
      {"use_grouped_topk", true},
      {"num_expert_group", c.num_expert_group},
      {"topk_group", c.topk_group},
      {"bos_token_id", c.bos_token_id},
      {"pad_token_id", c.pad_token_id},
      {"model_max_length", 1048576},
      {"torch_dtype", "bfloat16"},
  };
  if (c.eos_token_ids.size() == 1)
    j["eos_token_id"] = c.eos_token_ids[0];
  else
    j["eos_token_id"] = c.eos_token_ids;
  // K3 extensions, written only when on (a Kimi Linear config stays byte-identical).
  if (c.uses_situ()) {
    j["activation_situ_beta"] = c.situ_beta;
    j["activation_situ_linear_beta"] =
        c.situ_linear_beta > 0 ? json(c.situ_linear_beta) : json(nullptr);
  }
  if (c.mla_output_gate) j["mla_use_output_gate"] = true;
  if (c.latent_size > 0) {
    j["routed_expert_hidden_size"] = c.latent_size;
    j["latent_moe_use_norm"] = c.latent_norm;
  }
  if (c.attn_res_block_size > 0) j["attn_res_block_size"] = c.attn_res_block_size;
  if (c.experts_mxfp4) {
    // The released K3 quantization_config (compressed-tensors, MXFP4 routed experts).
    j["quantization_config"] = {
        {"config_groups",
         {{"group_0",
           {{"format", "mxfp4-pack-quantized"},
            {"input_activations", nullptr},
            {"output_activations", nullptr},
            {"targets", {"Linear"}},
            {"weights",
             {{"actorder", nullptr},
              {"block_structure", nullptr},
              {"dynamic", false},
              {"group_size", 32},
              {"num_bits", 4},
              {"observer", "minmax"},
              {"observer_kwargs", json::object()},
              {"scale_dtype", "torch.uint8"},
              {"strategy", "group"},
              {"symmetric", true},
              {"type", "float"},
              {"zp_dtype", nullptr}}}}}}},
        {"format", "mxfp4-pack-quantized"},
        {"ignore",
         {"re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
          "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"}},
        {"kv_cache_scheme", nullptr},
        {"quant_method", "compressed-tensors"},
        {"quantization_status", "compressed"}};
  }
  if (c.variant != ModelVariant::kKimiK3) return j;
  json top = {{"architectures", {"KimiK3ForConditionalGeneration"}},
              {"model_type", "kimi_k3"},
              {"bos_token_id", c.bos_token_id},
              {"pad_token_id", c.pad_token_id},
              {"tie_word_embeddings", c.tie_word_embeddings},
              {"dtype", "bfloat16"},
              {"text_config", j}};
  top["eos_token_id"] = j["eos_token_id"];
  return top;
}

}  // namespace md
