// Kernel micro-benchmarks at Kimi Linear's shapes. Decode streams each weight once per token, so
// the figure of merit is weight bytes per second against the machine's read bandwidth. The
// weights come from a pool larger than the last-level cache (300 MB on the target), cycled so
// that every timed call reads from DRAM, as decode does. Because this host's bandwidth drifts
// over minutes, every kernel benchmark re-measures it just before and after its timing loop and
// reports the ratio (counter of_bw) next to both numbers.
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/threads.h"
#include "megadecode/base/util.h"
#include "megadecode/kernels/cpu/bandwidth.h"
#include "megadecode/kernels/cpu/cpu_features.h"
#include "megadecode/kernels/cpu/matmul.h"

namespace md::cpu {
namespace {

constexpr size_t kPoolBytes = size_t{1} << 30;
constexpr size_t kBandwidthBytes = size_t{512} << 20;

ThreadPool& pool(int threads) {
  static ThreadPool one(1), two(2);
  return threads == 1 ? one : two;
}

// The weight pool: kPoolBytes of small bf16 values (also readable as finite fp32), filled by the
// pool's threads so pages are placed where they are read.
bf16* weight_pool() {
  static bf16* p = [] {
    void* m = std::aligned_alloc(size_t{2} << 20, kPoolBytes);
    if (!m) std::abort();
    madvise(m, kPoolBytes, MADV_HUGEPAGE);
    bf16* w = static_cast<bf16*>(m);
    const size_t n = kPoolBytes / sizeof(bf16);
    pool(2).parallel_for(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        w[i] = f32_to_bf16(static_cast<float>(static_cast<int>((i * 2654435761u) % 2001) - 1000) *
                           1e-5f);
      }
    });
    return w;
  }();
  return p;
}

std::vector<float> make_x(int B, int64_t K) {
  std::vector<float> x(static_cast<size_t>(B * K));
  Rng rng(7);
  for (auto& v : x) v = round_bf16(static_cast<float>(rng.normal()));
  return x;
}

double bandwidth(int threads) {
  return measure_read_bandwidth_gbps(pool(threads), kBandwidthBytes, 3);
}

// Runs `call(slot)` in the timing loop with slot cycling through the weight pool, and sets the
// byte and bandwidth counters. bytes_per_call is the weight bytes one call streams.
template <class Call>
void run_timed(benchmark::State& state, int threads, size_t bytes_per_call, Call call) {
  const size_t slots = std::max<size_t>(1, kPoolBytes / bytes_per_call);
  const double bw_before = bandwidth(threads);
  size_t slot = 0;
  double t0 = now_seconds();
  for (auto _ : state) {
    call(slot);
    if (++slot == slots) slot = 0;
  }
  const double secs = now_seconds() - t0;
  const double bw_after = bandwidth(threads);
  const double bytes =
      static_cast<double>(bytes_per_call) * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  const double bw = 0.5 * (bw_before + bw_after);
  state.counters["read_bw_GBps"] = bw;
  state.counters["of_bw"] = bytes / secs * 1e-9 / bw;
}

// Splits rows across the pool's threads in multiples of 16 (the GEMV row tile) as the engine
// does.
void split_rows(ThreadPool& tp, int64_t rows, const std::function<void(int64_t, int64_t)>& f) {
  if (tp.size() == 1) {
    f(0, rows);
    return;
  }
  tp.parallel_for(
      static_cast<size_t>(rows),
      [&](size_t b, size_t e) { f(static_cast<int64_t>(b), static_cast<int64_t>(e)); }, 16);
}

