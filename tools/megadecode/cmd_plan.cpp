// plan: compile the decode program for a model (or a preset geometry) and print its summary.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "common.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/dist/shard.h"
#include "megadecode/model/presets.h"
#include "megadecode/plan/plan.h"

namespace md::cli {

void register_plan(CLI::App& app) {
  struct Opts {
    std::string model, preset;
    int batch = 1, workers = 0;
    int tile_kb = 0;
    int tp = 1, ep = 1, rank = 0;
    bool dump = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "plan",
      "print the decode program for a batch and worker count (instruction counts per op, "
      "bytes per worker, critical path; --dump: every queue)");
  auto* m = c->add_option("--model", o->model, "checkpoint directory");
  auto* p =
      c->add_option("--preset", o->preset,
                    "a preset geometry instead of a checkpoint (tiny | small | kl48-e32 | kl48 | "
                    "k3-tiny | k3-small | k3-slice)");
  m->excludes(p);
  c->add_option("--batch", o->batch, "sequences per step")->check(CLI::Range(1, 1024));
  c->add_option("--workers", o->workers, "workers (0: one per CPU)")->check(CLI::Range(0, 4096));
  c->add_option("--tile-kb", o->tile_kb, "target weight KiB per GEMV tile (default 256)")
      ->check(CLI::Range(1, 1 << 20));
  c->add_flag("--dump", o->dump, "also print every queue, one instruction per line");
  c->add_option("--tp", o->tp, "distributed layout: tensor-parallel ways (docs/distributed.md)")
      ->check(CLI::Range(1, 4096));
  c->add_option("--ep", o->ep, "distributed layout: expert-parallel ways")
      ->check(CLI::Range(1, 4096));
  c->add_option("--rank", o->rank, "distributed: whose plan to print (default 0)")
      ->check(CLI::Range(0, 4095));
  c->callback([o] {
    MD_CHECK(!o->model.empty() || !o->preset.empty(), "plan: give --model DIR or --preset NAME");
    plan::PlanOptions po;
    po.batch = o->batch;
    po.workers = o->workers > 0 ? o->workers : online_cpus();
    if (o->tile_kb > 0) po.tile_bytes = size_t(o->tile_kb) << 10;
    // A distributed rank's plan: its slice of the model, its collectives.
    dist::Shard shard;
    shard.layout = {o->tp, o->ep};
    shard.rank = o->rank;
    po.world = shard.world();
    po.rank = shard.rank;
    plan::Plan pl;
    std::string head;
    if (!o->model.empty()) {
      namespace fs = std::filesystem;
      MD_CHECK(fs::is_directory(o->model), "model directory {} does not exist", o->model);
      ModelConfig cfg = load_config_file((fs::path(o->model) / "config.json").string());
      Checkpoint ck(o->model);
      ModelWeights w = bind_weights(cfg, ck);
      if (shard.sharded()) {
        dist::ShardBytes b;
        w = dist::shard_weights(cfg, w, shard, &b);
        head = fmt::format("{}: holds {} of weights ({} mapped in place, {} copied)\n",
                           dist::describe_shard(shard), human_bytes(b.held()),
                           human_bytes(b.mapped), human_bytes(b.copied));
        cfg = dist::shard_config(cfg, shard);
      }
      pl = plan::compile_decode_plan(cfg, &w, po);
    } else {
      ModelConfig cfg = preset_config(o->preset);
      if (shard.sharded()) {
        cfg = dist::shard_config(cfg, shard);
        head = fmt::format("{}\n", dist::describe_shard(shard));
      }
      pl = plan::compile_decode_plan(cfg, nullptr, po);
    }
    std::fwrite(head.data(), 1, head.size(), stdout);
    auto errs = plan::validate_plan(pl);
    MD_CHECK(errs.empty(), "internal error: the compiled plan is invalid: {}", errs.front());
    std::string s = plan::describe_plan(pl, o->dump);
    std::fwrite(s.data(), 1, s.size(), stdout);
  });
}

}  // namespace md::cli
