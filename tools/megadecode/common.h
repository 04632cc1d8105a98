// Shared helpers for the megadecode subcommands.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "megadecode/engine/model.h"

namespace md::cli {

// Parses "1,2,3" into ids; a malformed list is an md::Error naming the bad element.
std::vector<int32_t> parse_ids(const std::string& s);

// Flags every model-running command shares.
struct RunFlags {
  std::string model;
  std::string precision = "bf16";
  int threads = 0;
  bool biased_router = false;
  void add(CLI::App* app, bool model_required = true);
  ModelOptions options() const;
};

void register_make_model(CLI::App& app);
void register_run_commands(CLI::App& app);  // logits, generate, inspect
void register_bench(CLI::App& app);

}  // namespace md::cli
