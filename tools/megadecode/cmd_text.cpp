// Text commands: run, chat, tokenize, detokenize.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common.h"
#include "megadecode/base/error.h"
#include "megadecode/server/chat_constraints.h"
#include "megadecode/server/request.h"
#include "megadecode/server/structured_outputs.h"
#include "megadecode/text/generator.h"

namespace md::cli {

namespace {

struct SamplingFlags {
  SamplingParams p;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_ids;
  bool ignore_eos = false;
  void add(CLI::App* c) {
    p.temperature = 0.7f;
    p.max_tokens = 256;
    c->add_option("--max-tokens,-n", p.max_tokens, "tokens to generate at most");
    c->add_option("--temperature,-t", p.temperature, "0 = greedy");
    c->add_option("--top-k", p.top_k, "keep the k most likely tokens (0 = off)");
    c->add_option("--top-p", p.top_p, "nucleus sampling threshold (1 = off)");
    c->add_option("--min-p", p.min_p, "drop tokens below min-p x the top probability");
    c->add_option("--repetition-penalty", p.repetition_penalty, "1 = off");
    c->add_option("--presence-penalty", p.presence_penalty, "-2..2");
    c->add_option("--frequency-penalty", p.frequency_penalty, "-2..2");
    c->add_option("--seed", p.seed, "sampling seed (same seed, same output)");
    c->add_option("--stop", stop, "stop string (repeatable)");
    c->add_option("--stop-id", stop_ids, "stop token id (repeatable)");
    c->add_flag("--ignore-eos", ignore_eos, "do not stop at the end-of-sequence/message tokens");
  }
  SamplingParams params(const Generator& g) const {
    SamplingParams q = p;
    q.stop_strings = stop;
    q.stop_token_ids = stop_ids;
    if (!ignore_eos)
      for (int32_t id : g.default_stop_ids()) q.stop_token_ids.push_back(id);
    q.validate();
    return q;
  }
};

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MD_CHECK(f.good(), "cannot open {}", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Kimi K3 chat switches (other templates ignore them) and how the think channel is shown.
struct ThinkingFlags {
  bool no_thinking = false, show_thinking = false;
  std::string effort = "max";
  void add(CLI::App* c) {
    c->add_flag("--no-thinking", no_thinking,
                "Kimi K3: answer without the think channel (the prompt opens the response)");
    c->add_option("--thinking-effort", effort,
                  "Kimi K3: low | high | max | none (no effort message)")
        ->check(CLI::IsMember({"low", "high", "max", "none"}));
    c->add_flag("--show-thinking", show_thinking,
                "Kimi K3: also print the think channel (between [thinking] and [/thinking])");
  }
  ChatOptions options() const {
    ChatOptions o;
    o.thinking = !no_thinking;
    if (effort == "none")
      o.thinking_effort.reset();
    else
      o.thinking_effort = effort;
    return o;
  }
};

// The shape of the answer, as the server's structured outputs take it (docs/server.md
// "Structured outputs"): llama.cpp's --grammar / --grammar-file / --json-schema, and a regex or a
// choice.
struct ConstraintFlags {
  std::string grammar, grammar_file, regex, json_schema, json_schema_file;
  std::vector<std::string> choice;
  void add(CLI::App* c) {
    c->add_option("--grammar", grammar, "a GBNF grammar the answer follows (llama.cpp's syntax)");
    c->add_option("--grammar-file", grammar_file, "read the GBNF grammar from a file");
    c->add_option("--regex", regex, "a regular expression the whole answer matches");
    c->add_option("--json-schema", json_schema,
                  "a JSON Schema the answer (one JSON value) follows");
    c->add_option("--json-schema-file", json_schema_file, "read the JSON Schema from a file");
    c->add_option("--choice", choice, "the answer is exactly one of these (repeatable)");
  }
  // The program for the answer (null: none): after the chat template's generation prompt when
  // `chat`, else the raw continuation; then a stop token of `p`.
  std::shared_ptr<const ConstraintProgram> program(const Generator& g, bool chat,
                                                   const ChatOptions& options,
                                                   const SamplingParams& p) const;
};

std::shared_ptr<const ConstraintProgram> ConstraintFlags::program(const Generator& g, bool chat,
                                                                  const ChatOptions& options,
                                                                  const SamplingParams& p) const {
  // As the request field it would be: (flag, key, value).
  std::vector<std::tuple<const char*, const char*, nlohmann::json>> given;
  if (!grammar.empty()) given.emplace_back("--grammar", "grammar", grammar);
  if (!grammar_file.empty())
    given.emplace_back("--grammar-file", "grammar", read_file(grammar_file));
  if (!regex.empty()) given.emplace_back("--regex", "regex", regex);
  auto schema = [](const std::string& text, const char* flag) {
    try {
      return nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw Error(fmt::format("{}: not valid JSON: {}", flag, e.what()));
    }
  };
  if (!json_schema.empty())
    given.emplace_back("--json-schema", "json", schema(json_schema, "--json-schema"));
  if (!json_schema_file.empty())
    given.emplace_back("--json-schema-file", "json",
                       schema(read_file(json_schema_file), "--json-schema-file"));
  if (!choice.empty()) given.emplace_back("--choice", "choice", choice);
  if (given.empty()) return nullptr;
  MD_CHECK(given.size() == 1,
           "give one of --grammar, --grammar-file, --regex, --json-schema, --json-schema-file "
           "and --choice");
  const auto& [flag, key, value] = given[0];
  std::optional<server::StructuredOutput> so;
  try {
    so = server::parse_structured_outputs({{"structured_outputs", {{key, value}}}});
  } catch (const server::ApiError& e) {
    throw Error(fmt::format("{}: {}", flag, e.message));
  }
  if (chat)
    return server::structured_output_program(g.template_kind(), options.thinking, g.tokenizer(),
                                             p.stop_token_ids, std::move(so->body));
  std::vector<ConstraintElement> el(2);
  el[0] = std::move(so->body);
  el[1].kind = ConstraintElement::Kind::kStop;
  el[1].stop_ids = p.stop_token_ids;
  return std::make_shared<const ConstraintProgram>(std::move(el));
}

// Streams a generation to stdout: the answer, and with --show-thinking the reasoning before it.
// Which decoder runs the decode steps of run/chat: the reference path or a plan executor.
struct DecoderFlags {
  std::string executor = "reference";
  int workers = 0;
  int prefill_chunk = 16;
  SpeculativeFlags spec;
  CLI::Option* executor_opt = nullptr;
  void add(CLI::App* app) {
    executor_opt =
        app->add_option("--executor", executor,
                        "what runs: reference (Model::forward), megakernel or opbyop (the decode "
                        "plan: the prompt in chunks of rows, sampling inside the step); "
                        "speculative decoding runs on a plan executor (default megakernel)")
            ->check(CLI::IsMember({"reference", "megakernel", "opbyop"}));
    spec.add(app);
    app->add_option("--workers", workers, "plan executor workers (0: one per CPU)")
        ->check(CLI::Range(0, 4096));
    app->add_option("--prefill-chunk", prefill_chunk,
                    "token rows per plan step when the prompt goes through the plan")
        ->check(CLI::Range(1, 64));
  }
  // The executor (null for the reference path), attached to the generator, and with
  // --speculative / --draft the drafter (in `drafter`, which must outlive the generator's use).
  std::unique_ptr<Executor> attach(Model& m, Generator& g, DeviceKind device,
                                   LoadedDrafter& drafter) const {
    spec.validate();
    std::string kind = executor;
    if (spec.enabled()) {
      MD_CHECK(!(executor_opt && executor_opt->count() > 0 && executor == "reference"),
               "speculative decoding (--speculative / --draft) needs a plan executor: "
               "--executor megakernel or opbyop (the reference path cannot commit a verify "
               "step to a prefix)");
      if (kind == "reference") kind = "megakernel";
    }
    if (kind == "reference") return nullptr;
    ExecutorOptions eo;
    eo.device = device;
    eo.workers = workers;
    eo.states = m.options().states;
    auto ex = make_executor(m, parse_executor_kind(kind), 1, eo);
    // The generator's sequence then lives in the executor's pool: if anything below fails, it
    // must leave that pool before the executor goes (ASan caught the use after free).
    g.set_executor(ex.get(), prefill_chunk);
    try {
      if (spec.enabled()) {
        drafter = load_drafter(spec, m, ex.get());
        g.set_speculative(drafter.drafter.get(), drafter.options);
      }
    } catch (...) {
      g.set_executor(nullptr);
      throw;
    }
    return ex;
  }
};

struct StreamPrinter {
  bool show_thinking = false;
  bool in_thinking = false;
  bool on_text(std::string_view piece) {
    close_thinking();
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    return true;
  }
  bool on_reasoning(std::string_view piece) {
    if (!show_thinking) return true;
    if (!in_thinking) std::fputs("[thinking]\n", stdout);
    in_thinking = true;
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    return true;
  }
  void close_thinking() {
    if (in_thinking) std::fputs("\n[/thinking]\n", stdout);
    in_thinking = false;
  }
  GenerationResult generate(Generator& g, const std::vector<int32_t>& ids,
                            const SamplingParams& p) {
    GenerationResult r = g.generate(
        ids, p, [this](std::string_view s) { return on_text(s); },
        [this](std::string_view s) { return on_reasoning(s); });
    close_thinking();
    return r;
  }
};

void print_stats(const GenerationResult& r) {
  if (follower_rank()) return;  // (rank 0 reports a distributed run's)
  std::fprintf(stderr, "\n[%zu prompt tokens (%d run) in %.0f ms; %zu tokens at %.2f tok/s; %s]\n",
               r.prompt_ids.size(), r.prefilled, r.prefill_seconds * 1e3, r.tokens.size(),
               r.decode_tokens_per_second(), r.finish_reason.c_str());
  if (r.speculative) {
    const SpeculativeStats& s = r.speculative_stats;
    std::fprintf(stderr,
                 "[speculative: %lld steps, %lld of %lld drafts accepted (%.1f%%), %.2f tokens "
                 "a step, %.2f ms a step]\n",
                 (long long)s.steps, (long long)s.accepted, (long long)s.drafted,
                 100.0 * s.acceptance_rate(), s.tokens_per_step(),
                 s.steps ? 1e3 * s.seconds() / double(s.steps) : 0.0);
  }
}

nlohmann::json speculative_json(const GenerationResult& r) {
  if (!r.speculative) return nullptr;
  const SpeculativeStats& s = r.speculative_stats;
  return {{"steps", s.steps},
          {"drafted", s.drafted},
          {"accepted", s.accepted},
          {"emitted", s.emitted},
          {"acceptance_rate", s.acceptance_rate()},
          {"tokens_per_step", s.tokens_per_step()}};
}

}  // namespace

void register_text_commands(CLI::App& app) {
  {
    struct Opts {
      RunFlags f;
      SamplingFlags s;
      ThinkingFlags t;
      DecoderFlags d;
      ConstraintFlags k;
      std::string prompt, prompt_file, system, chat_template;
      bool raw = false, chat = false, json = false;
    };
    auto o = std::make_shared<Opts>();
    auto* c = app.add_subcommand("run", "generate text from a prompt, streamed as it is made");
    o->f.add(c);
    o->s.add(c);
    o->t.add(c);
    o->d.add(c);
    o->k.add(c);
    auto* po = c->add_option("--prompt,-p", o->prompt, "the prompt text");
    auto* pf = c->add_option("--prompt-file", o->prompt_file, "read the prompt from a file");
    c->add_option("--system", o->system, "system message (chat mode)");
    c->add_flag("--raw", o->raw, "send the prompt as is, without the chat template");
    c->add_flag("--chat", o->chat, "wrap the prompt in the chat template (the default)");
    c->add_option("--chat-template", o->chat_template,
                  "template kind overriding the checkpoint's (kimi, kimi-k3)");
    c->add_flag("--json", o->json, "print one JSON object with the result instead of streaming");
    c->callback([o, po, pf] {
      MD_CHECK(!(o->raw && o->chat), "--raw and --chat exclude each other");
      MD_CHECK((po->count() > 0) != (pf->count() > 0),
               "give exactly one of --prompt and --prompt-file");
      std::string text = o->prompt_file.empty() ? o->prompt : read_file(o->prompt_file);
      o->d.spec.validate();  // bad flags fail before the model loads
      LoadedModel lm = load_model(o->f);
      // The executor outlives the generator, whose sequence lives in the executor's pool.
      std::unique_ptr<Executor> executor;
      LoadedDrafter drafter;
      Generator g(*lm.model, *lm.tokenizer, o->chat_template);
      executor = o->d.attach(*lm.model, g, o->f.device_kind(), drafter);
      std::vector<int32_t> ids;
      if (o->raw) {
        ids = g.encode(text);
      } else {
        std::vector<ChatMessage> msgs;
        if (!o->system.empty()) msgs.push_back({"system", o->system, "", "", {}, ""});
        msgs.push_back({"user", text, "", "", {}, ""});
        ids = g.encode_chat(msgs, true, o->t.options());
      }
      MD_CHECK(!ids.empty(), "the prompt is empty (no tokens to start from)");
      SamplingParams p = o->s.params(g);
      g.set_constraint(o->k.program(g, !o->raw, o->t.options(), p));
      if (o->json) {
        GenerationResult r = g.generate(ids, p);
        nlohmann::json j = {{"text", r.text},
                            {"reasoning", r.reasoning},
                            {"tokens", r.tokens},
                            {"finish_reason", r.finish_reason},
                            {"prompt_ids", r.prompt_ids},
                            {"prompt_tokens", r.prompt_ids.size()},
                            {"completion_tokens", r.tokens.size()},
                            {"prefill_ms", r.prefill_seconds * 1e3},
                            {"decode_tokens_per_s", r.decode_tokens_per_second()},
                            {"speculative", speculative_json(r)}};
        std::printf("%s\n",
                    j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
        return;
      }
      StreamPrinter out{o->t.show_thinking};
      GenerationResult r = out.generate(g, ids, p);
      std::printf("\n");
      print_stats(r);
    });
  }
  {
    struct Opts {
      RunFlags f;
      SamplingFlags s;
      ThinkingFlags t;
      DecoderFlags d;
      ConstraintFlags k;
      std::string system, chat_template;
    };
    auto o = std::make_shared<Opts>();
    auto* c = app.add_subcommand("chat", "interactive multi-turn chat (/reset, /exit, Ctrl-D)");
    o->f.add(c);
    o->s.add(c);
    o->t.add(c);
    o->d.add(c);
    o->k.add(c);
    c->add_option("--system", o->system, "system message");
    c->add_option("--chat-template", o->chat_template,
                  "template kind overriding the checkpoint's (kimi, kimi-k3)");
    c->callback([o] {
      o->d.spec.validate();  // bad flags fail before the model loads
      LoadedModel lm = load_model(o->f);
      // The executor outlives the generator, whose sequence lives in the executor's pool.
      std::unique_ptr<Executor> executor;
      LoadedDrafter drafter;
      Generator g(*lm.model, *lm.tokenizer, o->chat_template);
      executor = o->d.attach(*lm.model, g, o->f.device_kind(), drafter);
      const ChatOptions chat_options = o->t.options();
      g.render({{"user", "", "", "", {}, ""}}, true, chat_options);  // fail early: bad template
      SamplingParams p = o->s.params(g);
      g.set_constraint(o->k.program(g, true, chat_options, p));
      const bool tty = isatty(0);
      std::vector<ChatMessage> history;
      auto start = [&] {
        history.clear();
        if (!o->system.empty()) history.push_back({"system", o->system, "", "", {}, ""});
      };
      start();
      if (tty)
        std::fprintf(stderr, "chat with %s; /reset clears the history, /exit or Ctrl-D quits\n",
                     o->f.model.c_str());
      std::string line;
      for (;;) {
        if (tty) std::fprintf(stderr, "> ");
        if (!std::getline(std::cin, line)) break;
        if (line == "/exit" || line == "/quit") break;
        if (line == "/reset") {
          start();
          g.reset();
          std::fprintf(stderr, "(history cleared)\n");
          continue;
        }
        if (line.empty()) continue;
        history.push_back({"user", line, "", "", {}, ""});
        std::vector<int32_t> ids = g.encode_chat(history, true, chat_options);
        StreamPrinter out{o->t.show_thinking};
        GenerationResult r = out.generate(g, ids, p);
        // Kimi K3 keeps the reasoning of earlier turns in the conversation.
        history.push_back({"assistant", r.text, "", "", {}, r.reasoning});
        std::printf("\n");
        std::fflush(stdout);
        print_stats(r);
      }
      if (tty) std::fprintf(stderr, "\n");
    });
  }
  {
    struct Opts {
      std::string model, text, file;
      bool json = false;
    };
    auto o = std::make_shared<Opts>();
    auto* c = app.add_subcommand("tokenize", "text -> token ids");
    c->add_option("--model", o->model, "checkpoint directory (its tokenizer files)")->required();
    c->add_option("--text", o->text, "text to encode");
    c->add_option("--file", o->file, "file to encode");
    c->add_flag("--json", o->json, "print one JSON list of ids");
    c->callback([o] {
      MD_CHECK(o->text.empty() != o->file.empty(), "give exactly one of --text and --file");
      Tokenizer t = Tokenizer::load(o->model);
      std::string text = o->file.empty() ? o->text : read_file(o->file);
      std::vector<int32_t> ids = t.encode(text, true);
      if (o->json) {
        std::printf("%s\n", nlohmann::json(ids).dump().c_str());
        return;
      }
      for (int32_t id : ids) {
        std::string piece(t.token_bytes(id));
        std::printf("%d\t%s\n", id,
                    nlohmann::json(piece)
                        .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                        .c_str());
      }
    });
  }
  {
    struct Opts {
      std::string model, ids;
      bool skip_special = false;
    };
    auto o = std::make_shared<Opts>();
    auto* c = app.add_subcommand("detokenize", "token ids -> text");
    c->add_option("--model", o->model, "checkpoint directory (its tokenizer files)")->required();
    c->add_option("--ids", o->ids, "comma-separated token ids")->required();
    c->add_flag("--skip-special", o->skip_special, "leave out special tokens");
    c->callback([o] {
      Tokenizer t = Tokenizer::load(o->model);
      std::string s = t.decode(parse_ids(o->ids), o->skip_special);
      std::fwrite(s.data(), 1, s.size(), stdout);
      std::printf("\n");
    });
  }
}

}  // namespace md::cli
