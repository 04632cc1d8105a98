// The CUDA attention tiles (src/kernels/cuda/tiles_attention.cuh) on the host simulation of the
// CUDA execution model, against the CPU tiles (src/exec/cpu/tiles_attention.cpp) on the same
// synthetic step: the tiles are compiled into this file with MD_CUDA_SIM (in the simulation,
// device memory is host memory), run as one block of kTileThreads simulated threads, and their
// outputs compared with the CPU tile's.
//
// Tolerances. The two sides apply the same operations with the same bf16 rounding points; they
// differ in the order of fp32 sums (warp butterflies and block sums against the CPU's SIMD lanes
// and double-precision statistics) and in exp (the CPU's KDA decays use a polynomial within ~2
// ulp of expf). A reordered fp32 sum of n terms is off by about sqrt(n) * 2^-24 relative to the
// size of its terms (n * 2^-24 at worst), and the results chain a few such sums (norm, product,
// recurrence), so FP32 numerics are compared to kFp32Rel * sqrt(n) of the output vector's largest
// magnitude, n the longest reduction (K for KDA, R + P for MLA, the LoRA rank for q_up), with
// kFp32Rel = 1e-5: ~100 times the typical error, far below any real bug (a wrong rounding point
// or index is off by >= 2^-9). In BF16 numerics a tiny fp32 difference can flip a bf16 rounding
// (one bf16 ulp, 2^-8 relative; about 1 in 10^4 roundings here) and the flip propagates, so there
// every element must be within kBf16Rel = 2^-6 of the largest magnitude, and at most kFlipFrac
// (1/50) of the elements may differ by more than the fp32 bound at all: a missing or extra
// rounding point moves far more (a dropped rounding of K3's output-gate sigmoid alone moves 9% of
// the attention outputs; the others here 25-100%). Element-wise outputs with no chained use (latent
// rows, q_up) must also lie within one bf16 ulp of their own value.
//
// Determinism: every device result must have the same bits under the simulation's round-robin
// schedule (seed 0) and random schedules (seeds 1, 2, 3).
#define MD_CUDA_SIM 1
#include "../../src/kernels/cuda/tiles_attention.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../../src/exec/cpu/tiles.h"
#include "megadecode/kernels/cuda/sim.h"

namespace md {
namespace {

constexpr double kFp32Rel = 1e-5;
constexpr double kBf16Rel = 1.0 / 64;
constexpr double kFlipFrac = 0.02;

// max |a - b| / max |b| over the vectors (b: the CPU's).
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0, d = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    m = std::max(m, double(std::fabs(b[i])));
    d = std::max(d, double(std::fabs(a[i] - b[i])));
  }
  return m > 0 ? d / m : d;
}

std::string sci(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", x);
  return b;
}

// The comparison above (see the header): fp32 numerics within kFp32Rel * sqrt(n) of the largest
// magnitude; bf16 numerics within kBf16Rel, with at most kFlipFrac of the elements beyond the
// fp32 bound.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, bool bf16, int n,
                  const char* what) {
  const double e = rel_err(got, want), tol = kFp32Rel * std::sqrt(double(n));
  ::testing::Test::RecordProperty(what, sci(e));
  if (!bf16) {
    EXPECT_LE(e, tol) << what;
    return;
  }
  EXPECT_LE(e, kBf16Rel) << what;
  double m = 0;
  for (float x : want) m = std::max(m, double(std::fabs(x)));
  size_t off = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (std::fabs(double(got[i]) - want[i]) > tol * m) ++off;
  EXPECT_LE(double(off), kFlipFrac * double(want.size())) << what << ": elements beyond fp32";
}

// Elements that differ from b by more than one bf16 ulp of b.
int beyond_bf16_ulp(const std::vector<float>& a, const std::vector<float>& b) {
  int n = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const float ulp = b[i] == 0 ? 1e-30f : std::ldexp(1.0f, std::ilogb(b[i]) - 7);
    if (std::fabs(a[i] - b[i]) > ulp) ++n;
  }
  return n;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  return a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