// Args: rows, K, threads, B, x_is_bf16, portable.
void BM_MatmulBf16(benchmark::State& state) {
  const int64_t rows = state.range(0), K = state.range(1);
  const int threads = static_cast<int>(state.range(2)), B = static_cast<int>(state.range(3));
  const bool x_bf16 = state.range(4) != 0;
  if (state.range(5) != 0) set_isa(Isa::kPortable);
  const size_t bytes = static_cast<size_t>(rows * K) * sizeof(bf16);
  const auto x = make_x(B, K);
  std::vector<float> y(static_cast<size_t>(B * rows));
  bf16* wp = weight_pool();
  ThreadPool& tp = pool(threads);
  run_timed(state, threads, bytes, [&](size_t slot) {
    const bf16* W = wp + slot * static_cast<size_t>(rows * K);
    split_rows(tp, rows, [&](int64_t r0, int64_t r1) {
      matmul_bf16(W, K, r0, r1, x.data(), B, K, y.data(), rows, x_bf16);
    });
    benchmark::DoNotOptimize(y.data());
  });
  state.counters["FLOPS"] = benchmark::Counter(
      2.0 * static_cast<double>(rows * K) * B * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
  state.SetLabel(matmul_isa());
  reset_isa();
}

// The fp32 router gate: [experts x hidden] fp32.
void BM_MatmulF32(benchmark::State& state) {
  const int64_t rows = state.range(0), K = state.range(1);
  const int threads = static_cast<int>(state.range(2)), B = static_cast<int>(state.range(3));
  const size_t bytes = static_cast<size_t>(rows * K) * sizeof(float);
  const auto x = make_x(B, K);
  std::vector<float> y(static_cast<size_t>(B * rows));
  const float* wp = reinterpret_cast<const float*>(weight_pool());
  ThreadPool& tp = pool(threads);
  run_timed(state, threads, bytes, [&](size_t slot) {
    const float* W = wp + slot * static_cast<size_t>(rows * K);
    split_rows(tp, rows, [&](int64_t r0, int64_t r1) {
      matmul_f32(W, K, r0, r1, x.data(), B, K, y.data(), rows);
    });
    benchmark::DoNotOptimize(y.data());
  });
}

// The plain 64-byte-load stream over the 1 GiB pool: the ceiling the GEMV numbers compare to.
void BM_ReadBandwidth(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const unsigned char* p = reinterpret_cast<const unsigned char*>(weight_pool());
  ThreadPool& tp = pool(threads);
  for (auto _ : state) {
    tp.parallel_for(
        kPoolBytes,
        [&](size_t b, size_t e) { benchmark::DoNotOptimize(stream_read_sum(p + b, e - b)); }, 4096);
  }
  state.SetBytesProcessed(static_cast<int64_t>(kPoolBytes) * state.iterations());
  state.counters["median_GBps"] = bandwidth(threads);
}

// GEMV (B = 1) at the model's shapes: attention/KDA projections [2304 x 2304], expert up/gate
// [1024 x 2304] and down [2304 x 1024], and an eighth of the LM head [163840 / 8 x 2304].
void gemv_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "K", "thr", "B", "xbf16", "port"});
  for (int threads : {1, 2}) {
    for (auto [rows, K] : {std::pair{2304, 2304}, {1024, 2304}, {2304, 1024}, {20480, 2304}}) {
      b->Args({rows, K, threads, 1, 1, 0});
    }
    b->Args({2304, 2304, threads, 1, 0, 0});  // fp32 activations
    b->Args({2304, 2304, threads, 1, 1, 1});  // portable path
  }
}

// Batched decode and prefill chunks: arithmetic intensity grows with B.
void batch_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "K", "thr", "B", "xbf16", "port"});
  for (int threads : {1, 2}) {
    for (int B : {4, 16, 64, 256}) b->Args({2304, 2304, threads, B, 1, 0});
    b->Args({2304, 2304, threads, 16, 0, 0});
  }
}

BENCHMARK(BM_ReadBandwidth)->ArgName("thr")->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(BM_MatmulBf16)->Name("Gemv")->Apply(gemv_args)->UseRealTime();
BENCHMARK(BM_MatmulBf16)->Name("Batch")->Apply(batch_args)->UseRealTime();
BENCHMARK(BM_MatmulF32)
    ->Name("RouterF32")
    ->ArgNames({"rows", "K", "thr", "B"})
    ->Args({256, 2304, 1, 1})
    ->Args({256, 2304, 2, 1})
    ->UseRealTime();

}  // namespace
}  // namespace md::cpu

BENCHMARK_MAIN();

// ---- MXFP4 (Kimi K3 routed experts) ----------------------------------------------------------
// Registered after BENCHMARK_MAIN so that this block is a pure append; registration is static
// initialisation, so its position in the file does not matter.
#include "megadecode/kernels/cpu/mxfp4.h"
#include "megadecode/kernels/cpu/qdot.h"

