#include "common.h"

#include <unistd.h>

#include <charconv>
#include <cstdio>

#include <filesystem>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/kernels/cpu/qdot.h"
#include "megadecode/spec/dspark_drafter.h"
#include "megadecode/spec/ngram_drafter.h"

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
  app->add_option("--quantize", quantize,
                  "quantize the bf16 projections and experts at load: none, int4 or int8 (W4A16 "
                  "/ W8A16, symmetric, group-wise bf16 scales), int4-asym (int4 with a zero point "
                  "per group) or mxfp4 (e2m1 codes, E8M0 scale per 32; docs/quantization.md)")
      ->check(CLI::IsMember({"none", "int4", "int4-asym", "int8", "mxfp4"}));
  app->add_option("--quant-group", quant_group,
                  "--quantize int4/int8: columns per scale, a multiple of 32 (default 128; 0: one "
                  "scale per row); MXFP4's is 32")
      ->check(CLI::Range(-1, 1 << 20));
  app->add_flag("--quantize-lm-head", quant_lm_head, "--quantize: the output head too");
  app->add_option(
         "--act-quant", act_quant,
         "none, int8 or int16: the int4 / int8 / MXFP4 linears take their activations quantized "
         "to int8 (W4A8 / W8A8, as llama.cpp's CPU kernels do) or int16 per 32 columns and run "
         "as integer dot products (AVX-512 VNNI or AVX2): faster than the fp32 kernels; int8 "
         "adds the activations' rounding, int16 a 1/64770 of each 32 columns' largest value "
         "(docs/quantization.md)")
      ->check(CLI::IsMember({"none", "int8", "int16"}));
  app->add_flag("--no-mmap", no_mmap,
                "copy the weights into memory on 2 MiB pages instead of mapping the files (as "
                "llama.cpp's flag): faster decode where the page cache holds the files in 4 KiB "
                "pages, at the cost of reading them in at start (docs/architecture.md)");
  app->add_option("--tp", tp,
                  "distributed (under mpirun -np tp*ep): attention heads, dense and shared-expert "
                  "channels and the vocabulary over all ranks, routed experts tp ways inside each "
                  "expert (docs/distributed.md)")
      ->check(CLI::Range(1, 4096));
  app->add_option("--ep", ep,
                  "distributed: routed experts ep ways by expert (world = tp x ep ranks)")
      ->check(CLI::Range(1, 4096));
}

ModelOptions RunFlags::options() const {
  ModelOptions o;
  o.precision = precision == "fp32" ? Precision::FP32 : Precision::BF16;
  o.threads = threads;
  o.router_biased_weights = biased_router;
  o.states = states;
  o.quantize.scheme = *parse_quant_scheme(quantize);
  o.quantize.group = quant_group;
  o.quantize.lm_head = quant_lm_head;
  o.quantize.progress = true;
  o.quantize.int_act_bits = act_quant == "int8" ? 8 : act_quant == "int16" ? 16 : 0;
  o.load.mode = no_mmap ? WeightLoad::kCopy : WeightLoad::kMap;
  return o;
}

namespace {
bool g_follower = false;
}  // namespace

bool follower_rank() {
  return g_follower;
}

void print_quantize_report(const Model& m) {
  const QuantizeReport& q = m.quantize_report();
  if (follower_rank()) return;
  if (q.matrices > 0) {
    std::fprintf(stderr, "quantized %d matrices to %s (%s): %s -> %s in %.1f s\n", q.matrices,
                 std::string(quant_scheme_name(m.options().quantize.scheme)).c_str(),
                 q.group ? ("group " + std::to_string(q.group)).c_str() : "per row",
                 human_bytes(q.bytes_before).c_str(), human_bytes(q.bytes_after).c_str(),
                 q.seconds);
    if (q.drawn > 0)
      std::fprintf(stderr, "(%d of them random weights generated on the device: their codes and "
                   "scales are drawn at random in the format, not quantized from bf16 values)\n",
                   q.drawn);
    if (q.kept > 0)
      std::fprintf(stderr, "kept %d matrices as loaded (the group does not divide their columns, "
                   "e.g. %s)\n", q.kept, q.first_kept.c_str());
  }
  if (q.int_activation_matrices > 0)
    std::fprintf(stderr,
                 "int%d activations (integer dot products, %s kernel) for %d int4 / int8 / MXFP4 "
                 "matrices\n",
                 int(m.options().quantize.int_act_bits), cpu::matmul_qdot_isa(),
                 q.int_activation_matrices);
}