struct Rng {
  std::mt19937 g;
  explicit Rng(uint32_t seed) : g(seed) {}
  float uni(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g); }
  float bfu(float lo, float hi) { return round_bf16(uni(lo, hi)); }  // bf16-valued
};

// A step's operands: arena buffers ([rows][width] floats), bf16 matrices and fp32 vectors, each
// with both executors' weight-table entries, and the operand list (the instruction's args).
struct Problem {
  std::vector<plan::BufferDesc> bufs;
  std::vector<float> arena;
  std::vector<std::vector<uint16_t>> mats;
  std::vector<std::vector<float>> vecs;
  std::vector<exec::WeightView> wcpu;
  std::vector<cuda::DevWeight> wdev;

  int push(plan::BufferDesc d) {
    bufs.push_back(d);
    return int(bufs.size()) - 1;
  }
  int act(int rows, int width, Rng& r, float lo, float hi) {
    plan::BufferDesc d;
    d.kind = plan::BufKind::kArena;
    d.offset = arena.size() * 4;
    d.stride = uint64_t(width) * 4;
    d.count = uint32_t(width);
    for (int i = 0; i < rows * width; ++i) arena.push_back(r.bfu(lo, hi));
    return push(d);
  }
  int weight(const void* data, DType dt, int64_t rows, int64_t cols) {
    wcpu.push_back({data, dt, rows, cols, nullptr});
    wdev.push_back(
        {data, nullptr, rows, cols, dt == DType::BF16 ? cuda::WDType::kBF16 : cuda::WDType::kF32});
    plan::BufferDesc d;
    d.kind = plan::BufKind::kWeight;
    d.offset = wcpu.size() - 1;
    d.count = 1;
    return push(d);
  }
  // A bf16 matrix (the vector's heap buffer stays put when mats grows: moves keep it).
  int mat(int64_t rows, int64_t cols, Rng& r, float scale) {
    std::vector<uint16_t> m(size_t(rows * cols));
    for (auto& x : m) x = f32_to_bf16(r.uni(-scale, scale));
    mats.push_back(std::move(m));
    return weight(mats.back().data(), DType::BF16, rows, cols);
  }
  int vec(int64_t n, Rng& r, float lo, float hi) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = r.uni(lo, hi);
    vecs.push_back(std::move(v));
    return weight(vecs.back().data(), DType::F32, 1, n);
  }
  int state() {
    plan::BufferDesc d;
    d.kind = plan::BufKind::kState;
    return push(d);
  }
  // Rows [t0, t0 + n) of arena buffer i in an arena copy.
  std::vector<float> rows(const std::vector<float>& ar, int i, int t0, int n) const {
    const plan::BufferDesc& d = bufs[size_t(i)];
    const float* p = ar.data() + d.offset / 4 + size_t(t0) * d.stride / 4;
    return std::vector<float>(p, p + size_t(n) * d.stride / 4);
  }
};

// The step's token rows: sequences with their row counts and first positions.
struct Rows {
  std::vector<int32_t> row0, seq_of_row;
  std::vector<int64_t> pos;
  Rows(std::vector<int> counts, std::vector<int64_t> p) : pos(std::move(p)) {
    row0.push_back(0);
    for (size_t b = 0; b < counts.size(); ++b) {
      for (int i = 0; i < counts[b]; ++i) seq_of_row.push_back(int32_t(b));
      row0.push_back(row0.back() + counts[b]);
    }
  }
  int n() const { return row0.back(); }
  int batch() const { return int(pos.size()); }
};

exec::StepCtx cpu_step(const ModelConfig& mc, const Numerics& num, std::vector<float>& ar,
                       const Problem& p, const Rows& r, const exec::SeqView* seqs) {
  exec::StepCtx s;
  s.cfg = &mc;
  s.num = num;
  s.arena = reinterpret_cast<uint8_t*>(ar.data());
  s.weights = p.wcpu.data();
  s.batch = r.batch();
  s.rows = plan::kMaxRows;
  s.n = r.n();
  s.seqs = seqs;
  s.pos = r.pos.data();
  s.row0 = r.row0.data();
  s.seq_of_row = r.seq_of_row.data();
  return s;
}

