// Helpers shared by the tests: temporary directories and running the CLI.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

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

inline std::string data_dir() { return MD_TEST_DATA_DIR; }

}  // namespace md::test
