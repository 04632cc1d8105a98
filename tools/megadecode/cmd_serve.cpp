// `megadecode serve`: the OpenAI-compatible HTTP server (src/server, docs/server.md).
#include <pthread.h>
#include <signal.h>

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <thread>

#include "common.h"
#include "megadecode/base/error.h"
#include "megadecode/exec/reference_executor.h"
#include "megadecode/exec/step_mirror.h"
#include "megadecode/server/engine_loop.h"
#include "megadecode/server/http_server.h"
#include "megadecode/server/metrics.h"
#include "megadecode/text/generator.h"

namespace md::cli {

void register_serve(CLI::App& app) {
  struct Opts {
    RunFlags f;
    server::ServerOptions http;
    server::EngineOptions engine;
    std::string executor = "megakernel", chat_template;
    std::vector<std::string> names;
    int workers = 0;
    int prefix_cache = -1;  // -1: the pool's slots beside --max-batch
    double grace = 3.0;
    SpeculativeFlags spec;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching");
  o->f.add(c);
  c->add_option("--host", o->http.host, "address to listen on");
  c->add_option("--port", o->http.port, "port to listen on (0: any free port)")
      ->check(CLI::Range(0, 65535));
  c->add_option("--max-batch", o->engine.max_batch, "decode slots: sequences stepped together")
      ->check(CLI::Range(1, 1024));
  c->add_option("--max-queue", o->engine.max_queue,
                "sequences that may wait for a slot; beyond, requests get 503")
      ->check(CLI::Range(0, 1 << 20));
  c->add_option("--max-model-len", o->engine.max_model_len,
                "prompt + generated tokens of a sequence (0: what the state pool gives each slot)")
      ->check(CLI::Range(0, 1 << 30));
  c->add_option("--prefill-chunk", o->engine.prefill_chunk,
                "prompt rows a sequence feeds per step (a long prompt delays running streams by "
                "at most one chunk a step)")
      ->check(CLI::Range(1, 64));
  c->add_option("--stream-interval", o->engine.stream_interval,
                "tokens per streamed chunk after the first (1: every token at once; more: fewer "
                "wake-ups of the HTTP threads and clients, for hosts short of CPU)")
      ->check(CLI::Range(1, 1024));
  c->add_option("--prefix-cache", o->prefix_cache,
                "states kept for prompts that start with earlier prompts or conversations "
                "(docs/server.md \"Prefix cache\"): entries, each a sequence's state in the pool "
                "(0: off; default: the pool's --max-sequences slots beside --max-batch, or 4 more "
                "slots if none are spare and --cache-tokens is not given)")
      ->check(CLI::Range(-1, 4096));
  c->add_option("--prefix-cache-min-tokens", o->engine.prefix_cache_min_tokens,
                "shortest prefix the cache keeps a state for")
      ->check(CLI::Range(1, 1 << 30));
  c->add_option("--executor", o->executor,
                "megakernel or opbyop (the decode plan), or reference (Model::forward, one "
                "sequence after another)")
      ->check(CLI::IsMember({"megakernel", "opbyop", "reference"}));
  c->add_option("--workers", o->workers, "plan executor workers (0: one per CPU)")
      ->check(CLI::Range(0, 4096));
  c->add_option("--served-model-name", o->names,
                "model name(s) clients use (default: the model directory's name)");
  c->add_option("--api-key", o->http.api_key, "require 'Authorization: Bearer KEY' on /v1");
  c->add_option("--chat-template", o->chat_template,
                "template kind overriding the checkpoint's (kimi, kimi-k3)");
  c->add_option("--http-threads", o->http.http_threads, "connections served at once")
      ->check(CLI::Range(4, 4096));
  c->add_option("--max-body-bytes", o->http.max_body_bytes, "larger request bodies get 413")
      ->check(CLI::Range(size_t(1024), size_t(1) << 32));
  c->add_option("--responses-store", o->http.responses_store,
                "finished /v1/responses kept for previous_response_id and GET /v1/responses/{id} "
                "(least recently used dropped first; 0: none kept)")
      ->check(CLI::Range(size_t(0), size_t(1) << 20));
  c->add_option("--shutdown-grace", o->grace,
                "seconds running requests may finish after SIGINT/SIGTERM before they are aborted")
      ->check(CLI::Range(0.0, 600.0));
  o->spec.add(c);
  c->callback([o] {
    // Signals go to one waiting thread (below), so block them before any thread is started.
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
    signal(SIGPIPE, SIG_IGN);  // a client that hangs up is a failed write, not a dead server

    o->spec.validate();  // bad flags fail before the model loads
    MD_CHECK(!o->spec.enabled() || o->executor != "reference",
             "serve: speculative decoding (--speculative / --draft) needs a plan executor: "
             "--executor megakernel or opbyop (the reference path cannot commit a verify step)");
    LoadedModel lm = load_model(o->f);
    // Under mpirun (--tp / --ep) rank 0 listens and decides every step; the other ranks run its
    // steps on their slices (exec/step_mirror.h) and exit when it stops.
    const bool sharded = lm.model->shard().sharded();
    MD_CHECK(!sharded || o->spec.draft_dir().empty(),
             "serve: a DSpark draft (--draft) does not run under --tp / --ep yet; n-gram "
             "drafting (--speculative ngram) does (docs/distributed.md)");
    MD_CHECK(!sharded || o->executor != "reference",
             "serve: --tp / --ep need a plan executor (--executor megakernel or opbyop)");
    // With --speculative / --draft every slot gets its own drafter (a DSpark draft's weights are
    // loaded once and shared).
    LoadedDrafter drafter;
    if (o->spec.enabled()) {
      drafter = load_drafter(o->spec, *lm.model);
      o->engine.speculative = drafter.options;
      o->engine.make_drafter = [&drafter] { return drafter.make(); };
    }
    ExecutorOptions eo;
    eo.device = o->f.device_kind();
    eo.workers = o->workers;
    eo.states = lm.model->options().states;
    // The prefix cache's entries are sequences of the pool: a slot each beside the running ones
    // (under --tp / --ep every rank copies its slices: StepLeader::copy_sequence). Not with a
    // DSpark draft, which observes rows a restored sequence never fed.
    const bool cache_ok = o->spec.draft_dir().empty();
    MD_CHECK(cache_ok || o->prefix_cache <= 0,
             "serve: --prefix-cache does not run with a DSpark draft (--draft) yet");
    if (!cache_ok) o->prefix_cache = 0;
    if (o->prefix_cache < 0) {
      // The pool's spare slots; none spare: 4 more slots, unless --cache-tokens fixes the pages
      // (more slots would then shrink every slot's share below --max-model-len).
      const int spare = eo.states.max_sequences - o->engine.max_batch;
      o->prefix_cache = spare > 0 ? spare : eo.states.cache_tokens == 0 ? 4 : 0;
    }
    o->engine.prefix_cache = o->prefix_cache;
    eo.states.max_sequences =
        std::max(eo.states.max_sequences, o->engine.max_batch + o->prefix_cache);
    // reference: Model::forward a sequence at a time behind the same step interface (slow; for
    // checking the plan executors' output through the server).
    std::unique_ptr<Executor> local =
        o->executor == "reference"
            ? std::make_unique<ReferenceExecutor>(*lm.model, o->engine.max_batch, eo.states)
            : make_executor(*lm.model, parse_executor_kind(o->executor), o->engine.max_batch, eo);
    if (sharded && follower_rank()) {
      const int64_t steps = follow_steps(*local, *lm.comm);
      std::fprintf(stderr, "megadecode serve: rank %d ran %lld steps of rank 0 and stopped\n",
                   lm.comm->rank(), static_cast<long long>(steps));
      return;
    }
    std::unique_ptr<StepLeader> leader;  // (destroyed before `local`: it stops the followers)
    if (sharded) leader = std::make_unique<StepLeader>(*local, *lm.comm);
    Executor* ex = leader ? static_cast<Executor*>(leader.get()) : local.get();
    drafter.executor = ex;  // a DSpark draft runs as draft plans there (if it can)
    const PoolOptions& pool = eo.states;
    const int64_t per_slot =
        pool.cache_tokens > 0 ? pool.cache_tokens / pool.max_sequences : kDefaultTokensPerSequence;
    if (o->engine.max_model_len == 0) o->engine.max_model_len = int(per_slot);
    MD_CHECK(o->engine.max_model_len <= per_slot,
             "serve: --max-model-len {} is more than the state pool gives a slot ({} tokens: "
             "--cache-tokens / --max-sequences)",
             o->engine.max_model_len, per_slot);
    Generator gen(*lm.model, *lm.tokenizer, o->chat_template);
    if (o->names.empty())
      o->names.push_back(std::filesystem::path(o->f.model).lexically_normal().filename().string());
    if (o->names.front().empty()) o->names.front() = o->f.model;
    o->http.model_names = o->names;

    server::Metrics metrics;
    server::EngineLoop engine(*ex, *lm.tokenizer, o->engine, metrics.observer());
    server::HttpServer http(gen, engine, metrics, o->http);
    const int port = http.bind();
    std::fprintf(stderr,
                 "megadecode serve: http://%s:%d serving '%s' (%s), executor %s, max batch %d, "
                 "max model len %d, prefix cache %s%s\n",
                 o->http.host.c_str(), port, o->names.front().c_str(), o->f.model.c_str(),
                 o->executor.c_str(), o->engine.max_batch, o->engine.max_model_len,
                 o->prefix_cache > 0 ? fmt::format("{} entries", o->prefix_cache).c_str() : "off",
                 o->spec.enabled()
                     ? fmt::format(", speculative {} with {} drafts a step",
                                   drafter.drafter->name(), o->engine.speculative.num_draft_tokens)
                           .c_str()
                     : "");
    std::fflush(stderr);
    std::thread waiter([&] {
      int sig = 0;
      sigwait(&sigs, &sig);
      std::fprintf(stderr, "megadecode serve: %s: finishing running requests (up to %.0f s)\n",
                   sig == SIGINT ? "SIGINT" : "SIGTERM", o->grace);
      engine.shutdown(o->grace);  // refuses new work at once; aborts what outlives the grace
      http.stop();
    });
    http.run();
    // run() also returns if listening failed; wake the waiter so it can finish.
    pthread_kill(waiter.native_handle(), SIGTERM);
    waiter.join();
    std::fprintf(stderr, "megadecode serve: stopped\n");
  });
}

}  // namespace md::cli