cuda::DevStep dev_step(const cuda::DevCfg& dc, const Numerics& num, std::vector<float>& ar,
                       const Problem& p, const Rows& r, const cuda::DevSeq* seqs) {
  cuda::DevStep s;
  s.cfg = dc;
  s.num = num;
  s.arena = reinterpret_cast<uint8_t*>(ar.data());
  s.buffers = p.bufs.data();
  s.weights = p.wdev.data();
  s.batch = r.batch();
  s.rows = plan::kMaxRows;
  s.n = r.n();
  s.seqs = seqs;
  s.pos = r.pos.data();
  s.row0 = r.row0.data();
  s.seq_of_row = r.seq_of_row.data();
  return s;
}

// Runs body(pipe) as one tile block on the simulation under scheduling seed `seed`.
void run_block(uint64_t seed, const std::function<void(cuda::Pipe&)>& body) {
  cuda::sim::config().seed = seed;
  cuda::sim::launch(1, cuda::kTileThreads, cuda::kSmemBytes, false, [&] {
    cuda::init_pipe();
    cuda::Pipe pipe;
    body(pipe);
  });
  cuda::sim::config().seed = 0;
}

Numerics numerics(bool round) {
  Numerics n;
  n.round_bf16 = round;
  n.round_beta = round;
  n.eps = 1e-5f;
  n.latent_eps = 1e-6f;
  return n;
}

// ---------------------------------------------------------------------------------------------
// KDA core.

struct KdaCase {
  int R = 1;               // rows of the tile's sequence (sequence 1; sequence 0 has 2 rows)
  bool log = false;        // row log (kda_state0 / conv0 / rowlog)
  bool bounded = false;    // K3's lower-bounded decay gate
  bool full_gate = false;  // K3's full-rank output gate
  bool round = false;      // BF16 numerics
};

// Per-sequence KDA state of one executor.
struct KdaSeq {
  std::vector<float> state, conv, state0, conv0, rowlog;
};