LoadedModel load_model(const RunFlags& f, bool with_tokenizer) {
  LoadedModel lm;
  bool tty = isatty(2);
  double t0 = now_seconds();
  if (int64_t(f.tp) * f.ep > 1) {
    // A distributed run: every rank loads its slice; rank 0 alone writes to stdout (the others'
    // output would repeat it), errors come from any rank on stderr.
    lm.comm = dist::mpi_communicator();
    dist::Shard shard;
    shard.layout = {f.tp, f.ep};
    shard.rank = lm.comm->rank();
    MD_CHECK(lm.comm->size() == shard.world(),
             "--tp {} --ep {} needs {} ranks, and this run has {} (mpirun -np {} megadecode ...)",
             f.tp, f.ep, shard.world(), lm.comm->size(), shard.world());
    if (shard.rank != 0) {
      tty = false;
      g_follower = true;
      MD_CHECK(std::freopen("/dev/null", "w", stdout) != nullptr,
               "rank {}: cannot silence stdout", shard.rank);
    }
    if (tty) std::fprintf(stderr, "loading %s (%s) ...", f.model.c_str(),
                          dist::describe_shard(shard).c_str());
    lm.model = std::make_unique<Model>(f.model, f.options(), shard, lm.comm.get());
  } else {
    if (tty) std::fprintf(stderr, "loading %s ...", f.model.c_str());
    ModelOptions o = f.options();
    if (tty && f.no_mmap) {
      o.load.progress = [&](double done, double total) {
        std::fprintf(stderr, "\rloading %s: copying %5.1f%% of %s", f.model.c_str(),
                     100.0 * done / total, human_bytes(total).c_str());
      };
    }
    lm.model = std::make_unique<Model>(f.model, o);
  }
  if (with_tokenizer)
    lm.tokenizer =
        std::make_unique<Tokenizer>(Tokenizer::load(f.model, lm.model->config().vocab_size));
  // (A rank of a distributed run reads only its slices: touching the whole checkpoint would make
  // all of it resident. Quantization read its sources already and let their pages go.)
  const QuantizeReport& q = lm.model->quantize_report();
  if (tty && q.matrices > 0 && !follower_rank()) std::fprintf(stderr, "\n");
  print_quantize_report(*lm.model);
  bool touched = false;
  if (tty && !lm.model->shard().sharded() && q.matrices == 0 && !f.no_mmap) {
    lm.model->touch_weights([&](double done, double total) {
      std::fprintf(stderr, "\rloading %s: %5.1f%% of %s", f.model.c_str(), 100.0 * done / total,
                   human_bytes(total).c_str());
    });
    touched = true;
  }
  if (tty) std::fprintf(stderr, " (%.1f s)\n", now_seconds() - t0);
  // Every page is in now: a large model mapped mostly on 4 KiB pages decodes measurably slower
  // (bench/RESULTS.md, "Weights on huge pages"), and only the page cache's history decides it.
  const Checkpoint& ck = lm.model->checkpoint();
  if (touched && ck.file_bytes() >= (size_t{1} << 30)) {
    const double share = double(ck.huge_page_bytes()) / double(ck.file_bytes());
    if (share < 0.5)
      std::fprintf(stderr,
                   "note: %.0f%% of the weights are on 2 MiB pages (the page cache holds the files "
                   "in small pages); --no-mmap copies them onto huge pages, which decodes faster\n",
                   100.0 * share);
  }
  return lm;
}

void SpeculativeFlags::add(CLI::App* app) {
  app->add_option("--speculative", speculative,
                  "speculative decoding: ngram (prompt lookup: the continuation of the longest "
                  "recent n-gram match) or a DSpark draft checkpoint directory (as --draft)");
  app->add_option("--draft", draft,
                  "speculative decoding with the DSpark draft checkpoint in this directory "
                  "(make-model --draft-for)");
  k_opt = app->add_option("--num-draft-tokens", num_draft_tokens,
                  "speculative: tokens drafted per step, 1..15 (default: 7 with a draft model, "
                  "4 with ngram)");
  fixed_opt = app->add_option("--fixed-acceptance-length", fixed_acceptance_length,
                  "speculative benchmark mode: every step accepts exactly N drafts (0..K) "
                  "whatever the target says, to measure the step's cost; the output is then "
                  "not the model's");
  app->add_option("--ngram-max", ngram_max,
                  "speculative ngram: the longest suffix n-gram looked up, 1..16");
  app->add_option("--draft-on", draft_on,
                  "where the DSpark draft runs: executor (its draft plan on the executor's "
                  "workers, where the backend runs draft plans; default) or host (the draft's "
                  "own forward)");
}

