// When the GPU tests (CudaGpu.*) run: they skip, saying why, only when the machine has no CUDA
// device. Any other failure to start one (no kernel image for this GPU, a driver too old, a
// library that did not load) fails them, and with MD_REQUIRE_GPU=1 (bench/gpu-check.sh sets it)
// so does a missing device: a run meant for a GPU must not pass by skipping.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "../../src/kernels/cuda/device.h"
#include "megadecode/base/error.h"

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