void kda_test(const KdaCase& kc) {
  constexpr int H = 4, K = 32, Wc = 4, kRank = 16;
  constexpr int64_t C = int64_t(H) * K;
  ModelConfig mc;
  mc.num_layers = 1;
  mc.kda_num_heads = H;
  mc.kda_head_dim = K;
  mc.kda_conv_size = Wc;
  mc.kda_gate_lower_bound = -5.0;
  cuda::DevCfg dc;
  dc.num_layers = 1;
  dc.kda_heads = H;
  dc.kda_head_dim = K;
  dc.kda_conv = Wc;
  dc.kda_gate_lower_bound = -5.0f;
  const Numerics num = numerics(kc.round);
  const Rows rows({2, kc.R}, {7, 11});
  const int n = rows.n(), t0 = rows.row0[1];

  Rng r(1234 + uint32_t(kc.R));
  Problem p;
  using KA = plan::arg::KdaCore;
  for (int i = 0; i < 3; ++i) p.act(n, int(C), r, -1, 1);  // q, k, v
  p.act(n, kRank, r, -1, 1);                               // fa
  p.act(n, kc.full_gate ? int(C) : kRank, r, -1, 1);       // ga (full gate: the gate itself)
  p.act(n, H, r, -2, 2);                                   // braw
  p.act(n, int(C), r, -1, 1);                              // o
  p.mat(C, kRank, r, 0.5f);                                // f_b
  p.mat(C, kRank, r, 0.5f);                                // g_b
  for (int i = 0; i < 3; ++i) p.vec(C * Wc, r, -0.6f, 0.6f);
  p.vec(H, r, -1.0f, 0.5f);  // A_log
  p.vec(C, r, -1.0f, 1.0f);  // dt_bias
  p.vec(K, r, 0.5f, 1.5f);   // o_norm
  p.state();
  p.state();
  ASSERT_EQ(p.bufs.size(), size_t(KA::count));

  KdaSeq init[2];
  for (auto& s : init) {
    s.state.resize(size_t(C * K));
    for (auto& x : s.state) x = r.uni(-0.3f, 0.3f);
    s.conv.resize(size_t(3 * (Wc - 1) * C));
    for (auto& x : s.conv) x = r.bfu(-1, 1);
    if (kc.log) {
      s.state0.assign(s.state.size(), -7.0f);
      s.conv0.assign(s.conv.size(), -7.0f);
      s.rowlog.assign(size_t(kc.R * kda_row_log_floats(mc)), -7.0f);
    }
  }
  plan::Instr in;
  in.op = plan::Op::kKdaCore;
  in.layer = 0;
  in.seq = 1;
  in.r0 = 1;
  in.r1 = 3;  // heads [1, 3)
  in.flags =
      (kc.bounded ? plan::kFlagBoundedDecay : 0) | (kc.full_gate ? plan::kFlagFullRankGate : 0);

  // What a run leaves: the o rows of the sequence, then its state, conv cache and row log.
  auto outputs = [&](const std::vector<float>& ar, const KdaSeq& s) {
    std::vector<std::vector<float>> o;
    o.push_back(p.rows(ar, KA::o, t0, kc.R));
    o.push_back(s.state);
    o.push_back(s.conv);
    o.push_back(s.state0);
    o.push_back(s.conv0);
    o.push_back(s.rowlog);
    return o;
  };
  auto seq_views = [&](KdaSeq* s, auto* v) {
    for (int b = 0; b < 2; ++b) {
      v[b].kda_state = s[b].state.data();
      v[b].conv_cache = s[b].conv.data();
      v[b].kda_state0 = kc.log ? s[b].state0.data() : nullptr;
      v[b].conv0 = kc.log ? s[b].conv0.data() : nullptr;
      v[b].rowlog = kc.log ? s[b].rowlog.data() : nullptr;
    }
  };

  // CPU.
  std::vector<float> ar_cpu = p.arena;
  KdaSeq cpu_s[2] = {init[0], init[1]};
  exec::SeqView sv[2];
  seq_views(cpu_s, sv);
  const exec::StepCtx sc = cpu_step(mc, num, ar_cpu, p, rows, sv);
  exec::Scratch scratch;
  scratch.f.resize(1 << 16);
  exec::detail::kda_core_tile(sc, in, exec::detail::Args{sc, p.bufs.data(), 0}, scratch);
  const auto want = outputs(ar_cpu, cpu_s[1]);

  std::vector<std::vector<float>> first;
  for (uint64_t seed : {0, 1, 2, 3}) {
    std::vector<float> ar = p.arena;
    KdaSeq dev_s[2] = {init[0], init[1]};
    cuda::DevSeq dv[2];
    seq_views(dev_s, dv);
    const cuda::DevStep ds = dev_step(dc, num, ar, p, rows, dv);
    run_block(seed, [&](cuda::Pipe& pipe) {
      cuda::kda_core_tile(ds, in, cuda::Args{ds, p.bufs.data(), 0}, pipe);
    });
    const auto got = outputs(ar, dev_s[1]);
    if (seed == 0) {
      first = got;
      const char* names[] = {"o", "state", "conv", "state0", "conv0", "rowlog"};
      for (size_t i = 0; i < got.size(); ++i) expect_close(got[i], want[i], kc.round, K, names[i]);
      // The conv cache and the copies are data movement: exact.
      EXPECT_TRUE(same_bits(got[2], want[2]));
      EXPECT_TRUE(same_bits(got[3], want[3]));
      EXPECT_TRUE(same_bits(got[4], want[4]));
      // The computation happened (the o rows changed, the row log was filled where it should).
      EXPECT_FALSE(same_bits(got[0], p.rows(p.arena, KA::o, t0, kc.R)));
    } else {
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_TRUE(same_bits(got[i], first[i])) << "seed " << seed << " output " << i;
    }
  }
}

