// The DSpark draft's tensors: binding (and the expected specs, from one walk), and make-model's
// random draft (model/draft_weights.h).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "megadecode/base/error.h"
#include "megadecode/base/threads.h"
#include "megadecode/model/binder.h"
#include "megadecode/model/presets.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/model/draft_weights.h"

namespace md {

namespace {

// The seed's weight_shapes (kimi/dspark.py), in its order; matrices [out, in].
DraftWeights walk(const DraftConfig& c, Binder& b) {
  const int64_t D = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  DraftWeights w;
  w.embed = b.mat("embed_tokens.weight", V, D);
  w.lm_head = b.mat("lm_head.weight", V, D);
  w.fc = b.mat("fc.weight", D, c.context_width());
  w.hidden_norm = b.vec("hidden_norm.weight", {D});
  w.final_norm = b.vec("norm.weight", {D});
  w.markov_w1 = b.mat("markov_head.markov_w1.weight", V, c.markov_rank);
  w.markov_w2 = b.mat("markov_head.markov_w2.weight", V, c.markov_rank);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    DraftLayerWeights L;
    L.input_norm = b.vec(p + "input_layernorm.weight", {D});
    L.post_attn_norm = b.vec(p + "post_attention_layernorm.weight", {D});
    L.q = b.mat(p + "self_attn.q_proj.weight", c.q_width(), D);
    L.k = b.mat(p + "self_attn.k_proj.weight", c.kv_width(), D);
    L.v = b.mat(p + "self_attn.v_proj.weight", c.kv_width(), D);
    L.o = b.mat(p + "self_attn.o_proj.weight", D, c.q_width());
    L.q_norm = b.vec(p + "self_attn.q_norm.weight", {c.head_dim});
    L.k_norm = b.vec(p + "self_attn.k_norm.weight", {c.head_dim});
    L.mlp = bind_ffn(b, p + "mlp.", "gate_proj", "up_proj", "down_proj", D, I);
    w.layers.push_back(std::move(L));
  }
  return w;
}

}  // namespace

DraftWeights bind_draft_weights(const DraftConfig& c, const Checkpoint& ckpt) {
  Binder b(&ckpt, nullptr);
  DraftWeights w = walk(c, b);
  b.check_no_extra();
  return w;
}

std::vector<TensorSpec> expected_draft_tensors(const DraftConfig& c) {
  std::vector<TensorSpec> specs;
  Binder b(nullptr, &specs);
  walk(c, b);
  return specs;
}

void make_random_draft(const DraftConfig& c, const std::string& dir, uint64_t seed,
                       ThreadPool& pool) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  MD_CHECK(!ec, "cannot create directory {}: {}", dir, ec.message());
  const std::vector<TensorSpec> specs = expected_draft_tensors(c);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < specs.size(); ++i) index[specs[i].name] = i;
  // make-model's recipes (model/presets.h) pick the scale from the name: norms 1 + U, embeddings
  // unit, lm_head 3 / sqrt(in), other matrices 1 / sqrt(in). They read only name-independent
  // fields of the target config for these names, so an empty one serves. The Markov factors get
  // w1 ~ unit and w2 ~ 1 / sqrt(rank): a bias of unit spread against logits of spread ~3, large
  // enough to change drafts, which the tests need to see the bias at work.
  const ModelConfig none;
  auto recipe = [&](const TensorSpec& t) {
    RandomInit r = random_init(t, none, seed, index.at(t.name));
    const bool w1 = t.name == "markov_head.markov_w1.weight";
    if (w1 || t.name == "markov_head.markov_w2.weight") {
      const double sd = w1 ? 1.0 : 1.0 / std::sqrt(double(c.markov_rank));
      r.mean = 0;
      r.half = sd * std::sqrt(3.0);
    }
    return r;
  };
  write_checkpoint(dir, specs, [&](const TensorSpec& t, uint8_t* out) {
    const RandomInit in = recipe(t);
    pool.parallel_for(in.chunks(), [&](size_t c0, size_t c1) {
      for (size_t k = c0; k < c1; ++k) fill_random_chunk(in, k, out);
    });
  });
  std::ofstream f(fs::path(dir) / "config.json");
  f << draft_config_to_json(c).dump(2) << "\n";
  MD_CHECK(f.good(), "cannot write {}/config.json", dir);
}

}  // namespace md