namespace md::cpu {
namespace {

// A second 1 GiB pool for MXFP4 matrices (each slot is packed [rows, K/2] then scales
// [rows, K/32]). Every byte is in [118, 127]: as codes that is a valid pair of e2m1 values, as a
// scale 2^-9..2^0, so no slot has NaN or subnormal arithmetic whatever the shape.
uint8_t* mxfp4_pool() {
  static uint8_t* p = [] {
    void* m = std::aligned_alloc(size_t{2} << 20, kPoolBytes);
    if (!m) std::abort();
    madvise(m, kPoolBytes, MADV_HUGEPAGE);
    uint8_t* w = static_cast<uint8_t*>(m);
    pool(2).parallel_for(kPoolBytes, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) w[i] = static_cast<uint8_t>(118 + (i * 2654435761u >> 7) % 10);
    });
    return w;
  }();
  return p;
}

// Args: rows, K, threads, B, x_is_bf16, portable. Bytes are the packed codes plus the scales
// (4.25 bits per weight); Gweights_per_s compares with the bf16 GEMV at the same shape. kA8: the
// integer dot-product kernel (qdot.h, --act-quant int8) on the same bytes.
template <bool kA8 = false>
void BM_MatmulMxfp4(benchmark::State& state) {
  const int64_t rows = state.range(0), K = state.range(1);
  const int threads = static_cast<int>(state.range(2)), B = static_cast<int>(state.range(3));
  const bool x_bf16 = state.range(4) != 0;
  if (state.range(5) != 0) set_isa(Isa::kPortable);
  const size_t packed_bytes = static_cast<size_t>(rows * K / 2);
  const size_t bytes = packed_bytes + static_cast<size_t>(rows * K / 32);
  const auto x = make_x(B, K);
  std::vector<float> y(static_cast<size_t>(B * rows));
  uint8_t* wp = mxfp4_pool();
  ThreadPool& tp = pool(threads);
  run_timed(state, threads, bytes, [&](size_t slot) {
    const uint8_t* P = wp + slot * bytes;
    const uint8_t* S = P + packed_bytes;
    split_rows(tp, rows, [&](int64_t r0, int64_t r1) {
      if constexpr (kA8) {
        matmul_qdot(QdotWeights{P, S, K, 32, QdotCodes::kMxfp4}, r0, r1, x.data(), B, K, y.data(),
                    rows);
      } else {
        matmul_mxfp4(P, S, K, r0, r1, x.data(), B, K, y.data(), rows, x_bf16);
      }
    });
    benchmark::DoNotOptimize(y.data());
  });
  state.counters["Gweights_per_s"] = benchmark::Counter(
      static_cast<double>(rows * K) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate);
  state.SetLabel(kA8 ? matmul_qdot_isa() : matmul_mxfp4_isa());
  reset_isa();
}

// Kimi K3 routed expert shapes in the 3584-wide latent: gate/up [3072 x 3584] and down
// [3584 x 3072] as (rows, K); MXFP4 against bf16 in the same run.
void k3_expert_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "K", "thr", "B", "xbf16", "port"});
  for (int threads : {1, 2}) {
    for (auto [rows, K] : {std::pair{3072, 3584}, {3584, 3072}}) {
      b->Args({rows, K, threads, 1, 1, 0});
    }
  }
  b->Args({3072, 3584, 1, 1, 0, 0});  // fp32 activations
  for (int B : {2, 4, 8}) b->Args({3072, 3584, 1, B, 1, 0});  // small decode batches
  b->Args({3072, 3584, 1, 1, 1, 1});  // portable path
}

BENCHMARK(BM_MatmulMxfp4<>)->Name("K3ExpertMxfp4")->Apply(k3_expert_args)->UseRealTime();
BENCHMARK(BM_MatmulMxfp4<true>)->Name("K3ExpertMxfp4A8")->Apply(k3_expert_args)->UseRealTime();
BENCHMARK(BM_MatmulBf16)->Name("K3ExpertBf16")->Apply(k3_expert_args)->UseRealTime();

}  // namespace
}  // namespace md::cpu

// ---- MLA decode (absorbed, one token) ---------------------------------------------------------
// Registered after BENCHMARK_MAIN, as the MXFP4 block.
#include "megadecode/kernels/cpu/mla.h"