TEST(CudaAttention, KdaOneRow) {
  kda_test({.R = 1});
}
TEST(CudaAttention, KdaChainedRowsWithRowLog) {
  kda_test({.R = 3, .log = true});
}
TEST(CudaAttention, KdaBoundedDecayFullGate) {
  kda_test({.R = 3, .log = true, .bounded = true, .full_gate = true});
}
TEST(CudaAttention, KdaBf16) {
  kda_test({.R = 3, .log = true, .round = true});
}
// Above plan::kMaxChainedRows the CPU tile runs the chunked prefill form and logs nothing; the
// CUDA tile stays row by row (the same math, fp32 rounding apart). 30 rows: two row groups.
TEST(CudaAttention, KdaManyRows) {
  kda_test({.R = 30, .log = true});
}

// ---------------------------------------------------------------------------------------------
// MLA.

constexpr int kMH = 4, kN = 16, kP = 8, kV = 16, kR = 32, kCW = kR + kP, kLd = 48;
constexpr int kPageRows = 16, kPages = 8;

ModelConfig mla_model() {
  ModelConfig mc;
  mc.num_layers = 1;
  mc.mla_num_heads = kMH;
  mc.qk_nope_head_dim = kN;
  mc.qk_rope_head_dim = kP;
  mc.v_head_dim = kV;
  mc.kv_lora_rank = kR;
  mc.q_lora_rank = 48;
  return mc;
}
cuda::DevCfg mla_dev() {
  cuda::DevCfg dc;
  dc.num_layers = 1;
  dc.mla_heads = kMH;
  dc.nope = kN;
  dc.rope = kP;
  dc.v_head = kV;
  dc.kv_lora = kR;
  dc.q_lora = 48;
  return dc;
}

// A page pool shared by two sequences, their page tables interleaved, so that a sequence's rows
// span several non-consecutive pages; the rows are bf16-valued random data (the padding too).
struct Pool {
  bool bf16;
  int64_t page_stride;
  std::vector<uint8_t> bytes;
  static constexpr int32_t kTable[2][4] = {{2, 5, 0, 7}, {1, 4, 6, 3}};
  Pool(bool b, Rng& r) : bf16(b) {
    page_stride = int64_t(kPageRows) * kLd * (b ? 2 : 4) + 64;
    bytes.resize(size_t(page_stride * kPages));
    for (size_t i = 0; i < bytes.size(); i += b ? 2 : 4) {
      const float v = r.bfu(-1, 1);
      if (b) {
        const uint16_t h = f32_to_bf16(v);
        std::memcpy(&bytes[i], &h, 2);
      } else {
        std::memcpy(&bytes[i], &v, 4);
      }
    }
  }
  cpu::LatentCache cache(int b) {
    cpu::LatentCache c;
    c.base = bytes.data();
    c.page_stride = page_stride;
    c.pages = kTable[b];
    c.page_rows = kPageRows;
    c.ld = kLd;
    c.bf16 = bf16;
    return c;
  }
  // The n first elements of row t of sequence b's cache, as fp32.
  std::vector<float> row(int b, int64_t t, int n) const {
    cpu::LatentCache c = const_cast<Pool*>(this)->cache(b);
    const auto* x = static_cast<const uint8_t*>(c.row(t));
    std::vector<float> f(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      if (bf16) {
        uint16_t h;
        std::memcpy(&h, x + 2 * i, 2);
        f[size_t(i)] = bf16_to_f32(h);
      } else {
        std::memcpy(&f[size_t(i)], x + 4 * i, 4);
      }
    }
    return f;
  }
  // Clears row t of sequence b (all ld elements), for comparing the rest of the pool.
  void clear(int b, int64_t t) {
    cpu::LatentCache c = cache(b);
    std::memset(c.row(t), 0, size_t(kLd) * (bf16 ? 2 : 4));
  }
  std::vector<float> as_floats() const {
    std::vector<float> f;
    for (size_t i = 0; i < bytes.size(); i += bf16 ? 2 : 4) {
      if (bf16) {
        uint16_t h;
        std::memcpy(&h, &bytes[i], 2);
        f.push_back(bf16_to_f32(h));
      } else {
        float v;
        std::memcpy(&v, &bytes[i], 4);
        f.push_back(v);
      }
    }
    return f;
  }
};

