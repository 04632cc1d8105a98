// `megadecode quantize --model DIR --out DIR2 [--scheme int4|int4-asym|int8|mxfp4] [--quant-group
// 128]
// [--quantize-lm-head]`: writes a bf16 checkpoint's quantization (the load-time quantizer's,
// engine/quantize.h) as a compressed-tensors checkpoint, which loads back to the same bits as
// `--quantize SCHEME` on the original (docs/quantization.md "Writing").
//
// The formats, as compressed-tensors writes them, per quantized linear MODULE:
//  * int4 / int8, `pack-quantized` (PackedQuantizationCompressor): MODULE.weight_packed I32
//    [rows, cols * bits / 32] (pack_to_int32: code q + 2^(bits-1) of column (32/bits) j + i in
//    bits i*bits.. of int32 j, so the little-endian bytes are the kernels' layout),
//    MODULE.weight_scale [rows, cols/group] in the model's dtype (bf16) and MODULE.weight_shape
//    [2]; int4-asym (`symmetric: false`) adds MODULE.weight_zero_point I32 [ceil(rows/8),
//    cols/group], packed along the rows (pack_to_int32 with packed_dim 0: code z + 8 of row 8i + j
//    in bits 4j.. of int32 [i, g]), as vLLM's compressed-tensors WNA16 loader reads it;
//  * MXFP4, `mxfp4-pack-quantized`: MODULE.weight_packed U8 [rows, cols/2] (two e2m1 codes a
//    byte, low nibble first) and MODULE.weight_scale U8 [rows, cols/32] (E8M0), as Kimi K3's
//    release stores its experts.
// config.json gains a quantization_config (quant_method compressed-tensors, the format, one config
// group targeting Linear, and an `ignore` list naming every linear left in bf16). Every other
// tensor and file is copied as is.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "common.h"
#include "megadecode/base/error.h"
#include "megadecode/engine/model.h"
#include "megadecode/engine/quantize.h"
#include "megadecode/model/safetensors.h"

namespace md::cli {

namespace fs = std::filesystem;

namespace {

nlohmann::json quantization_config(QuantScheme scheme, int group,
                                   const std::vector<std::string>& ignore) {
  const bool mx = scheme == QuantScheme::kMxfp4;
  const char* format = mx ? "mxfp4-pack-quantized" : "pack-quantized";
  nlohmann::json w = {{"num_bits", scheme == QuantScheme::kInt8 ? 8 : 4},
                      {"type", mx ? "float" : "int"},
                      {"symmetric", scheme != QuantScheme::kInt4Asym},
                      {"strategy", group ? "group" : "channel"},
                      {"group_size", group ? nlohmann::json(group) : nlohmann::json(nullptr)},
                      {"dynamic", false},
                      {"actorder", nullptr},
                      {"block_structure", nullptr},
                      {"observer", "minmax"},
                      {"observer_kwargs", nlohmann::json::object()}};
  if (mx) w["scale_dtype"] = "torch.uint8";
  return {{"quant_method", "compressed-tensors"},
          {"format", format},
          {"quantization_status", "compressed"},
          {"config_groups",
           {{"group_0",
             {{"targets", {"Linear"}},
              {"weights", w},
              {"input_activations", nullptr},
              {"output_activations", nullptr},
              {"format", format}}}}},
          {"ignore", ignore},
          {"kv_cache_scheme", nullptr}};
}

// Mat::zero_points (z = zc - 8, int8 [rows][groups]) as compressed-tensors packs them: codes
// zc = z + 8 along the rows, eight to an int32 from the least significant nibble (a partial last
// int32 padded with zero nibbles).
void pack_zero_points(const Mat& q, uint8_t* out) {
  const int64_t groups = q.cols / q.group;
  std::memset(out, 0, size_t((q.rows + 7) / 8 * groups) * 4);
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int zc = q.zero_points[r * groups + g] + 8;
      uint8_t& byte = out[(size_t(r / 8) * size_t(groups) + size_t(g)) * 4 + size_t(r % 8) / 2];
      byte = static_cast<uint8_t>(byte | (r % 2 ? zc << 4 : zc));
    }
}

}  // namespace

