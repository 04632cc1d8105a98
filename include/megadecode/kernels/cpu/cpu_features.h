// CPU feature detection and the one instruction-set level that every CPU kernel family (matmul
// bf16/f32, MXFP4, KDA, MLA, the bandwidth probe) dispatches on. Nothing else in the code base
// calls __builtin_cpu_supports or reads MEGADECODE_ISA.
//
// Why one place: a kernel file compiled with -mavx512bw must never run on a CPU that has AVX-512F
// but not BW, and an override must switch every family together (the executors and the reference
// path call the same dispatched kernels and rely on being bit-identical). Each level below lists
// exactly the compiler flags of the files it unlocks (CMakeLists.txt, by file-name suffix), and
// the level is only reported as available when the CPU (and OS, which must save the wider
// registers; libgcc's detection checks XGETBV) has every one of them.
#pragma once
#include <string>
#include <string_view>

namespace md::cpu {

// Ordered: each level includes everything below it.
enum class Isa : int {
  kPortable = 0,    // x86-64 baseline (SSE2): plain C++ the compiler vectorises
  kAvx2 = 1,        // *_avx2.cpp: -mavx2 -mfma (-mavx2 also implies SSE4.2 and POPCNT)
  kAvx512 = 2,      // *_avx512.cpp: the above + -mavx512f -mavx512bw -mavx512vl -mavx512dq
  kAvx512Bf16 = 3,  // *_avx512bf16.cpp: the above + -mavx512bf16 -mavx512vnni
};
inline constexpr int kNumIsas = 4;

// What the CPU reports, detected once.
struct CpuFeatures {
  bool avx2 = false, fma = false, popcnt = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false, avx512vnni = false;
};
const CpuFeatures& cpu_features();

// The best level the CPU supports.
Isa hardware_isa();

// The level the kernels use now. Starts as MEGADECODE_ISA (read once, when the library is
// loaded: "portable", "avx2", "avx512", "avx512bf16" or "auto"; unset or empty means "auto", the
// hardware level). An unknown value or a level the CPU lacks prints one warning to stderr and
// falls back to the best supported level not above the request; it never aborts.
Isa active_isa();

// Forces a level (tests and benchmarks): clamped to hardware_isa(); returns the level now active.
// Not meant to be called while other threads run kernels.
Isa set_isa(Isa want);
// Back to the start-up level (the environment's choice).
Isa reset_isa();

// "portable", "avx2", "avx512", "avx512bf16".
const char* isa_name(Isa isa);
// Parses one of those names; false (leaving *out alone) for anything else, including "auto".
bool parse_isa(std::string_view name, Isa* out);
// The features the CPU lacks for `isa`, e.g. "avx512bf16" or "avx512bw avx512vl"; empty when the
// CPU has them all.
std::string missing_features(Isa isa);

// RAII for tests: forces a level for a scope and restores the previous one.
class ScopedIsa {
 public:
  explicit ScopedIsa(Isa want) : prev_(active_isa()), now_(set_isa(want)) {}
  ~ScopedIsa() { set_isa(prev_); }
  ScopedIsa(const ScopedIsa&) = delete;
  ScopedIsa& operator=(const ScopedIsa&) = delete;
  Isa level() const { return now_; }

 private:
  Isa prev_, now_;
};

}  // namespace md::cpu