namespace md::cpu {
namespace {

// Args: T (cache rows), heads (of 32, from head 0), layout, portable. Layout 0: one contiguous fp32
// page (LatentCache::contiguous); 1: bf16 pages of 64 rows in a scrambled order; 2: the same with
// fp32 pages. Kimi Linear's MLA dims (R 512, P 64, N 128, V 128). One thread; the cache and kv_b
// stay in the CPU caches between calls, so this times the kernel's arithmetic and L2 traffic.
void BM_MlaDecode(benchmark::State& state) {
  const int T = static_cast<int>(state.range(0)), nh = static_cast<int>(state.range(1));
  const int layout = static_cast<int>(state.range(2));
  if (state.range(3) != 0) set_isa(Isa::kPortable);
  const MlaDims d{32, 128, 64, 128, 512};
  const int64_t ld = d.R + d.P;
  Rng rng(11);
  std::vector<float> rows(static_cast<size_t>(T) * ld), q(static_cast<size_t>(d.H) * (d.N + d.P));
  for (auto& x : rows) x = round_bf16(static_cast<float>(rng.normal()));
  for (auto& x : q) x = static_cast<float>(2.0 * rng.normal());
  std::vector<bf16> kvb(static_cast<size_t>(d.H) * (d.N + d.V) * d.R);
  for (auto& w : kvb) w = f32_to_bf16(static_cast<float>(rng.normal() / std::sqrt(double(d.R))));
  LatentCache cache = LatentCache::contiguous(rows.data(), ld, T);
  std::vector<unsigned char> paged;
  std::vector<int32_t> pages;
  if (layout != 0) {
    const int page_rows = 64, npages = (T + page_rows - 1) / page_rows;
    for (int i = 0; i < npages; ++i) pages.push_back((i * 7 + 3) % npages);  // a permutation
    if (npages % 7 == 0) std::iota(pages.begin(), pages.end(), 0);           // (7 coprime)
    cache.bf16 = layout == 1;
    cache.page_rows = page_rows;
    cache.page_stride = page_rows * ld * static_cast<int64_t>(cache.elem_bytes());
    paged.resize(static_cast<size_t>(cache.page_stride) * npages);
    cache.base = paged.data();
    cache.pages = pages.data();
    for (int t = 0; t < T; ++t) store_latent_row(cache, t, rows.data() + t * ld, ld);
  }
  std::vector<float> out(static_cast<size_t>(d.H) * d.V), scratch(static_cast<size_t>(T) + 2 * d.R);
  for (auto _ : state) {
    mla_decode_absorbed(q.data(), cache, T, kvb.data(), d, 0, nh, out.data(), scratch.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetLabel(std::string(mla_isa()) + (layout == 0   ? " fp32 contiguous"
                                           : layout == 1 ? " bf16 paged"
                                                         : " fp32 paged"));
  reset_isa();
}

BENCHMARK(BM_MlaDecode)
    ->Name("MlaDecode")
    ->ArgNames({"T", "heads", "layout", "port"})
    ->Args({4096, 32, 0, 0})
    ->Args({4096, 32, 1, 0})
    ->Args({4096, 32, 2, 0})
    ->Args({4096, 4, 0, 0})
    ->Args({4096, 4, 1, 0})
    ->Args({4096, 32, 0, 1})
    ->Args({4096, 32, 1, 1})
    // A short context, as a decode's first steps: the absorbed products with W_UK / W_UV (8.4 MB of
    // kv_b, from L3 here, from DRAM in a model) are the work, not the cache.
    ->Args({32, 32, 1, 0})
    ->Args({32, 8, 1, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace md::cpu

// ---- int4 / int8 (W4A16 / W8A16, --quantize int4|int8) -------------------------------------------
#include "megadecode/kernels/cpu/fp8.h"
#include "megadecode/kernels/cpu/int4.h"
#include "megadecode/kernels/cpu/int8.h"

namespace md::cpu {
namespace {

// Args: rows, K, threads, B, group, portable; Bits 4 or 8; kAct 8 or 16: the integer dot-product
// kernel (qdot.h: activations quantized to int8 or int16, --act-quant int8|int16) instead of
// W4A16 / W8A16 (kAct 0). Slots of the
// MXFP4 pool hold codes [rows, K * Bits / 8] then bf16 scales [rows, K/group] (the pool's bytes
// make finite scales). Bytes are codes + scales. kZp (int4): asymmetric, the zero points' terms
// after the kernel (int4_zero_point_terms, as linear_rows runs them), zero points of the byte a
// group they are stored as counted in the bytes.
template <int Bits, int kAct = 0, bool kZp = false>
void BM_MatmulInt(benchmark::State& state) {
  constexpr bool kA8 = kAct != 0;  // (any integer activations)
  const int64_t rows = state.range(0), K = state.range(1);
  const int threads = static_cast<int>(state.range(2)), B = static_cast<int>(state.range(3));
  const int group = static_cast<int>(state.range(4));
  if (state.range(5) != 0) set_isa(Isa::kPortable);
  // hot: every call reads the same matrix, which stays in L2 if small: the kernel's compute
  // ceiling, to set beside its DRAM rate (memory-bound or not). Every call takes the same
  // vectors, so the integer kernels reuse their packing (qdot_packed_from.h) and these A8 figures
  // leave the packing out, as a worker's consecutive tiles of one op do.
  const bool hot = state.range(6) != 0;
  const size_t packed_bytes = static_cast<size_t>(rows * K * Bits / 8);
  const size_t bytes =
      packed_bytes + static_cast<size_t>(rows * (K / group) * (kZp ? 3 : 2));  // (+ zero points)
  const auto x = make_x(B, K);
  std::vector<int8_t> zp(kZp ? static_cast<size_t>(rows * (K / group)) : 0);
  for (size_t i = 0; i < zp.size(); ++i) zp[i] = static_cast<int8_t>(int(i * 7 % 16) - 8);
  std::vector<float> y(static_cast<size_t>(B * rows));
  uint8_t* wp = mxfp4_pool();
  ThreadPool& tp = pool(threads);
  run_timed(state, threads, bytes, [&](size_t slot) {
    const uint8_t* P = wp + (hot ? 0 : slot) * bytes;
    const auto* S = reinterpret_cast<const bf16*>(P + packed_bytes);
    split_rows(tp, rows, [&](int64_t r0, int64_t r1) {
      if constexpr (kA8) {
        matmul_qdot(QdotWeights{P, reinterpret_cast<const uint8_t*>(S), K, group,
                                Bits == 4 ? QdotCodes::kInt4 : QdotCodes::kInt8,
                                kAct == 16 ? QdotActs::kInt16 : QdotActs::kInt8},
                    r0, r1, x.data(), B, K, y.data(), rows);
      } else if constexpr (Bits == 4) {
        matmul_int4(P, S, K, group, r0, r1, x.data(), B, K, y.data(), rows);
      } else {
        matmul_int8(P, S, K, group, r0, r1, x.data(), B, K, y.data(), rows);
      }
      if constexpr (kZp)
        int4_zero_point_terms(S, zp.data(), K, group, r0, r1, x.data(), B, K, y.data(), rows);
    });
    benchmark::DoNotOptimize(y.data());
  });
  state.counters["Gweights_per_s"] = benchmark::Counter(
      static_cast<double>(rows * K) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate);
  state.SetLabel(kA8 ? matmul_qdot_isa() : Bits == 4 ? matmul_int4_isa() : matmul_int8_isa());
  reset_isa();
}

// Kimi-Linear-48B's dense MLP shapes (hidden 2304, intermediate 9216) as (rows, K): int4 and int8
// group 128 against bf16 (BM_MatmulBf16, "Kl48DenseBf16") in the same run.
void kl48_int4_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "K", "thr", "B", "group", "port", "hot"});
  for (int threads : {1, 2})
    for (auto [rows, K] : {std::pair{9216, 2304}, {2304, 9216}})
      b->Args({rows, K, threads, 1, 128, 0, 0});
  b->Args({9216, 2304, 1, 1, 32, 0, 0});
  b->Args({9216, 2304, 1, 1, 2304, 0, 0});  // one scale per row
  for (int B : {4, 8}) b->Args({9216, 2304, 1, B, 128, 0, 0});
  b->Args({9216, 2304, 1, 1, 128, 1, 0});  // portable path
  b->Args({256, 2304, 1, 1, 128, 0, 1});   // 256 rows (<= 0.6 MB) from L2: the compute ceiling
}
void kl48_bf16_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "K", "thr", "B", "xbf16", "port"});
  for (int threads : {1, 2})
    for (auto [rows, K] : {std::pair{9216, 2304}, {2304, 9216}}) b->Args({rows, K, threads, 1, 1, 0});
  for (int B : {4, 8}) b->Args({9216, 2304, 1, B, 1, 0});
}

BENCHMARK(BM_MatmulInt<4>)->Name("Kl48DenseInt4")->Apply(kl48_int4_args)->UseRealTime();
BENCHMARK(BM_MatmulInt<8>)->Name("Kl48DenseInt8")->Apply(kl48_int4_args)->UseRealTime();
BENCHMARK(BM_MatmulInt<4, 8>)->Name("Kl48DenseInt4A8")->Apply(kl48_int4_args)->UseRealTime();
BENCHMARK(BM_MatmulInt<8, 8>)->Name("Kl48DenseInt8A8")->Apply(kl48_int4_args)->UseRealTime();
BENCHMARK(BM_MatmulInt<4, 16>)->Name("Kl48DenseInt4A16i")->Apply(kl48_int4_args)->UseRealTime();
BENCHMARK(BM_MatmulInt<8, 16>)->Name("Kl48DenseInt8A16i")->Apply(kl48_int4_args)->UseRealTime();
// Asymmetric int4 (zero points): the same shapes against the symmetric cases above.
void kl48_zp_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "K", "thr", "B", "group", "port", "hot"});
  for (int threads : {1, 2})
    for (auto [rows, K] : {std::pair{9216, 2304}, {2304, 9216}})
      b->Args({rows, K, threads, 1, 128, 0, 0});
  b->Args({256, 2304, 1, 1, 128, 0, 1});
}
BENCHMARK(BM_MatmulInt<4, 0, true>)->Name("Kl48DenseInt4Zp")->Apply(kl48_zp_args)->UseRealTime();
BENCHMARK(BM_MatmulInt<4, 8, true>)->Name("Kl48DenseInt4A8Zp")->Apply(kl48_zp_args)->UseRealTime();