void register_quantize(CLI::App& app) {
  struct Opts {
    RunFlags f;
    std::string out, scheme = "int4";
    bool force = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "quantize", "write a bf16 checkpoint's quantization as a compressed-tensors checkpoint");
  o->f.add(c);
  c->add_option("--out", o->out, "the directory to write")->required();
  c->add_option("--scheme", o->scheme,
                "int4 or int8 (pack-quantized, W4A16 / W8A16, bf16 scale per --quant-group "
                "columns), int4-asym (the same with a zero point per group) or mxfp4 "
                "(mxfp4-pack-quantized, E8M0 scale per 32)")
      ->check(CLI::IsMember({"int4", "int4-asym", "int8", "mxfp4"}));
  c->add_flag("--force", o->force, "overwrite an existing checkpoint in --out");
  c->callback([o] {
    MD_CHECK(o->f.quantize == "none" || o->f.quantize == o->scheme,
             "quantize: --quantize {} differs from --scheme {} (--scheme says what to write)",
             o->f.quantize, o->scheme);
    const QuantScheme scheme = *parse_quant_scheme(o->scheme);
    MD_CHECK(o->f.tp * o->f.ep == 1, "quantize: runs in one process (no --tp / --ep)");
    MD_CHECK(fs::path(o->out) != fs::path(o->f.model) &&
                 fs::weakly_canonical(o->out) != fs::weakly_canonical(o->f.model),
             "quantize: --out must differ from --model");
    MD_CHECK(o->force || !fs::exists(fs::path(o->out) / "config.json"),
             "quantize: {} already holds a checkpoint (--force to overwrite)", o->out);
    const ModelConfig source_cfg = load_config_file((fs::path(o->f.model) / "config.json").string());
    MD_CHECK(source_cfg.linear_quant == WeightQuant::kNone && !source_cfg.experts_mxfp4,
             "quantize: {} is already quantized (its config.json has a quantization_config)",
             o->f.model);
    RunFlags f = o->f;
    f.quantize = o->scheme;
    LoadedModel lm = load_model(f, /*with_tokenizer=*/false);
    const Model& model = *lm.model;
    const QuantizeReport& rep = model.quantize_report();
    MD_CHECK(!(f.quant_lm_head && model.config().tie_word_embeddings),
             "quantize: --quantize-lm-head with tied embeddings would quantize the embedding "
             "table too");
    std::map<const void*, const Mat*> by_source;
    for (const QuantizeReport::Done& d : rep.done) by_source[d.source] = &d.quantized;

    // The tensors to write: each quantized one as its three, the others as they are.
    const Checkpoint& ck = model.checkpoint();
    std::vector<TensorSpec> specs;
    std::map<std::string, const TensorInfo*> copied;
    std::map<std::string, const Mat*> packed;  // module -> its quantized matrix
    std::vector<std::string> ignore;
    size_t matched = 0;
    for (const auto& [name, t] : ck.tensors()) {
      const bool weight = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
      const std::string module = weight ? name.substr(0, name.size() - 7) : name;
      const auto it = weight ? by_source.find(t.data) : by_source.end();
      if (it != by_source.end() && t.shape.size() == 2 && t.shape[0] == it->second->rows &&
          t.shape[1] == it->second->cols && t.dtype == DType::BF16) {
        const Mat& q = *it->second;
        if (q.mxfp4()) {
          specs.push_back({module + ".weight_packed", DType::U8, {q.rows, q.cols / 2}});
          specs.push_back({module + ".weight_scale", DType::U8, {q.rows, q.cols / 32}});
        } else {
          specs.push_back(
              {module + ".weight_packed", DType::I32, {q.rows, q.cols * q.code_bits() / 32}});
          specs.push_back({module + ".weight_scale", DType::BF16, {q.rows, q.cols / q.group}});
          specs.push_back({module + ".weight_shape", DType::I64, {2}});
          if (q.zero_points)
            specs.push_back(
                {module + ".weight_zero_point", DType::I32, {(q.rows + 7) / 8, q.cols / q.group}});
        }
        packed[module] = &q;
        ++matched;
        continue;
      }
      specs.push_back({name, t.dtype, t.shape});
      copied[name] = &t;
      // A linear layer left in bf16 (or any 2-D weight): named in `ignore`.
      if (weight && t.shape.size() == 2) ignore.push_back(module);
    }
    MD_CHECK(matched == rep.done.size(),
             "quantize: {} of the {} quantized matrices are not whole checkpoint tensors; this "
             "checkpoint cannot be written as compressed-tensors",
             rep.done.size() - matched, rep.done.size());
    const int group = rep.group;

    // Wider elements first, as Hugging Face's safetensors writer orders tensors: packed back to
    // back they all stay aligned to their element size (an I64 weight_shape after an odd number
    // of bf16 scales would not be).
    std::stable_sort(specs.begin(), specs.end(), [](const TensorSpec& a, const TensorSpec& b) {
      return dtype_size(a.dtype) > dtype_size(b.dtype);
    });
    fs::create_directories(o->out);
    write_checkpoint(o->out, specs, [&](const TensorSpec& s, uint8_t* out) {
      if (auto cp = copied.find(s.name); cp != copied.end()) {
        std::memcpy(out, cp->second->data, s.nbytes());
        return;
      }
      const size_t dot = s.name.rfind('.');
      const std::string module = s.name.substr(0, dot), part = s.name.substr(dot + 1);
      const Mat& q = *packed.at(module);
      if (part == "weight_packed") {
        std::memcpy(out, q.data, size_t(q.rows) * q.code_row_bytes());
      } else if (part == "weight_scale") {
        std::memcpy(out, q.scales, size_t(q.rows) * q.scale_row_bytes());
      } else if (part == "weight_zero_point") {
        pack_zero_points(q, out);
      } else {
        const int64_t shape[2] = {q.rows, q.cols};
        std::memcpy(out, shape, sizeof shape);
      }
    });

    // config.json with the quantization_config; every other file (tokenizer, templates,
    // generation config) copied.
    std::ifstream in(fs::path(o->f.model) / "config.json");
    nlohmann::ordered_json cfg = nlohmann::ordered_json::parse(in);
    cfg["quantization_config"] = quantization_config(scheme, group, ignore);
    std::ofstream(fs::path(o->out) / "config.json") << cfg.dump(2) << "\n";
    for (const auto& e : fs::directory_iterator(o->f.model)) {
      const std::string n = e.path().filename().string();
      if (!e.is_regular_file() || n == "config.json" || n == "model.safetensors.index.json" ||
          e.path().extension() == ".safetensors")
        continue;
      fs::copy_file(e.path(), fs::path(o->out) / n, fs::copy_options::overwrite_existing);
    }
    std::printf("wrote %s: %d matrices in %s (group %s), %zu linear weights left as loaded "
                "(quantization_config.ignore), %.3f GB -> %.3f GB of quantized weights\n",
                o->out.c_str(), rep.matrices, o->scheme.c_str(),
                group ? std::to_string(group).c_str() : "per row",
                ignore.size(), rep.bytes_before / 1e9, rep.bytes_after / 1e9);
  });
}

}  // namespace md::cli
