// When the GPU tests (CudaGpu.*) run: they skip, saying why, only when the machine has no CUDA
// device. Any other failure to start one (no kernel image for this GPU, a driver too old, a
// library that did not load) fails them, and with MD_REQUIRE_GPU=1 (bench/gpu-check.sh sets it)
// so does a missing device: a run meant for a GPU must not pass by skipping.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "../../src/kernels/cuda/device.h"
#include "../exec/exec_test_util.h"
#include "megadecode/base/error.h"
#include "megadecode/kernels/cuda/sim.h"

namespace md::test {

// True when a GPU is there; false with the reason when there is no CUDA device. Other errors
// propagate (the test fails with them).
inline bool gpu_present(std::string* why) {
  try {
    cuda::make_gpu_device();
    return true;
  } catch (const Error& e) {
    const std::string m = e.what();
    if (m.find("no CUDA device") == std::string::npos) throw;
    *why = m;
    return false;
  }
}

// Row b of a lockstep step of the two CUDA executors (t.la: the megakernel, t.lb: op by op)
// against Model::forward's logits `want` for that row: the executors bit for bit, the next id
// the device's argmax, with FP32 the logits within 1e-4 of want's largest magnitude, and the
// greedy token want's where want's top two are further apart than 1/64 of it.
inline void expect_cuda_row(const LockstepStep& t, size_t b, int64_t V,
                            const std::vector<float>& want, bool fp32, const std::string& what) {
  const float* got = t.la.data() + b * size_t(V);
  expect_same_bits(t.lb.data() + b * size_t(V), got, size_t(V), "opbyop vs megakernel " + what);
  EXPECT_EQ(t.na[b], t.nb[b]) << what;
  EXPECT_EQ(t.na[b], int32_t(std::max_element(got, got + V) - got))
      << "the device argmax, " << what;
  double scale = 0;
  for (float v : want) scale = std::max(scale, double(std::fabs(v)));
  if (fp32) {
    double err = 0;
    for (int64_t i = 0; i < V; ++i)
      err = std::max(err, double(std::fabs(got[i] - want[size_t(i)])));
    EXPECT_LE(err, 1e-4 * scale) << "vs the reference, " << what;
  }
  std::vector<float> sorted(want);
  std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
  if (sorted[0] - sorted[1] > scale / 64) {
    EXPECT_EQ(t.na[b], int32_t(std::max_element(want.begin(), want.end()) - want.begin()))
        << "greedy token vs the reference, " << what;
  }
}

// The simulation's configuration for one test (restored after): `sms` blocks, and the seed of
// its scheduling order.
struct SimConfig {
  cuda::sim::Config saved = cuda::sim::config();
  explicit SimConfig(int sms, uint64_t seed = 0) {
    cuda::sim::config().sm_count = sms;
    cuda::sim::config().seed = seed;
  }
  ~SimConfig() { cuda::sim::config() = saved; }
};

inline bool gpu_required() {
  const char* e = std::getenv("MD_REQUIRE_GPU");
  return e && std::string(e) == "1";
}

}  // namespace md::test

// The first statement of a GPU test.
#define MD_NEED_GPU()                                                            \
  do {                                                                           \
    std::string why_;                                                            \
    if (!::md::test::gpu_present(&why_)) {                                       \
      if (::md::test::gpu_required()) FAIL() << "MD_REQUIRE_GPU=1 but " << why_; \
      GTEST_SKIP() << "no GPU here: " << why_;                                   \
    }                                                                            \
  } while (0)

// A test through the simulation on `sms` blocks (CudaSim.name), and the same on a GPU
// (CudaGpu.name, skipped with the reason when there is none): body(CudaTarget).
#define SIM_AND_GPU_TEST(name, sms, body) \
  TEST(CudaSim, name) {                   \
    ::md::test::SimConfig sc_(sms);       \
    body(::md::CudaTarget::kSim);         \
  }                                       \
  TEST(CudaGpu, name) {                   \
    MD_NEED_GPU();                        \
    body(::md::CudaTarget::kGpu);         \
  }
