// megadecode: command-line entry point. Every error from outside input ends here as one line on
// stderr and exit status 1 (2 for usage errors), never a crash.
#include <cstdio>
#include <exception>

#include "common.h"
#include "megadecode/base/error.h"

int main(int argc, char** argv) {
  // Line by line even into a pipe: a run stopped by a time limit keeps what it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"megadecode: a megakernel inference engine for the Kimi hybrid model family"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "megadecode 0.1.0");
  md::cli::register_make_model(app);
  md::cli::register_run_commands(app);
  md::cli::register_text_commands(app);
  md::cli::register_bench(app);
  md::cli::register_plan(app);
  md::cli::register_serve(app);
  md::cli::register_serve_bench(app);
  md::cli::register_quant_eval(app);
  md::cli::register_quantize(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const md::Error& e) {
    std::fprintf(stderr, "megadecode: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "megadecode: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megadecode: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
