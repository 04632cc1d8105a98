// `megadecode quantize --model DIR --out DIR2 [--quant-group 128] [--quantize-lm-head]`: writes a
// bf16 checkpoint's int4 quantization (the load-time quantizer's, engine/quantize.h) as a
// compressed-tensors `pack-quantized` checkpoint, which loads back to the same bits as
// `--quantize int4` on the original (docs/quantization.md "Writing").
//
// The format, as compressed-tensors' PackedQuantizationCompressor writes it: per quantized linear
// MODULE, MODULE.weight_packed I32 [rows, cols/8] (pack_to_int32: code q + 8 of column 8j + i in
// bits 4i..4i+3 of int32 j, so the little-endian bytes are the int4 kernels' layout),
// MODULE.weight_scale [rows, cols/group] in the model's dtype (bf16) and MODULE.weight_shape
// [2]; config.json gains a quantization_config (quant_method compressed-tensors, format
// pack-quantized, one config group targeting Linear with 4-bit symmetric int weights, and an
// `ignore` list naming every linear left in bf16). Every other tensor and file is copied as is.
#include <fmt/format.h>

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

nlohmann::json quantization_config(int group, const std::vector<std::string>& ignore) {
  nlohmann::json w = {{"num_bits", 4},
                      {"type", "int"},
                      {"symmetric", true},
                      {"strategy", group ? "group" : "channel"},
                      {"group_size", group ? nlohmann::json(group) : nlohmann::json(nullptr)},
                      {"dynamic", false},
                      {"actorder", nullptr},
                      {"block_structure", nullptr},
                      {"observer", "minmax"},
                      {"observer_kwargs", nlohmann::json::object()}};
  return {{"quant_method", "compressed-tensors"},
          {"format", "pack-quantized"},
          {"quantization_status", "compressed"},
          {"config_groups",
           {{"group_0",
             {{"targets", {"Linear"}},
              {"weights", w},
              {"input_activations", nullptr},
              {"output_activations", nullptr},
              {"format", "pack-quantized"}}}}},
          {"ignore", ignore},
          {"kv_cache_scheme", nullptr}};
}

}  // namespace

void register_quantize(CLI::App& app) {
  struct Opts {
    RunFlags f;
    std::string out;
    bool force = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "quantize", "write a bf16 checkpoint's int4 quantization as a compressed-tensors checkpoint");
  o->f.add(c);
  c->add_option("--out", o->out, "the directory to write")->required();
  c->add_flag("--force", o->force, "overwrite an existing checkpoint in --out");
  c->callback([o] {
    MD_CHECK(o->f.quantize == "none" || o->f.quantize == "int4",
             "quantize: --quantize {}: the writer writes int4", o->f.quantize);
    MD_CHECK(o->f.tp * o->f.ep == 1, "quantize: runs in one process (no --tp / --ep)");
    MD_CHECK(fs::path(o->out) != fs::path(o->f.model) &&
                 fs::weakly_canonical(o->out) != fs::weakly_canonical(o->f.model),
             "quantize: --out must differ from --model");
    MD_CHECK(o->force || !fs::exists(fs::path(o->out) / "config.json"),
             "quantize: {} already holds a checkpoint (--force to overwrite)", o->out);
    const ModelConfig source_cfg = load_config_file((fs::path(o->f.model) / "config.json").string());
    MD_CHECK(source_cfg.int4_group < 0 && !source_cfg.experts_mxfp4,
             "quantize: {} is already quantized (its config.json has a quantization_config)",
             o->f.model);
    RunFlags f = o->f;
    f.quantize = "int4";
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
    std::map<std::string, const Mat*> packed;  // module -> its int4 matrix
    std::vector<std::string> ignore;
    size_t matched = 0;
    for (const auto& [name, t] : ck.tensors()) {
      const bool weight = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
      const std::string module = weight ? name.substr(0, name.size() - 7) : name;
      const auto it = weight ? by_source.find(t.data) : by_source.end();
      if (it != by_source.end() && t.shape.size() == 2 && t.shape[0] == it->second->rows &&
          t.shape[1] == it->second->cols && t.dtype == DType::BF16) {
        const Mat& q = *it->second;
        specs.push_back({module + ".weight_packed", DType::I32, {q.rows, q.cols / 8}});
        specs.push_back({module + ".weight_scale", DType::BF16, {q.rows, q.cols / q.group}});
        specs.push_back({module + ".weight_shape", DType::I64, {2}});
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
             "checkpoint cannot be written as pack-quantized",
             rep.done.size() - matched, rep.done.size());
    const int group = model.options().quantize.group;

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
      } else {
        const int64_t shape[2] = {q.rows, q.cols};
        std::memcpy(out, shape, sizeof shape);
      }
    });

    // config.json with the quantization_config; every other file (tokenizer, templates,
    // generation config) copied.
    std::ifstream in(fs::path(o->f.model) / "config.json");
    nlohmann::ordered_json cfg = nlohmann::ordered_json::parse(in);
    cfg["quantization_config"] = quantization_config(group, ignore);
    std::ofstream(fs::path(o->out) / "config.json") << cfg.dump(2) << "\n";
    for (const auto& e : fs::directory_iterator(o->f.model)) {
      const std::string n = e.path().filename().string();
      if (!e.is_regular_file() || n == "config.json" || n == "model.safetensors.index.json" ||
          e.path().extension() == ".safetensors")
        continue;
      fs::copy_file(e.path(), fs::path(o->out) / n, fs::copy_options::overwrite_existing);
    }
    std::printf("wrote %s: %d matrices in int4 (group %s), %zu linear weights left as loaded "
                "(quantization_config.ignore), %.3f GB -> %.3f GB of quantized weights\n",
                o->out.c_str(), rep.matrices, group ? std::to_string(group).c_str() : "per row",
                ignore.size(), rep.bytes_before / 1e9, rep.bytes_after / 1e9);
  });
}

}  // namespace md::cli