template <class View>
void mla_views(Pool& pool, View* v) {
  for (int b = 0; b < 2; ++b) v[b].mla = pool.cache(b);
}

struct MlaCase {
  bool bf16_cache = false;
  bool round = false;
  bool gate = false;
};

void mla_latent_test(const MlaCase& mcase) {
  const ModelConfig mc = mla_model();
  const cuda::DevCfg dc = mla_dev();
  const Numerics num = numerics(mcase.round);
  const Rows rows({2, 3}, {5, 45});  // sequence 1's rows cross from page 2 into page 3
  Rng r(77);
  Problem p;
  p.act(rows.n(), kCW, r, -2, 2);
  p.vec(kR, r, 0.5f, 1.5f);
  p.state();
  const Pool init(mcase.bf16_cache, r);
  plan::Instr in;
  in.op = plan::Op::kMlaLatent;
  in.layer = 0;
  in.r0 = 0;
  in.r1 = 2;

  std::vector<float> ar_cpu = p.arena;
  Pool cpu_pool = init;
  exec::SeqView sv[2];
  mla_views(cpu_pool, sv);
  const exec::StepCtx sc = cpu_step(mc, num, ar_cpu, p, rows, sv);
  exec::Scratch scratch;
  scratch.f.resize(1 << 16);
  exec::detail::mla_latent_tile(sc, in, exec::detail::Args{sc, p.bufs.data(), 0}, scratch);
  // The written rows (every token row's, at its position), then the rest of the pool.
  auto written = [&](Pool& pool) {
    std::vector<float> w;
    for (int t = 0; t < rows.n(); ++t) {
      const int b = rows.seq_of_row[size_t(t)];
      const std::vector<float> x = pool.row(b, rows.pos[size_t(b)] + t - rows.row0[size_t(b)], kCW);
      w.insert(w.end(), x.begin(), x.end());
    }
    for (int t = 0; t < rows.n(); ++t) {
      const int b = rows.seq_of_row[size_t(t)];
      pool.clear(b, rows.pos[size_t(b)] + t - rows.row0[size_t(b)]);
    }
    return w;
  };
  const std::vector<float> want = written(cpu_pool);
  Pool init_rest = init;
  const std::vector<float> before = written(init_rest);

  std::vector<float> first;
  for (uint64_t seed : {0, 1, 2, 3}) {
    std::vector<float> ar = p.arena;
    Pool pool = init;
    cuda::DevSeq dv[2];
    mla_views(pool, dv);
    const cuda::DevStep ds = dev_step(dc, num, ar, p, rows, dv);
    run_block(seed, [&](cuda::Pipe&) {
      cuda::mla_latent_tile(ds, in, cuda::Args{ds, p.bufs.data(), 0});
    });
    const std::vector<float> got = written(pool);
    if (seed == 0) {
      first = got;
      EXPECT_EQ(beyond_bf16_ulp(got, want), 0);
      expect_close(got, want, mcase.round || mcase.bf16_cache, 1, "rows");
      EXPECT_FALSE(same_bits(got, before));
      EXPECT_TRUE(pool.bytes == init_rest.bytes) << "rows other than the step's were written";
    } else {
      EXPECT_TRUE(same_bits(got, first)) << "seed " << seed;
    }
  }
}

TEST(CudaAttention, MlaLatentFp32) {
  mla_latent_test({});
}
TEST(CudaAttention, MlaLatentBf16) {
  mla_latent_test({.bf16_cache = true, .round = true});
}
// FP32 numerics into a bf16 cache: the store itself rounds (to nearest even).
TEST(CudaAttention, MlaLatentFp32IntoBf16) {
  mla_latent_test({.bf16_cache = true});
}