// FP8 e4m3 with fp32 scales per row and group (the loader's expanded block scales): values from the
// MXFP4 pool with NaN bytes cleared once, scales 1.0 in their own buffer (pool bytes read as fp32
// could be subnormal and slow the FMAs down). Bytes are values + scales.
void BM_MatmulFp8(benchmark::State& state) {
  const int64_t rows = state.range(0), K = state.range(1);
  const int threads = static_cast<int>(state.range(2)), B = static_cast<int>(state.range(3));
  const int group = static_cast<int>(state.range(4));
  if (state.range(5) != 0) set_isa(Isa::kPortable);
  const size_t value_bytes = static_cast<size_t>(rows * K);
  const std::vector<float> scales(static_cast<size_t>(rows * (K / group)), 1.0f);
  const size_t bytes = value_bytes + scales.size() * sizeof(float);
  static const bool cleared = [] {
    uint8_t* p = mxfp4_pool();
    for (size_t i = 0; i < kPoolBytes; ++i)
      if ((p[i] & 0x7f) == 0x7f) p[i] = 0x7e;
    return true;
  }();
  (void)cleared;
  const auto x = make_x(B, K);
  std::vector<float> y(static_cast<size_t>(B * rows));
  uint8_t* wp = mxfp4_pool();
  ThreadPool& tp = pool(threads);
  run_timed(state, threads, bytes, [&](size_t slot) {
    const uint8_t* P = wp + slot * value_bytes;
    split_rows(tp, rows, [&](int64_t r0, int64_t r1) {
      matmul_fp8(P, scales.data(), K, group, r0, r1, x.data(), B, K, y.data(), rows);
    });
    benchmark::DoNotOptimize(y.data());
  });
  state.counters["Gweights_per_s"] = benchmark::Counter(
      static_cast<double>(rows * K) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate);
  state.SetLabel(matmul_fp8_isa());
  reset_isa();
}
BENCHMARK(BM_MatmulFp8)->Name("Kl48DenseFp8")->Apply(kl48_int4_args)->UseRealTime();
BENCHMARK(BM_MatmulBf16)->Name("Kl48DenseBf16")->Apply(kl48_bf16_args)->UseRealTime();

}  // namespace
}  // namespace md::cpu

