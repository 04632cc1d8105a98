// Tokenizer encode throughput on one core. bench/bench_tokenizer.py runs this on the same text and
// tokenizer files as the tiktoken Python package, in the same run, and checks the ids agree.
//
//   megadecode_bench_tokenizer --model DIR --text FILE [--reps N] [--ids-out FILE]
//
// Prints one JSON line: bytes, tokens, cold_s (first encode: empty piece cache), best_s (best of
// N warm encodes), and the MB/s figures for both (MB = 1e6 bytes).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace {

int usage() {
  std::fprintf(stderr,
               "usage: megadecode_bench_tokenizer --model DIR --text FILE [--reps N] "
               "[--ids-out FILE]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, text_path, ids_out;
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--model") {
      model = value();
    } else if (a == "--text") {
      text_path = value();
    } else if (a == "--reps") {
      reps = std::max(1, std::atoi(value().c_str()));
    } else if (a == "--ids-out") {
      ids_out = value();
    } else {
      return usage();
    }
  }
  if (model.empty() || text_path.empty()) return usage();
  try {
    md::Tokenizer tok = md::Tokenizer::load(model);
    std::ifstream f(text_path, std::ios::binary);
    if (!f) md::fail("{}: cannot open", text_path);
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string text = ss.str();

    double t0 = md::now_seconds();
    std::vector<int32_t> ids = tok.encode(text);
    const double cold = md::now_seconds() - t0;
    double best = cold;
    for (int r = 0; r < reps; ++r) {
      t0 = md::now_seconds();
      std::vector<int32_t> again = tok.encode(text);
      best = std::min(best, md::now_seconds() - t0);
      if (again != ids) md::fail("encode is not deterministic");
    }
    if (!ids_out.empty()) {
      std::ofstream o(ids_out, std::ios::binary);
      for (int32_t id : ids) o << id << '\n';
      if (!o) md::fail("{}: write failed", ids_out);
    }
    const double mb = static_cast<double>(text.size()) / 1e6;
    std::printf(
        "{\"bytes\": %zu, \"tokens\": %zu, \"cold_s\": %.6f, \"best_s\": %.6f, "
        "\"cold_mb_per_s\": %.2f, \"best_mb_per_s\": %.2f}\n",
        text.size(), ids.size(), cold, best, mb / cold, mb / best);
  } catch (const md::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