// The core: unsplit against the CPU's unsplit decode; split (3 splits, every slot) against the
// CPU's partials; the merge of the splits against the unsplit result.
void mla_core_test(const MlaCase& mcase) {
  const ModelConfig mc = mla_model();
  const cuda::DevCfg dc = mla_dev();
  const Numerics num = numerics(mcase.round);
  const Rows rows({2, 3}, {5, 45});  // sequence 1 attends to 46..48 rows: 3 pages
  constexpr int S = 3, PS = kR + 2;
  Rng r(99);
  Problem p;
  using M = plan::arg::MlaCore;
  p.act(rows.n(), kMH * (kN + kP), r, -1, 1);    // q
  p.mat(int64_t(kMH) * (kN + kV), kR, r, 0.4f);  // kv_b
  p.state();                                     // mla_cache
  p.act(rows.n(), kMH * kV, r, -1, 1);           // att (unsplit out)
  p.act(rows.n(), kMH * kV, r, -3, 3);           // gate
  const int parts = p.act(rows.n(), S * kMH * PS, r, -1, 1);
  const int att_split = p.act(rows.n(), kMH * kV, r, -1, 1);
  // The split core's operand list: [q, kv_b, cache, parts, gate]; the merge's: [parts, kv_b,
  // att, gate].
  std::vector<plan::BufferDesc> split_args = {p.bufs[M::q], p.bufs[M::kv_b], p.bufs[M::mla_cache],
                                              p.bufs[size_t(parts)], p.bufs[M::gate]};
  std::vector<plan::BufferDesc> merge_args = {p.bufs[size_t(parts)], p.bufs[M::kv_b],
                                              p.bufs[size_t(att_split)], p.bufs[M::gate]};
  const Pool init(mcase.bf16_cache, r);
  plan::Instr in;
  in.op = plan::Op::kMlaCore;
  in.layer = 0;
  in.seq = 1;
  in.r0 = 1;
  in.r1 = 4;  // heads [1, 4)
  in.flags = mcase.gate ? plan::kFlagOutputGate : 0;
  const int t0 = rows.row0[1], R1 = 3;

  // CPU: unsplit, and the split partials.
  std::vector<float> ar_cpu = p.arena;
  Pool cpu_pool = init;
  exec::SeqView sv[2];
  mla_views(cpu_pool, sv);
  const exec::StepCtx sc = cpu_step(mc, num, ar_cpu, p, rows, sv);
  exec::Scratch scratch;
  scratch.f.resize(1 << 16);
  exec::detail::mla_core_tile(sc, in, exec::detail::Args{sc, p.bufs.data(), 0}, scratch);
  for (int slot = 0; slot < S; ++slot) {
    plan::Instr is = in;
    is.splits = S;
    is.slot = uint16_t(slot);
    exec::detail::mla_core_tile(sc, is, exec::detail::Args{sc, split_args.data(), 0}, scratch);
  }
  plan::Instr im = in;
  im.op = plan::Op::kMlaMerge;
  im.splits = S;
  exec::detail::mla_merge_tile(sc, im, exec::detail::Args{sc, merge_args.data(), 0}, scratch);
  const std::vector<float> want_att = p.rows(ar_cpu, M::out, t0, R1);
  const std::vector<float> want_parts = p.rows(ar_cpu, parts, t0, R1);
  const std::vector<float> want_merged = p.rows(ar_cpu, att_split, t0, R1);

  std::vector<std::vector<float>> first;
  for (uint64_t seed : {0, 1, 2, 3}) {
    std::vector<float> ar = p.arena;
    Pool pool = init;
    cuda::DevSeq dv[2];
    mla_views(pool, dv);
    const cuda::DevStep ds = dev_step(dc, num, ar, p, rows, dv);
    run_block(seed, [&](cuda::Pipe&) {
      cuda::mla_core_tile(ds, in, cuda::Args{ds, p.bufs.data(), 0});
      for (int slot = 0; slot < S; ++slot) {
        plan::Instr is = in;
        is.splits = S;
        is.slot = uint16_t(slot);
        cuda::mla_core_tile(ds, is, cuda::Args{ds, split_args.data(), 0});
      }
      cuda::mla_merge_tile(ds, im, cuda::Args{ds, merge_args.data(), 0});
    });
    std::vector<std::vector<float>> got = {p.rows(ar, M::out, t0, R1), p.rows(ar, parts, t0, R1),
                                           p.rows(ar, att_split, t0, R1)};
    if (seed == 0) {
      first = got;
      const int nr = kR + kP;
      expect_close(got[0], want_att, mcase.round, nr, "unsplit");
      expect_close(got[1], want_parts, mcase.round, nr, "partials");
      expect_close(got[2], want_merged, mcase.round, nr, "merged");
      // The tile's heads [1, 4) of each row (att_split's head 0 is another buffer's junk).
      auto heads = [&](const std::vector<float>& x) {
        std::vector<float> y;
        for (int i = 0; i < R1; ++i)
          y.insert(y.end(), x.begin() + i * kMH * kV + kV, x.begin() + (i + 1) * kMH * kV);
        return y;
      };
      expect_close(heads(got[2]), heads(got[0]), mcase.round, nr, "split_vs_unsplit");
      // Heads outside [r0, r1) are untouched.
      const std::vector<float> before = p.rows(p.arena, M::out, t0, R1);
      for (int i = 0; i < R1; ++i)
        for (int v = 0; v < kV; ++v)
          EXPECT_EQ(got[0][size_t(i * kMH * kV + v)], before[size_t(i * kMH * kV + v)]);
    } else {
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_TRUE(same_bits(got[i], first[i])) << "seed " << seed << " output " << i;
    }
  }
}