// ---- GEMV split into calls, as the decode plan's tiles are -------------------------------------
#include "megadecode/kernels/cpu/stream_hint.h"

namespace md::cpu {
namespace {
// Args: rows, K, threads, call_rows, scattered, hint. Each thread's rows are walked in calls of
// call_rows rows (a plan instruction each). scattered: consecutive calls read different matrices
// (call k of an iteration reads its rows from pool slot (slot + k) % slots, so the next call's
// bytes are not the ones after this call's, as at a matrix boundary); every row is still read once
// an iteration. hint: each call is a StreamCall with the next call's rows listed as upcoming
// (stream_hint.h), as the executors do.
void BM_MatmulBf16Calls(benchmark::State& state) {
  const int64_t rows = state.range(0), K = state.range(1), cr = state.range(3);
  const int threads = static_cast<int>(state.range(2));
  const bool scattered = state.range(4) != 0, hint = state.range(5) != 0;
  const size_t bytes = static_cast<size_t>(rows * K) * sizeof(bf16);
  const auto x = make_x(1, K);
  std::vector<float> y(static_cast<size_t>(rows));
  bf16* wp = weight_pool();
  ThreadPool& tp = pool(threads);
  const size_t slots = std::max<size_t>(1, kPoolBytes / bytes);
  auto rows_of = [&](size_t slot, int64_t k, int64_t r) {
    const size_t s = scattered ? (slot + size_t(k)) % slots : slot;
    return wp + s * static_cast<size_t>(rows * K) + r * K;
  };
  run_timed(state, threads, bytes, [&](size_t slot) {
    split_rows(tp, rows, [&](int64_t r0, int64_t r1) {
      int64_t k = 0;
      for (int64_t r = r0; r < r1; r += cr, ++k) {
        const int64_t re = std::min(r + cr, r1);
        const bf16* W = rows_of(slot, k, 0);
        if (!hint) {
          matmul_bf16(W, K, r, re, x.data(), 1, K, y.data(), rows, true);
          continue;
        }
        const bf16* own = rows_of(slot, k, r);
        const bf16* nx = rows_of(slot, k + 1, re);
        const ByteSpan up[2] = {
            {reinterpret_cast<const char*>(own), reinterpret_cast<const char*>(own + (re - r) * K)},
            {reinterpret_cast<const char*>(nx),
             reinterpret_cast<const char*>(nx + std::min(cr, r1 - re) * K)}};
        set_upcoming_streams(up, re < r1 ? 2 : 1);
        const StreamCall call(own, own + (re - r) * K);
        matmul_bf16(W, K, r, re, x.data(), 1, K, y.data(), rows, true);
      }
    });
    benchmark::DoNotOptimize(y.data());
  });
}
BENCHMARK(BM_MatmulBf16Calls)
    ->Name("Kl48DenseBf16Calls")
    ->ArgNames({"rows", "K", "thr", "call_rows", "scattered", "hint"})
    ->Args({9216, 2304, 1, 9216, 0, 0})
    ->Args({9216, 2304, 1, 64, 0, 0})
    ->Args({9216, 2304, 1, 64, 1, 0})
    ->Args({9216, 2304, 1, 64, 1, 1})
    ->Args({9216, 2304, 1, 32, 1, 0})
    ->Args({9216, 2304, 1, 32, 1, 1})
    ->Args({9216, 2304, 2, 64, 1, 0})
    ->Args({9216, 2304, 2, 64, 1, 1})
    ->UseRealTime();
}  // namespace
}  // namespace md::cpu

