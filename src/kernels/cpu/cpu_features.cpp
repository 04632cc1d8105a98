// CPU feature detection and the process-wide ISA level (cpu_features.h). This file is compiled for
// the baseline ISA like every file without an ISA suffix, since it runs before anything is known.
#include "megadecode/kernels/cpu/cpu_features.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace md::cpu {
namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();  // required when called from a static initialiser, harmless otherwise
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.popcnt = __builtin_cpu_supports("popcnt");
  f.f16c = __builtin_cpu_supports("f16c");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  f.avx512vnni = __builtin_cpu_supports("avx512vnni");
#endif
  return f;
}

// Each level's own requirements (the flags its files add to the level below), with the names
// used in messages. The tables mirror the per-suffix flags in CMakeLists.txt.
struct Need {
  bool CpuFeatures::*flag;
  const char* name;
};
constexpr Need kAvx2Needs[] = {
    {&CpuFeatures::avx2, "avx2"},
    {&CpuFeatures::fma, "fma"},
    {&CpuFeatures::popcnt, "popcnt"},
    {&CpuFeatures::f16c, "f16c"}};  // (every AVX2 CPU has F16C: the FP8 decode uses it)
constexpr Need kAvx512Needs[] = {{&CpuFeatures::avx512f, "avx512f"},
                                 {&CpuFeatures::avx512bw, "avx512bw"},
                                 {&CpuFeatures::avx512vl, "avx512vl"},
                                 {&CpuFeatures::avx512dq, "avx512dq"}};
// (every CPU with AVX-512 BF16 also has VNNI: Cooper Lake, Sapphire Rapids and later, Zen 4 and
// later; the integer dot-product kernels, qdot.h, use it)
constexpr Need kBf16Needs[] = {{&CpuFeatures::avx512bf16, "avx512bf16"},
                               {&CpuFeatures::avx512vnni, "avx512vnni"}};

template <size_t N>
void add_missing(const CpuFeatures& f, const Need (&needs)[N], std::string& out) {
  for (const Need& n : needs) {
    if (f.*(n.flag)) continue;
    if (!out.empty()) out += ' ';
    out += n.name;
  }
}

Isa compute_hardware_isa() {
  for (int i = kNumIsas - 1; i > 0; --i) {
    if (missing_features(static_cast<Isa>(i)).empty()) return static_cast<Isa>(i);
  }
  return Isa::kPortable;
}

Isa min_isa(Isa a, Isa b) {
  return static_cast<int>(a) < static_cast<int>(b) ? a : b;
}

// MEGADECODE_ISA, read once. Never fatal: a typo in an environment variable should cost speed,
// not the run, and the warning says what was chosen instead.
Isa startup_isa() {
  const Isa hw = hardware_isa();
  const char* env = std::getenv("MEGADECODE_ISA");
  if (env == nullptr || *env == '\0' || std::string_view(env) == "auto") return hw;
  Isa want;
  if (!parse_isa(env, &want)) {
    std::fprintf(stderr,
                 "megadecode: warning: MEGADECODE_ISA='%s' is not one of portable, avx2, avx512, "
                 "avx512bf16, auto; using %s\n",
                 env, isa_name(hw));
    return hw;
  }
  if (static_cast<int>(want) > static_cast<int>(hw)) {
    std::fprintf(stderr,
                 "megadecode: warning: MEGADECODE_ISA=%s needs CPU features this CPU lacks (%s); "
                 "using %s\n",
                 env, missing_features(want).c_str(), isa_name(hw));
    return hw;
  }
  return want;
}

Isa startup_level() {
  static const Isa level = startup_isa();
  return level;
}

std::atomic<int>& state() {
  static std::atomic<int> isa{static_cast<int>(startup_level())};
  return isa;
}

// Reads the environment (and prints any warning) while the library is loaded, not in the middle
// of the first decode step.
[[maybe_unused]] const bool g_initialised = (state(), true);

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

std::string missing_features(Isa isa) {
  const CpuFeatures& f = cpu_features();
  std::string out;
  const int l = static_cast<int>(isa);
  if (l >= static_cast<int>(Isa::kAvx2)) add_missing(f, kAvx2Needs, out);
  if (l >= static_cast<int>(Isa::kAvx512)) add_missing(f, kAvx512Needs, out);
  if (l >= static_cast<int>(Isa::kAvx512Bf16)) add_missing(f, kBf16Needs, out);
  return out;
}

Isa hardware_isa() {
  static const Isa hw = compute_hardware_isa();
  return hw;
}

Isa active_isa() {
  return static_cast<Isa>(state().load(std::memory_order_relaxed));
}

Isa set_isa(Isa want) {
  const Isa now = min_isa(want, hardware_isa());
  state().store(static_cast<int>(now), std::memory_order_relaxed);
  return now;
}

Isa reset_isa() {
  return set_isa(startup_level());
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    case Isa::kPortable:
      break;
  }
  return "portable";
}

bool parse_isa(std::string_view name, Isa* out) {
  for (int i = 0; i < kNumIsas; ++i) {
    if (name == isa_name(static_cast<Isa>(i))) {
      *out = static_cast<Isa>(i);
      return true;
    }
  }
  return false;
}

}  // namespace md::cpu