std::string SpeculativeFlags::draft_dir() const {
  if (!draft.empty()) return draft;
  return speculative == "ngram" ? std::string() : speculative;
}

void SpeculativeFlags::validate() const {
  MD_CHECK(speculative.empty() || draft.empty(),
           "--speculative and --draft exclude each other (give one drafter)");
  const bool k_given = num_draft_tokens != 0 || (k_opt && k_opt->count() > 0);
  const bool fixed_given = fixed_acceptance_length != -1 || (fixed_opt && fixed_opt->count() > 0);
  if (!enabled()) {
    MD_CHECK(!k_given, "--num-draft-tokens needs --speculative or --draft");
    MD_CHECK(!fixed_given, "--fixed-acceptance-length needs --speculative or --draft");
    return;
  }
  const std::string dir = draft_dir();
  if (!speculative.empty() && speculative != "ngram")
    MD_CHECK(std::filesystem::is_directory(speculative),
             "--speculative '{}': expected ngram or a draft checkpoint directory", speculative);
  if (!dir.empty())
    MD_CHECK(std::filesystem::exists(std::filesystem::path(dir) / "config.json"),
             "--draft {}: no config.json there (make one with make-model --draft-for)", dir);
  MD_CHECK(!k_given || (num_draft_tokens >= 1 && num_draft_tokens <= kMaxDraftTokens),
           "--num-draft-tokens {} is not in 1..{}", num_draft_tokens, kMaxDraftTokens);
  MD_CHECK(ngram_max >= 1 && ngram_max <= 16, "--ngram-max {} is not in 1..16", ngram_max);
  MD_CHECK(draft_on == "executor" || draft_on == "host",
           "--draft-on '{}': expected executor or host", draft_on);
  const SpeculativeOptions o = options();
  MD_CHECK(!fixed_given ||
               (fixed_acceptance_length >= 0 && fixed_acceptance_length <= o.num_draft_tokens),
           "--fixed-acceptance-length {} is not in 0..{} (--num-draft-tokens)",
           fixed_acceptance_length, o.num_draft_tokens);
}

SpeculativeOptions SpeculativeFlags::options() const {
  SpeculativeOptions o;
  o.num_draft_tokens = num_draft_tokens > 0 ? num_draft_tokens : draft_dir().empty() ? 4 : 7;
  o.fixed_acceptance_length = fixed_acceptance_length;
  return o;
}

LoadedDrafter load_drafter(const SpeculativeFlags& f, Model& target, Executor* executor) {
  f.validate();
  LoadedDrafter d;
  d.options = f.options();
  validate(d.options);
  d.ngram = NgramOptions{f.ngram_max};
  d.on_host = f.draft_on == "host";
  d.executor = executor;
  const std::string dir = f.draft_dir();
  if (!dir.empty())
    d.model = std::make_unique<DraftModel>(dir, target.config(), target.options(), &target.pool());
  d.drafter = d.make();
  return d;
}

std::unique_ptr<Drafter> LoadedDrafter::make(Executor* ex) const {
  if (model) return std::make_unique<DSparkDrafter>(*model, on_host ? nullptr : ex ? ex : executor);
  return std::make_unique<NgramDrafter>(ngram);
}

// `s` cut at `sep`, each piece trimmed of spaces.
std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(sep, i);
    if (j == std::string::npos) j = s.size();
    std::string t = s.substr(i, j - i);
    while (!t.empty() && t.front() == ' ') t.erase(t.begin());
    while (!t.empty() && t.back() == ' ') t.pop_back();
    out.push_back(t);
    i = j + 1;
  }
  return out;
}

// A comma-separated list of integers in lo..hi (an error names the flag).
std::vector<int> parse_ints(const std::string& flag, const std::string& list, int lo, int hi) {
  std::vector<int> out;
  for (const std::string& t : split(list, ',')) {
    char* end = nullptr;
    const long v = std::strtol(t.c_str(), &end, 10);
    MD_CHECK(!t.empty() && end && *end == '\0' && v >= lo && v <= hi,
             "{}: '{}' is not an integer in {}..{}", flag, t, lo, hi);
    out.push_back(int(v));
  }
  return out;
}

}  // namespace md::cli