TEST(CudaAttention, MlaCoreFp32Cache) {
  mla_core_test({});
}
TEST(CudaAttention, MlaCoreBf16Cache) {
  mla_core_test({.bf16_cache = true});
}
TEST(CudaAttention, MlaCoreBf16NumericsGated) {
  mla_core_test({.bf16_cache = true, .round = true, .gate = true});
}

// K3's q LoRA: rows [16, 80) of q for every token row.
void q_up_test(bool round) {
  const ModelConfig mc = mla_model();
  const cuda::DevCfg dc = mla_dev();
  const Numerics num = numerics(round);
  const Rows rows({2, 3}, {5, 45});
  const int Q = mc.q_lora_rank, QW = kMH * (kN + kP);
  Rng r(5);
  Problem p;
  using Qa = plan::arg::MlaQUp;
  p.mat(QW, Q, r, 0.3f);
  p.act(rows.n(), Q, r, -2, 2);
  p.vec(Q, r, 0.5f, 1.5f);
  p.act(rows.n(), QW, r, -1, 1);
  plan::Instr in;
  in.op = plan::Op::kMlaQUp;
  in.layer = 0;
  in.r0 = 16;
  in.r1 = 80;
  std::vector<float> ar_cpu = p.arena;
  const exec::StepCtx sc = cpu_step(mc, num, ar_cpu, p, rows, nullptr);
  exec::Scratch scratch;
  scratch.f.resize(1 << 16);
  exec::detail::mla_q_up_tile(sc, in, exec::detail::Args{sc, p.bufs.data(), 0}, scratch);
  const std::vector<float> want = p.rows(ar_cpu, Qa::q, 0, rows.n());
  std::vector<float> first;
  for (uint64_t seed : {0, 1, 2, 3}) {
    std::vector<float> ar = p.arena;
    const cuda::DevStep ds = dev_step(dc, num, ar, p, rows, nullptr);
    run_block(seed, [&](cuda::Pipe& pipe) {
      cuda::mla_q_up_tile(ds, in, cuda::Args{ds, p.bufs.data(), 0}, pipe);
    });
    const std::vector<float> got = p.rows(ar, Qa::q, 0, rows.n());
    if (seed == 0) {
      first = got;
      if (round) {
        EXPECT_EQ(beyond_bf16_ulp(got, want), 0);
      }
      expect_close(got, want, round, Q, "q");
      EXPECT_FALSE(same_bits(got, p.rows(p.arena, Qa::q, 0, rows.n())));
    } else {
      EXPECT_TRUE(same_bits(got, first)) << "seed " << seed;
    }
  }
}

TEST(CudaAttention, MlaQUpFp32) {
  q_up_test(false);
}
TEST(CudaAttention, MlaQUpBf16) {
  q_up_test(true);
}

}  // namespace
}  // namespace md
