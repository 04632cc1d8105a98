// libFuzzer harness for config.json parsing (md::parse_config_text). Any input must parse into a
// self-consistent ModelConfig or be rejected with md::Error; another exception, a sanitizer report
// or a broken invariant is a finding. An accepted config must also survive what make-model does
// with it: config_to_json and parsing that again.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string_view>

#include "megadecode/base/error.h"
#include "megadecode/model/config.h"

namespace {

void check(bool ok) {
  if (!ok) abort();
}

void check_consistent(const md::ModelConfig& c) {
  check(c.num_layers > 0);
  check(c.attn_kind.size() == static_cast<size_t>(c.num_layers));
  check(c.ffn_kind.size() == static_cast<size_t>(c.num_layers));
  check(c.num_kda_layers() + c.num_mla_layers() == c.num_layers);
  check(c.vocab_size > 0 && c.hidden_size > 0 && c.rms_norm_eps > 0);
  check(c.num_experts_per_token <= c.num_experts);
  for (int64_t id : c.eos_token_ids) check(id >= 0 && id < c.vocab_size);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  md::ModelConfig c;
  try {
    c = md::parse_config_text(text, "fuzz-input");
  } catch (const md::Error&) {
    return 0;
  }
  check_consistent(c);
  // config_to_json writes one FFN pattern (moe_layer_freq 1), so only the attention layout and
  // the sizes are compared; a written config that does not parse again is a finding.
  md::ModelConfig again;
  try {
    again = md::parse_config(md::config_to_json(c));
  } catch (const md::Error&) {
    abort();
  }
  check_consistent(again);
  check(again.variant == c.variant && again.attn_kind == c.attn_kind);
  check(again.vocab_size == c.vocab_size && again.hidden_size == c.hidden_size);
  check(again.experts_mxfp4 == c.experts_mxfp4 && again.latent_size == c.latent_size);
  check(again.eos_token_ids == c.eos_token_ids);
  return 0;
}
