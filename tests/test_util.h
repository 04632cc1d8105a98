// Helpers shared by the tests: temporary directories and running the CLI.
#pragma once
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>

#include "megadecode/base/threads.h"
#include "megadecode/model/presets.h"
#include "megadecode/tokenizer/bpe_train.h"
#include "megadecode/tokenizer/chat_template.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace md::test {

// A fresh directory under the test temp dir, removed at scope exit.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    std::string tmpl = (std::filesystem::temp_directory_path() / ("md_" + tag + "_XXXXXX"));
    char* p = mkdtemp(tmpl.data());
    if (!p) std::abort();
    path_ = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct CommandResult {
  int status = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs the megadecode CLI with the given arguments (a shell-quoted string), feeding `input` on
// its standard input.
inline CommandResult run_cli(const std::string& args, const std::string& input = "") {
  TempDir d("cli");
  if (FILE* f = std::fopen((d / "in").c_str(), "wb")) {
    std::fwrite(input.data(), 1, input.size(), f);
    std::fclose(f);
  }
  std::string cmd = std::string(MD_CLI_PATH) + " " + args + " < " + (d / "in") + " > " +
                    (d / "out") + " 2> " + (d / "err");
  int rc = std::system(cmd.c_str());
  CommandResult r;
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + WTERMSIG(rc);
  auto slurp = [](const std::string& path) {
    std::string s;
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      char buf[4096];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
      std::fclose(f);
    }
    return s;
  };
  r.out = slurp(d / "out");
  r.err = slurp(d / "err");
  return r;
}

// The committed test data and the checkpoint cache: where the build put them, unless the
// environment names them (a test binary run from another checkout, as bench/gpu-check.sh does
// with a bundle built on another machine).
inline std::string data_dir() {
  const char* e = std::getenv("MD_TEST_DATA_DIR");
  return e && *e ? e : MD_TEST_DATA_DIR;
}
inline std::string cache_dir() {
  const char* e = std::getenv("MD_TEST_CACHE_DIR");
  return e && *e ? e : MD_TEST_CACHE_DIR;
}

// A random checkpoint of a preset (plus whatever `extra` writes into its directory, e.g. tokenizer
// files), made once and shared by every test process of this test binary: ctest runs each test
// in its own process, so a fixture that made its checkpoints in SetUpTestSuite made them once per
// test. The cache lives in the build tree under a directory named after the test binary's
// modification time (a rebuilt binary, whose generator may have changed, starts a new cache; the
// older ones are removed), and a checkpoint appears there only complete (made in a private
// directory, then renamed into place; a process that loses the race drops its copy). `tag` names
// the variant that `extra` makes.
inline std::string shared_checkpoint(const std::string& preset, uint64_t seed, int shards = 1,
                                     const std::string& tag = "",
                                     const std::function<void(const std::string&)>& extra = {}) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto stamp = fs::last_write_time("/proc/self/exe", ec).time_since_epoch().count();
  const fs::path root = fs::path(cache_dir());
  const fs::path gen = root / std::to_string(stamp);
  const fs::path dir =
      gen / (preset + "-" + std::to_string(seed) + "-" + std::to_string(shards) + tag);
  if (fs::exists(dir / "config.json")) return dir.string();
  fs::create_directories(gen);
  for (const auto& e : fs::directory_iterator(root, ec))  // caches of older builds
    if (e.path() != gen) fs::remove_all(e.path(), ec);
  const fs::path tmp = dir.string() + ".tmp" + std::to_string(getpid());
  fs::remove_all(tmp, ec);
  {
    ThreadPool pool(2, false);
    make_random_checkpoint(preset_config(preset), tmp.string(), seed, shards, pool);
  }
  if (extra) extra(tmp.string());
  fs::rename(tmp, dir, ec);
  if (ec) fs::remove_all(tmp, ec);  // another process put it there first
  return dir.string();
}

// A shared Kimi Linear checkpoint with a BPE tokenizer trained on the built-in corpus and the
// Kimi chat template, so that it runs from text.
// The 256 byte ranks and no merges (built at once), with the format's special tokens: every
// ordinary token is one byte, so a test can cut text anywhere.
inline Tokenizer byte_tokenizer(TemplateKind kind) {
  std::vector<std::string> ranks;
  for (int b = 0; b < 256; ++b) ranks.emplace_back(1, char(b));
  return Tokenizer::from_parts(ranks,
                               kind == TemplateKind::kKimiK3 ? kimi_k3_tokenizer_specials(256, 512)
                                                             : kimi_special_tokens(256, 512),
                               512);
}

inline std::string shared_text_checkpoint(const std::string& preset, uint64_t seed) {
  return shared_checkpoint(preset, seed, 1, "-text", [&](const std::string& dir) {
    const ModelConfig cfg = preset_config(preset);
    write_tokenizer_files(dir, train_bpe(builtin_training_corpus(), int(cfg.vocab_size - 256)),
                          cfg.vocab_size, kimi_linear_chat_template());
  });
}

}  // namespace md::test
