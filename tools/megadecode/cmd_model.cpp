// make-model, logits, generate, inspect.
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "common.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/exec/executor.h"
#include "megadecode/model/presets.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/spec/draft_model.h"
#include "megadecode/tokenizer/bpe_train.h"
#include "megadecode/tokenizer/chat_template.h"

namespace md::cli {

namespace {

void print_logits_line(int64_t pos, const float* v, int64_t n, bool continued = false) {
  std::string s = fmt::format("{}\"pos\": {}, \"logits\": [", continued ? "" : "{", pos);
  s.reserve(size_t(n) * 12);
  for (int64_t i = 0; i < n; ++i) {
    if (i) s += ", ";
    // Shortest representation that reads back to the same float32.
    s += fmt::format("{}", v[i]);
  }
  s += "]}\n";
  std::fwrite(s.data(), 1, s.size(), stdout);
}

int64_t argmax(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

}  // namespace

void register_make_model(CLI::App& app) {
  struct Opts {
    std::string preset, out, draft_for, aux_layers;
    uint64_t seed = 1;
    int shards = 1, draft_layers = 0;
    bool force = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "make-model", "write a random-weight checkpoint of a preset, or a speculative draft for one");
  auto* preset = c->add_option("--preset", o->preset,
                               "tiny | small | kl48-e32 | kl48 (Kimi Linear) | k3-tiny | k3-small "
                               "| k3-slice (Kimi K3)");
  auto* draft_for = c->add_option(
      "--draft-for", o->draft_for,
      "instead of a preset: a random DSpark draft (docs/speculative.md) matched to the target "
      "checkpoint in this directory, sized like the seed's draft for Kimi K3");
  preset->excludes(draft_for);
  auto* draft_layers = c->add_option("--draft-layers", o->draft_layers,
                                     "with --draft-for: the draft's layers (default 5)");
  draft_layers->check(CLI::Range(1, 64))->needs(draft_for);
  c->add_option("--aux-layers", o->aux_layers,
                "with --draft-for: comma-separated target layer ids whose input hidden states the "
                "draft reads (default: the seed's 24,48,72,88,92 of 93 scaled to the target)")
      ->needs(draft_for);
  c->add_option("--seed", o->seed, "random seed (same seed, same bytes)");
  c->add_option("--out", o->out, "output directory")->required();
  c->add_option("--shards", o->shards, "number of safetensors shards")->check(CLI::Range(1, 999));
  c->add_flag("--force", o->force, "overwrite an existing checkpoint in --out");
  c->callback([o] {
    namespace fs = std::filesystem;
    MD_CHECK(!o->preset.empty() || !o->draft_for.empty(),
             "make-model: give --preset or --draft-for");
    if (!o->draft_for.empty()) {
      const ModelConfig target =
          load_config_file((fs::path(o->draft_for) / "config.json").string());
      std::vector<int> aux;
      if (!o->aux_layers.empty())
        for (int32_t id : parse_ids(o->aux_layers)) aux.push_back(int(id));
      const DraftConfig d = draft_config_for_target(target, o->draft_layers, aux);
      MD_CHECK(o->force || !fs::exists(fs::path(o->out) / "config.json"),
               "{} already holds a checkpoint (use --force to overwrite)", o->out);
      ThreadPool pool(0, false);
      make_random_draft(d, o->out, o->seed, pool);
      int64_t params = 0;
      for (const TensorSpec& t : expected_draft_tensors(d)) {
        int64_t n = 1;
        for (int64_t x : t.shape) n *= x;
        params += n;
      }
      std::printf(
          "wrote %s: DSpark draft for %s, seed %llu, %d layers, aux layers %s, %.3f B "
          "parameters\n",
          o->out.c_str(), o->draft_for.c_str(), (unsigned long long)o->seed, d.num_layers,
          fmt::format("{}", fmt::join(d.aux_layer_ids, ",")).c_str(), double(params) / 1e9);
      return;
    }
    ModelConfig cfg = preset_config(o->preset);
    MD_CHECK(o->force || !fs::exists(fs::path(o->out) / "config.json"),
             "{} already holds a checkpoint (use --force to overwrite)", o->out);
    ThreadPool pool(0, false);
    make_random_checkpoint(cfg, o->out, o->seed, o->shards, pool, isatty(2));
    // A real tokenizer (BPE trained on a built-in corpus) so the checkpoint runs end to end from
    // text. Kimi Linear: Kimi's special tokens and its chat template. Kimi K3: K3's special tokens
    // and no template, as the released checkpoint (the generator recognises K3 by its structure
    // tokens); its config eos is <|end_of_msg|>, where generation stops.
    const int32_t ranks = int32_t(cfg.vocab_size - 256);
    const bool k3 = cfg.variant == ModelVariant::kKimiK3;
    const std::vector<SpecialToken> specials =
        k3 ? kimi_k3_tokenizer_specials(ranks, cfg.vocab_size)
           : kimi_special_tokens(ranks, cfg.vocab_size);
    if (k3) {
      const auto eom = std::find_if(specials.begin(), specials.end(), [](const SpecialToken& t) {
        return t.content == kKimiK3EndOfMessage;
      });
      MD_CHECK(eom != specials.end() && cfg.eos_token_ids == std::vector<int64_t>{eom->id},
               "preset {}: eos_token_id is not the id of {}", o->preset, kKimiK3EndOfMessage);
    }
    write_tokenizer_files(o->out, train_bpe(builtin_training_corpus(), ranks), cfg.vocab_size,
                          k3 ? std::string() : kimi_linear_chat_template(), specials);
    ModelSizes s = model_sizes(cfg);
    std::printf("wrote %s: preset %s, seed %llu, %.3f B parameters, %s\n", o->out.c_str(),
                o->preset.c_str(), (unsigned long long)o->seed, double(s.total_params) / 1e9,
                human_bytes(s.total_bytes).c_str());
  });
}

void register_run_commands(CLI::App& app) {
  {
    struct Opts {
      RunFlags f;
      std::string ids, batch_ids, executor = "reference";
      int prefill = -1, workers = 0, rows = 0;
    };
    auto o = std::make_shared<Opts>();
    auto* c = app.add_subcommand("logits", "print the logits at every position as JSON lines");
    o->f.add(c);
    auto* ids_opt = c->add_option("--ids", o->ids, "comma-separated token ids");
    auto* batch_opt = c->add_option(
        "--batch-ids", o->batch_ids,
        "several sequences decoded as one batch: id lists separated by ';' (e.g. \"1,2,3;4,5;6\"); "
        "lines then carry \"seq\"; a sequence leaves the batch when its ids run out");
    ids_opt->excludes(batch_opt);
    c->add_option("--prefill", o->prefill,
                  "how many leading ids (of each sequence) go through one prefill call (default: "
                  "all); the rest are decoded one step at a time");
    c->add_option("--executor", o->executor,
                  "what decodes: reference (Model::forward, one sequence at a time), megakernel "
                  "or opbyop (the decode plan)")
        ->check(CLI::IsMember({"reference", "megakernel", "opbyop"}));
    c->add_option("--workers", o->workers, "executor workers (0: one per CPU)")
        ->check(CLI::Range(0, 4096));
    auto* rows_opt = c->add_option(
        "--rows", o->rows,
        "feed every id, the prompt included, through the plan this many tokens per sequence per "
        "step (needs --executor megakernel|opbyop; a step's row count is the smallest of this "
        "and what every sequence in it has left)");
    rows_opt->check(CLI::Range(1, 64));
    c->callback([o] {
      MD_CHECK(!o->ids.empty() || !o->batch_ids.empty(), "logits: give --ids or --batch-ids");
      MD_CHECK(o->rows == 0 || o->executor != "reference",
               "logits: --rows runs the plan; give --executor megakernel or opbyop");
      MD_CHECK(o->rows == 0 || o->prefill < 0,
               "logits: --rows feeds every id through the plan; --prefill does not apply");
      const bool batched = !o->batch_ids.empty();
      std::vector<std::vector<int32_t>> lists;
      if (batched) {
        size_t i = 0;
        while (i <= o->batch_ids.size()) {
          size_t j = o->batch_ids.find(';', i);
          if (j == std::string::npos) j = o->batch_ids.size();
          lists.push_back(parse_ids(o->batch_ids.substr(i, j - i)));
          i = j + 1;
        }
        MD_CHECK(lists.size() <= 1024, "--batch-ids: {} sequences (at most 1024)", lists.size());
      } else {
        lists.push_back(parse_ids(o->ids));
        const int n = int(lists[0].size());
        MD_CHECK(o->prefill <= n, "--prefill {} must be in 0..{} (the number of ids)", o->prefill,
                 n);
      }
      MD_CHECK(o->prefill >= -1, "--prefill {} must not be negative", o->prefill);
      LoadedModel lm = load_model(o->f, /*with_tokenizer=*/false);
      Model& m = *lm.model;
      if (!m.weights().note.empty()) std::fprintf(stderr, "%s\n", m.weights().note.c_str());
      const int64_t V = m.config().vocab_size;
      const size_t S = lists.size();
      std::unique_ptr<Executor> ex;
      if (o->executor != "reference") {
        ExecutorOptions eo;
        eo.workers = o->workers;
        eo.states = o->f.states;
        eo.device = o->f.device_kind();
        ex = make_executor(m, parse_executor_kind(o->executor), int(S), eo);
      }
      auto print = [&](size_t seq, int64_t pos, const float* v) {
        if (batched) std::printf("{\"seq\": %zu, ", seq);
        print_logits_line(pos, v, V, batched);
      };
      std::vector<SequenceState> states;
      std::vector<size_t> cursor(S);
      std::vector<float> logits;
      for (size_t s = 0; s < S; ++s) {
        const int n = int(lists[s].size());
        const int p = o->rows > 0 ? 0 : o->prefill < 0 ? n : std::min(o->prefill, n);
        states.push_back(ex ? ex->new_sequence() : m.new_sequence());
        if (p > 0 && ex && m.shard().sharded()) {
          // A distributed rank: the prompt through the plan (every row's logits), in steps of
          // up to 16 rows (the reference path runs whole models only).
          for (int i = 0; i < p; i += 16) {
            const int r = std::min(16, p - i);
            const StepSeq q{&states.back(), std::span(lists[s]).subspan(size_t(i), size_t(r)),
                            LogitRows::kAll};
            logits.resize(size_t(r) * size_t(V));
            ex->step(std::span(&q, 1), logits.data());
            for (int j = 0; j < r; ++j) print(s, i + j, logits.data() + int64_t(j) * V);
          }
        } else if (p > 0) {
          // The prompt through the reference path, then (with an executor) into its pool.
          SequenceState ref = ex ? m.new_sequence() : SequenceState();
          SequenceState& into = ex ? ref : states.back();
          logits.resize(size_t(p) * size_t(V));
          m.forward(into, std::span(lists[s].data(), size_t(p)), logits.data(), true);
          if (ex) states.back().copy_from(ref);
          for (int i = 0; i < p; ++i) print(s, i, logits.data() + int64_t(i) * V);
        }
        cursor[s] = size_t(p);
      }
      for (;;) {
        std::vector<size_t> active;
        for (size_t s = 0; s < S; ++s)
          if (cursor[s] < lists[s].size()) active.push_back(s);
        if (active.empty()) break;
        if (o->rows > 0) {
          // R rows per sequence, every row's logits.
          size_t R = size_t(o->rows);
          for (size_t s : active) R = std::min(R, lists[s].size() - cursor[s]);
          std::vector<StepSeq> q;
          for (size_t s : active)
            q.push_back(
                StepSeq{&states[s], std::span(lists[s]).subspan(cursor[s], R), LogitRows::kAll});
          logits.resize(active.size() * R * size_t(V));
          ex->step(q, logits.data());
          for (size_t a = 0; a < active.size(); ++a)
            for (size_t i = 0; i < R; ++i)
              print(active[a], int64_t(cursor[active[a]] + i),
                    logits.data() + (a * R + i) * size_t(V));
          for (size_t s : active) cursor[s] += R;
          continue;
        }
        std::vector<SequenceState*> seqs;
        std::vector<int32_t> toks;
        for (size_t s : active) {
          seqs.push_back(&states[s]);
          toks.push_back(lists[s][cursor[s]]);
        }
        logits.resize(active.size() * size_t(V));
        if (ex) {
          ex->step(seqs, toks, logits.data());
        } else {
          for (size_t a = 0; a < active.size(); ++a)
            m.forward(*seqs[a], std::span(&toks[a], 1), logits.data() + a * size_t(V), false);
        }
        for (size_t a = 0; a < active.size(); ++a) {
          const size_t s = active[a];
          print(s, int64_t(cursor[s]), logits.data() + a * size_t(V));
          ++cursor[s];
        }
      }
    });
  }
  {
    struct Opts {
      RunFlags f;
      SpeculativeFlags spec;
      std::string ids, executor = "reference";
      int max_tokens = 16, workers = 0, prefill_chunk = 16;
      bool ignore_eos = false;
    };
    auto o = std::make_shared<Opts>();
    auto* c = app.add_subcommand("generate", "greedy generation from token ids; prints ids");
    o->f.add(c);
    c->add_option("--ids", o->ids, "comma-separated prompt token ids")->required();
    c->add_option("--max-tokens", o->max_tokens, "tokens to generate")
        ->check(CLI::Range(0, 1 << 24));
    c->add_flag("--ignore-eos", o->ignore_eos, "keep generating after an end-of-sequence id");
    auto* exec_opt =
        c->add_option("--executor", o->executor,
                      "what runs: reference (Model::forward) or megakernel / opbyop (the plan: the "
                      "prompt in chunks of --prefill-chunk rows, then greedy decode steps); "
                      "speculative decoding runs on a plan executor (default megakernel)")
            ->check(CLI::IsMember({"reference", "megakernel", "opbyop"}));
    o->spec.add(c);
    c->add_option("--workers", o->workers, "executor workers (0: one per CPU)")
        ->check(CLI::Range(0, 4096));
    c->add_option("--prefill-chunk", o->prefill_chunk, "token rows per plan step of the prompt")
        ->check(CLI::Range(1, 64));
    c->callback([o, exec_opt] {
      std::vector<int32_t> ids = parse_ids(o->ids);
      MD_CHECK(!ids.empty(), "generate: --ids is empty");
      o->spec.validate();
      if (o->spec.enabled()) {
        MD_CHECK(!(exec_opt->count() > 0 && o->executor == "reference"),
                 "speculative decoding (--speculative / --draft) needs a plan executor: "
                 "--executor megakernel or opbyop");
        if (o->executor == "reference") o->executor = "megakernel";
      }
      LoadedModel lm = load_model(o->f, /*with_tokenizer=*/false);
      Model& m = *lm.model;
      if (!m.weights().note.empty()) std::fprintf(stderr, "%s\n", m.weights().note.c_str());
      const ModelConfig& cfg = m.config();
      for (int32_t id : ids)
        MD_CHECK(id >= 0 && id < cfg.vocab_size, "token id {} is outside the vocabulary [0, {})",
                 id, cfg.vocab_size);
      std::unique_ptr<Executor> ex;
      if (o->executor != "reference") {
        ExecutorOptions eo;
        eo.workers = o->workers;
        eo.states = o->f.states;
        eo.device = o->f.device_kind();
        ex = make_executor(m, parse_executor_kind(o->executor), 1, eo);
      }
      SequenceState s = ex ? ex->new_sequence() : m.new_sequence();
      std::vector<float> logits(size_t(cfg.vocab_size));
      if (o->spec.enabled()) {
        // Greedy speculative decoding: the same ids as the plain loop below.
        LoadedDrafter d = load_drafter(o->spec, m, ex.get());
        d.options.prefill_chunk = o->prefill_chunk;
        SpeculativeDecoder dec(*ex, *d.drafter, d.options);
        const double t0 = now_seconds();
        dec.prefill(s, ids, logits.data());
        const double t1 = now_seconds();
        std::vector<int32_t> history = ids;
        int n = 0;
        auto emit = [&](int32_t next) {
          std::printf("%s%d", n++ ? " " : "", next);
          std::fflush(stdout);
          const bool eos = std::find(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end(),
                                     next) != cfg.eos_token_ids.end();
          return !(eos && !o->ignore_eos) && n < o->max_tokens;
        };
        if (o->max_tokens > 0) {
          history.push_back(int32_t(argmax(logits.data(), cfg.vocab_size)));
          try {
            if (emit(history.back()))
              while (dec.step(s, history, nullptr, emit)) {
              }
          } catch (const Error&) {
            std::printf("\n");
            std::fflush(stdout);
            throw;
          }
        }
        const double t2 = now_seconds();
        std::printf("\n");
        std::fflush(stdout);
        const SpeculativeStats& st = dec.stats();
        std::fprintf(stderr,
                     "prefill %zu tokens: %.1f ms; decode %d tokens: %.2f tok/s; speculative "
                     "(%s, K=%d): %lld steps, %lld of %lld drafts accepted, %.2f tokens a step\n",
                     ids.size(), (t1 - t0) * 1e3, n, n > 1 ? double(n - 1) / (t2 - t1) : 0.0,
                     std::string(d.drafter->name()).c_str(), d.options.num_draft_tokens,
                     (long long)st.steps, (long long)st.accepted, (long long)st.drafted,
                     st.tokens_per_step());
        return;
      }
      double t0 = now_seconds();
      if (ex)
        ex->prefill(s, ids, logits.data(), o->prefill_chunk);
      else
        m.forward(s, ids, logits.data(), false);
      double t1 = now_seconds();
      std::vector<int32_t> out;
      int32_t planned = -1;  // the plan's in-step greedy pick
      for (int i = 0; i < o->max_tokens; ++i) {
        int32_t next = planned >= 0 ? planned : int32_t(argmax(logits.data(), cfg.vocab_size));
        out.push_back(next);
        std::printf("%s%d", i ? " " : "", next);
        std::fflush(stdout);
        bool eos = std::find(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end(), next) !=
                   cfg.eos_token_ids.end();
        if ((eos && !o->ignore_eos) || i + 1 == o->max_tokens) break;
        try {
          if (ex) {
            SequenceState* sp = &s;
            ex->step(std::span(&sp, 1), std::span(&next, 1), logits.data(), &planned);
          } else {
            m.forward(s, std::span(&next, 1), logits.data(), false);
          }
        } catch (const Error&) {
          std::printf("\n");  // end the ids line before the error (e.g. the state pool is full)
          std::fflush(stdout);
          throw;
        }
      }
      double t2 = now_seconds();
      std::printf("\n");
      std::fflush(stdout);  // the ids line before the stats on stderr
      if (!follower_rank())  // (every rank of a distributed run measures the same)
        std::fprintf(stderr, "prefill %zu tokens: %.1f ms; decode %zu tokens: %.2f tok/s\n",
                   ids.size(), (t1 - t0) * 1e3, out.size(),
                   out.size() > 1 ? double(out.size() - 1) / (t2 - t1) : 0.0);
    });
  }
  {
    auto o = std::make_shared<std::string>();
    auto* c = app.add_subcommand("inspect", "architecture summary, parameters, bytes per token");
    c->add_option("--model", *o, "checkpoint directory")->required();
    c->callback([o] {
      namespace fs = std::filesystem;
      ModelConfig cfg = load_config_file((fs::path(*o) / "config.json").string());
      Checkpoint ck(*o);
      ModelWeights w = bind_weights(cfg, ck);  // validates every tensor
      if (!w.note.empty()) std::fprintf(stderr, "%s\n", w.note.c_str());
      ModelSizes s = model_sizes(cfg);
      std::string pattern;
      for (int l = 0; l < cfg.num_layers; ++l)
        pattern += cfg.attn_kind[l] == AttnKind::MLA ? 'M' : 'K';
      std::printf("model          %s (%s)\n", o->c_str(),
                  std::string(model_type_name(cfg.variant)).c_str());
      std::printf("layers         %d: %d KDA + %d MLA  [%s]  (K = KDA, M = MLA)\n", cfg.num_layers,
                  cfg.num_kda_layers(), cfg.num_mla_layers(), pattern.c_str());
      std::printf("hidden         %lld, vocab %lld, eps %g\n", (long long)cfg.hidden_size,
                  (long long)cfg.vocab_size, cfg.rms_norm_eps);
      std::printf("KDA            %d heads x %d, conv %d\n", cfg.kda_num_heads, cfg.kda_head_dim,
                  cfg.kda_conv_size);
      if (cfg.kda_full_rank_gate || cfg.kda_bounded_decay)
        std::printf("KDA gates      output %s; decay %s\n",
                    cfg.kda_full_rank_gate ? "full-rank g_proj" : "low-rank g_a/g_b",
                    cfg.kda_bounded_decay
                        ? fmt::format("lower-bounded ({})", cfg.kda_gate_lower_bound).c_str()
                        : "softplus");
      std::printf(
          "MLA            %d heads, %s, kv_lora %d, nope %d, rope %d (NoPE), v %d%s\n",
          cfg.mla_num_heads,
          cfg.q_lora_rank > 0 ? fmt::format("q_lora {}", cfg.q_lora_rank).c_str() : "plain q_proj",
          cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
          cfg.mla_output_gate ? ", output gate" : "");
      std::printf("MoE            %d experts, top-%d, %d shared, intermediate %lld, scale %g\n",
                  cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts,
                  (long long)cfg.moe_intermediate_size, cfg.routed_scaling_factor);
      if (cfg.latent_size > 0 || cfg.experts_mxfp4)
        std::printf("experts        %s%s%s\n",
                    cfg.latent_size > 0 ? fmt::format("latent {}{}", cfg.latent_size,
                                                      cfg.latent_norm ? " (normed)" : "")
                                              .c_str()
                                        : "hidden width",
                    cfg.experts_mxfp4 ? ", MXFP4 (4.25 bits per weight)" : ", bf16", "");
      if (cfg.linear_quant == WeightQuant::kInt4 || cfg.linear_quant == WeightQuant::kInt8 ||
          cfg.linear_quant == WeightQuant::kFp8 ||
          (cfg.linear_quant == WeightQuant::kMxfp4 && !cfg.experts_mxfp4)) {
        const char* format = cfg.linear_quant == WeightQuant::kInt4   ? "int4"
                             : cfg.linear_quant == WeightQuant::kInt8 ? "int8"
                             : cfg.linear_quant == WeightQuant::kFp8  ? "FP8 e4m3"
                                                                      : "MXFP4";
        std::string scales =
            cfg.linear_quant == WeightQuant::kMxfp4 ? "E8M0 scale per 32 columns"
            : cfg.linear_quant == WeightQuant::kFp8
                ? fmt::format("fp32 scale per {} x {}",
                              cfg.quant_block_rows ? std::to_string(cfg.quant_block_rows) + " rows"
                                                   : std::string("all rows"),
                              cfg.quant_group ? std::to_string(cfg.quant_group) + " columns"
                                              : std::string("whole rows"))
            : cfg.quant_group ? fmt::format("bf16 scale per {} columns", cfg.quant_group)
                              : std::string("bf16 scale per row");
        if (cfg.quant_asymmetric) scales += ", zero points";
        if (cfg.quant_actorder) scales += ", activation-ordered groups (g_idx)";
        std::printf("quantized      linears not in the ignore list (%zu entries): %s, %s\n",
                    cfg.quant_ignore.size(), format, scales.c_str());
      }
      std::printf("activation     %s\n", cfg.uses_situ()
                                             ? fmt::format("SiTU (beta {}, linear beta {})",
                                                           cfg.situ_beta, cfg.situ_linear_beta)
                                                   .c_str()
                                             : "SiLU");
      if (cfg.attn_res_block_size > 0)
        std::printf("residuals      block attention residuals, block size %d (%d blocks)\n",
                    cfg.attn_res_block_size,
                    (cfg.num_layers + cfg.attn_res_block_size - 1) / cfg.attn_res_block_size);
      std::printf("parameters     %.3f B total, %.3f B active per token\n",
                  double(s.total_params) / 1e9, double(s.active_params) / 1e9);
      std::printf("weights        %s on disk (%s in checkpoint files)\n",
                  human_bytes(s.total_bytes).c_str(),
                  human_bytes(double(ck.total_bytes())).c_str());
      std::printf("decode bytes   %s of weights per token at batch 1\n",
                  human_bytes(s.active_bytes).c_str());
      std::printf("state          KDA %s per sequence; MLA cache %s per token\n",
                  human_bytes(s.kda_state_bytes).c_str(),
                  human_bytes(s.mla_cache_bytes_per_token).c_str());
    });
  }
}

}  // namespace md::cli
