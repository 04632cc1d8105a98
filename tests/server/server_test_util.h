// A tiny text checkpoint with a plan executor, shared by the server tests.
#pragma once
#include <memory>
#include <string>

#include "megadecode/exec/cpu_executor.h"
#include "megadecode/server/engine_loop.h"
#include "megadecode/server/request.h"
#include "megadecode/text/generator.h"
#include "test_util.h"

namespace md::test {

struct ServedModel {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Generator> gen;
  std::unique_ptr<CpuExecutor> ex;
  explicit ServedModel(int max_batch = 8, ExecutorKind kind = ExecutorKind::kMegakernel) {
    const std::string dir = shared_text_checkpoint("tiny", 31);
    ModelOptions o;
    o.threads = 1;
    o.pin_threads = false;
    o.states.max_sequences = 16;
    o.states.cache_tokens = 16 * 4096;  // 4096 tokens a slot
    model = std::make_unique<Model>(dir, o);
    tok = std::make_unique<Tokenizer>(Tokenizer::load(dir, model->config().vocab_size));
    gen = std::make_unique<Generator>(*model, *tok);
    ExecutorOptions eo;
    eo.workers = 2;
    eo.pin = false;
    // The sanitizer runs share two cores with other jobs: a stalled worker there is load, not a
    // hang.
    eo.watchdog_seconds = 60;
    eo.states = o.states;
    ex = std::make_unique<CpuExecutor>(*model, max_batch, kind, eo);
  }
  server::ParseContext context(int max_model_len = 1024) const {
    server::ParseContext c;
    c.generator = gen.get();
    c.model_names = {"tiny"};
    c.vocab_size = tok->vocab_size();
    c.max_model_len = max_model_len;
    return c;
  }
};

}  // namespace md::test