// ---- The routed experts' gate/up phase of one MoE layer, as the decode plan runs it ------------
namespace md::cpu {
namespace {
// Args: threads, layout, hint. One iteration is one layer of kimi-linear's MoE at batch 1 in int4
// W4A8 (group 128): 8 of 32 experts, each a gate and an up matrix of 1024 x 2304 (codes, then
// bf16 scales), in tiles of 112 rows (the plan's ~256 KiB), each tile the gate rows then the up
// rows over the same vector; the 80 tiles shared as two contiguous runs (threads 2), as
// split_phase does. layout 0: the experts at their places among the layer's 32 (a layer a pool
// slot); layout 1: the same calls over one contiguous region of the same bytes (what a dense
// matrix of 16384 rows would read). hint: each call's stream list as the executor sets it (this
// tile's gate and up rows, then the next tile's gate rows).
void BM_ExpertsInt4A8(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const bool dense = state.range(1) != 0, hint = state.range(2) != 0;
  constexpr int64_t kRows = 1024, kK = 2304, kGroup = 128, kTile = 112;
  constexpr int kExperts = 32, kChosen = 8;
  const size_t codes = size_t(kRows * kK / 2), mat = codes + size_t(kRows * (kK / kGroup) * 2);
  const size_t layer = mat * 2 * kExperts;
  const auto x = make_x(1, kK);
  std::vector<float> y(size_t(kRows) * 2 * kChosen);
  uint8_t* wp = mxfp4_pool();
  ThreadPool& tp = pool(threads);
  struct Tile {
    int e;  // chosen expert 0..7
    int64_t r0, r1;
  };
  std::vector<Tile> tiles;
  for (int e = 0; e < kChosen; ++e)
    for (int64_t r = 0; r < kRows; r += kTile) tiles.push_back({e, r, std::min(r + kTile, kRows)});
  const int chosen[kChosen] = {3, 7, 11, 12, 19, 22, 28, 30};
  run_timed(state, threads, mat * 2 * kChosen, [&](size_t slot) {
    // run_timed cycles slot over pool / (16 matrices): use its layer, so that every layer is
    // visited (the pool holds 13 layers of 32 experts).
    const uint8_t* L = wp + (slot % (kPoolBytes / layer)) * layer;
    auto matrix = [&](int e, int which) {  // which: 0 gate, 1 up
      return dense ? L + (size_t(e) * 2 + size_t(which)) * mat
                   : L + (size_t(chosen[e]) * 2 + size_t(which)) * mat;
    };
    tp.parallel_for(
        tiles.size(),
        [&](size_t b, size_t end) {
          for (size_t t = b; t < end; ++t) {
            const Tile& tl = tiles[t];
            for (int which = 0; which < 2; ++which) {
              const uint8_t* M = matrix(tl.e, which);
              const QdotWeights w{M, M + codes, kK, kGroup, QdotCodes::kInt4};
              const char* own = reinterpret_cast<const char*>(M) + tl.r0 * kK / 2;
              const char* own_end = reinterpret_cast<const char*>(M) + tl.r1 * kK / 2;
              float* yt = y.data() + (size_t(tl.e) * 2 + size_t(which)) * kRows;
              if (!hint) {
                matmul_qdot(w, tl.r0, tl.r1, x.data(), 1, kK, yt, kRows);
                continue;
              }
              ByteSpan up[3];
              int n = 0;
              if (which == 0) {
                const uint8_t* U = matrix(tl.e, 1);
                up[n++] = {own, own_end};
                up[n++] = {reinterpret_cast<const char*>(U) + tl.r0 * kK / 2,
                           reinterpret_cast<const char*>(U) + tl.r1 * kK / 2};
              } else {
                up[n++] = {own, own_end};
              }
              if (t + 1 < end) {
                const Tile& nx = tiles[t + 1];
                const char* g = reinterpret_cast<const char*>(matrix(nx.e, 0));
                up[n++] = {g + nx.r0 * kK / 2, g + nx.r1 * kK / 2};
              }
              set_upcoming_streams(up, n);
              const StreamCall call(own, own_end);
              matmul_qdot(w, tl.r0, tl.r1, x.data(), 1, kK, yt, kRows);
            }
          }
        },
        tiles.size() / size_t(threads));
    benchmark::DoNotOptimize(y.data());
  });
  set_upcoming_streams(nullptr, 0);
}
BENCHMARK(BM_ExpertsInt4A8)
    ->Name("Kl48ExpertsInt4A8")
    ->ArgNames({"thr", "dense", "hint"})
    ->Args({1, 0, 1})
    ->Args({1, 1, 1})
    ->Args({2, 0, 0})
    ->Args({2, 0, 1})
    ->Args({2, 1, 1})
    ->UseRealTime();
}  // namespace
}  // namespace md::cpu
