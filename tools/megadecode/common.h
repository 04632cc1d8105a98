// Shared helpers for the megadecode subcommands.
#pragma once
#include "megadecode/exec/executor.h"
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include <memory>

#include "megadecode/dist/communicator.h"
#include "megadecode/engine/model.h"
#include "megadecode/spec/draft_model.h"
#include "megadecode/spec/drafter.h"
#include "megadecode/spec/ngram_drafter.h"
#include "megadecode/spec/speculative.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace md::cli {

// Parses "1,2,3" into ids; a malformed list is an md::Error naming the bad element.
std::vector<int32_t> parse_ids(const std::string& s);
// `s` cut at `sep`, each piece trimmed of spaces (an empty s gives one empty piece).
std::vector<std::string> split(const std::string& s, char sep);
// A comma-separated list of integers in lo..hi; md::Error naming `flag` otherwise.
std::vector<int> parse_ints(const std::string& flag, const std::string& list, int lo, int hi);

// Flags every model-running command shares.
struct RunFlags {
  std::string model;
  std::string precision = "bf16";
  int threads = 0;
  bool biased_router = false;
  PoolOptions states;  // --max-sequences, --cache-tokens, --page-tokens
  std::string device = "cpu";  // --device: where the plan executors run
  // --tp / --ep: a distributed run under mpirun (dist/shard.h), world = tp x ep ranks.
  int tp = 1, ep = 1;
  // --quantize / --quant-group / --quantize-lm-head: load-time quantization (engine/quantize.h).
  std::string quantize = "none";
  int quant_group = -1;  // -1: the scheme's default (engine/quantize.h)
  bool quant_lm_head = false;
  std::string act_quant = "none";  // --act-quant none | int8
  // --no-mmap: copy the checkpoint into huge-page memory instead of mapping it.
  bool no_mmap = false;
  DeviceKind device_kind() const { return parse_device_kind(device); }
  void add(CLI::App* app, bool model_required = true);
  ModelOptions options() const;
};

// A model and its tokenizer, loaded with a progress line on a TTY (the weights' pages are read in
// once so the first tokens are not slowed by page faults).
struct LoadedModel {
  // A distributed run's communicator (MPI_COMM_WORLD): declared first, so that it outlives the
  // model whose plans use it.
  std::unique_ptr<dist::Communicator> comm;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
};
LoadedModel load_model(const RunFlags& f, bool with_tokenizer = true);
// What load-time quantization did (QuantizeReport) on stderr; nothing when it did nothing, or on
// a follower rank.
void print_quantize_report(const Model& m);
// True on the ranks other than 0 of a distributed run (after load_model): their stdout is
// silenced, and reports every rank would repeat (timings, statistics) are left to rank 0.
bool follower_rank();

// Speculative decoding flags (run, chat, generate, bench): --speculative ngram (or a draft
// directory), --draft DIR, --num-draft-tokens, --fixed-acceptance-length, --ngram-max,
// --draft-on.
struct SpeculativeFlags {
  std::string speculative, draft;
  int num_draft_tokens = 0;  // 0: the drafter's default (DSpark 7, as the seed's 8-row verify;
                             // n-gram 4)
  int fixed_acceptance_length = -1;
  int ngram_max = 3;
  std::string draft_on = "executor";  // --draft-on executor | host
  CLI::Option *k_opt = nullptr, *fixed_opt = nullptr;  // given on the command line?
  void add(CLI::App* app);
  bool enabled() const { return !speculative.empty() || !draft.empty(); }
  // The draft directory (--draft, or --speculative naming one), empty for n-gram drafting.
  std::string draft_dir() const;
  // Checked options (an md::Error naming the flag otherwise); call only when enabled().
  SpeculativeOptions options() const;
  // Checks the flags' combination (values, one drafter, options that need a drafter).
  void validate() const;
};

// A drafter made from the flags, for a target model (the DSpark draft loaded and checked
// against it, on the target's threads).
struct LoadedDrafter {
  std::unique_ptr<DraftModel> model;
  std::unique_ptr<Drafter> drafter;
  SpeculativeOptions options;
  NgramOptions ngram;
  // Where a DSpark draft runs: the executor's draft plans (when it runs them and not
  // on_host), else the host.
  Executor* executor = nullptr;
  bool on_host = false;
  // Another drafter of the same kind (serve: one per sequence), sharing the loaded draft model;
  // valid while this LoadedDrafter lives. ex (if not null) replaces `executor`.
  std::unique_ptr<Drafter> make(Executor* ex = nullptr) const;
};
// The drafter runs its draft on `executor` when that runs draft plans and --draft-on is
// "executor" (the default), else on the host.
LoadedDrafter load_drafter(const SpeculativeFlags& f, Model& target, Executor* executor = nullptr);

void register_make_model(CLI::App& app);
void register_text_commands(CLI::App& app);  // run, chat, tokenize, detokenize
void register_run_commands(CLI::App& app);   // logits, generate, inspect
void register_bench(CLI::App& app);
void register_plan(CLI::App& app);  // plan
void register_serve(CLI::App& app);  // serve
void register_serve_bench(CLI::App& app);  // serve-bench
void register_quant_eval(CLI::App& app);   // quant-eval
void register_quantize(CLI::App& app);     // quantize

}  // namespace md::cli
