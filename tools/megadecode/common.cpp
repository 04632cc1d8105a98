#include "common.h"

#include <unistd.h>

#include <charconv>
#include <cstdio>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"

namespace md::cli {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string tok = s.substr(i, j - i);
    while (!tok.empty() && tok.front() == ' ') tok.erase(tok.begin());
    while (!tok.empty() && tok.back() == ' ') tok.pop_back();
    int64_t v = 0;
    auto [p, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), v);
    MD_CHECK(!tok.empty() && ec == std::errc() && p == tok.data() + tok.size() && v >= 0 &&
                 v <= INT32_MAX,
             "--ids: '{}' is not a non-negative integer token id", tok);
    ids.push_back(int32_t(v));
    i = j + 1;
  }
  return ids;
}

void RunFlags::add(CLI::App* app, bool model_required) {
  auto* o = app->add_option("--model", model, "checkpoint directory (config.json + safetensors)");
  if (model_required) o->required();
  app->add_option("--precision", precision,
                  "activation rounding: bf16 (as the official bf16 model) or fp32")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app->add_option("--threads", threads, "worker threads (0: one per CPU)")
      ->check(CLI::Range(0, 1024));
  app->add_flag("--router-biased-weights", biased_router,
                "take expert weights from the bias-corrected scores (original remote code)");
  app->add_option("--max-sequences", states.max_sequences,
                  "state pool: sequences that can be live at once (each holds a slot of KDA "
                  "state, conv cache and row log)")
      ->check(CLI::Range(1, 65536));
  app->add_option("--cache-tokens", states.cache_tokens,
                  "state pool: latent-cache tokens shared by all sequences (0: 16384 per "
                  "sequence)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 31));
  app->add_option("--page-tokens", states.page_rows,
                  "state pool: tokens per latent-cache page (a multiple of 16)")
      ->check(CLI::Range(16, 4096));
  app->add_option("--device", device,
                  "where the plan executors run: cpu, cuda (a GPU), or cuda-sim (the CUDA kernels "
                  "on the host simulation of the CUDA execution model; slow, for checking)")
      ->check(CLI::IsMember({"cpu", "cuda", "cuda-sim"}));
}

ModelOptions RunFlags::options() const {
  ModelOptions o;
  o.precision = precision == "fp32" ? Precision::FP32 : Precision::BF16;
  o.threads = threads;
  o.router_biased_weights = biased_router;
  o.states = states;
  return o;
}

LoadedModel load_model(const RunFlags& f, bool with_tokenizer) {
  LoadedModel lm;
  const bool tty = isatty(2);
  double t0 = now_seconds();
  if (tty) std::fprintf(stderr, "loading %s ...", f.model.c_str());
  lm.model = std::make_unique<Model>(f.model, f.options());
  if (with_tokenizer)
    lm.tokenizer =
        std::make_unique<Tokenizer>(Tokenizer::load(f.model, lm.model->config().vocab_size));
  if (tty) {
    lm.model->touch_weights([&](double done, double total) {
      std::fprintf(stderr, "\rloading %s: %5.1f%% of %s", f.model.c_str(), 100.0 * done / total,
                   human_bytes(total).c_str());
    });
    std::fprintf(stderr, " (%.1f s)\n", now_seconds() - t0);
  }
  return lm;
}

}  // namespace md::cli
