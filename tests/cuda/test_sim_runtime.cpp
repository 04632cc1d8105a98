// The simulation of the CUDA execution model itself (src/kernels/cuda/sim): what it promises
// device code — barriers, warp collectives in the hardware's order, atomics, bulk copies with
// byte-count checks — and what it catches: deadlocks and bad copies, as errors that say what.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "megadecode/base/error.h"
#define MD_CUDA_SIM 1
#include "../../src/kernels/cuda/port/port.h"

namespace md::cuda {
namespace {

using ::testing::HasSubstr;

TEST(CudaSimRuntime, BarriersAndWarpSumsInEveryOrder) {
  for (uint64_t seed : {0, 1, 7}) {
    sim::config().seed = seed;
    std::vector<float> out(3 * 128, 0);
    std::vector<float> data(3 * 128);
    for (size_t i = 0; i < data.size(); ++i) data[i] = float(i % 17) * 0.25f - 1.0f;
    sim::launch(3, 128, 1024, false, [&] {
      float* sm = reinterpret_cast<float*>(port::smem());
      const uint32_t t = port::thread_id(), b = port::block_id();
      sm[t] = data[b * 128 + t];
      port::sync_block();
      // Each thread reads its neighbour's value: wrong without the barrier.
      const float v = sm[(t + 1) % 128];
      const float s = port::warp_sum(v);
      const float total = port::block_sum(v, sm + 256);
      out[b * 128 + t] = s + 1000 * total;
    });
    for (uint32_t b = 0; b < 3; ++b)
      for (uint32_t t = 0; t < 128; ++t) {
        double w = 0, tot = 0;
        for (uint32_t l = 0; l < 32; ++l) w += data[b * 128 + (t / 32 * 32 + l + 1) % 128];
        for (uint32_t i = 0; i < 128; ++i) tot += data[b * 128 + i];
        EXPECT_NEAR(out[b * 128 + t], float(w) + 1000 * float(tot), 1e-2) << b << " " << t;
      }
  }
  sim::config().seed = 0;
}

TEST(CudaSimRuntime, CountersAcrossCooperativeBlocks) {
  sim::config().sm_count = 4;
  uint32_t counter = 0;
  std::vector<int> order;
  sim::launch(4, 32, 16, true, [&] {
    const uint32_t b = port::block_id();
    if (port::thread_id() == 0) {
      // Block b waits for block b - 1.
      while (port::load_acquire(&counter) != b) port::pause("the previous block");
      order.push_back(int(b));
      port::atomic_add_release(&counter, 1);
    }
    port::sync_block();
  });
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
}

TEST(CudaSimRuntime, DeadlockIsAnErrorSayingWhat) {
  uint32_t flag = 0;
  try {
    sim::launch(2, 64, 16, true, [&] {
      if (port::thread_id() == 0)
        while (port::load_acquire(&flag) == 0) port::pause("a flag nobody sets");
      port::sync_block();
    });
    FAIL() << "no deadlock reported";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("deadlock"));
    EXPECT_THAT(e.what(), HasSubstr("a flag nobody sets"));
  }
  // A cooperative grid larger than the device.
  sim::config().sm_count = 2;
  EXPECT_THROW(sim::launch(3, 32, 0, true, [] {}), Error);
  sim::config().sm_count = 4;
}

TEST(CudaSimRuntime, BulkCopiesCheckTheirBytes) {
  alignas(16) static uint8_t src[4096];
  for (int i = 0; i < 4096; ++i) src[i] = uint8_t(i * 7);
  std::vector<uint8_t> got(4096);
  sim::launch(1, 32, 4096 + 64, false, [&] {
    auto* bar = reinterpret_cast<port::Mbar*>(port::smem() + 4096);
    if (port::thread_id() == 0) {
      port::mbar_init(bar, 1);
      port::mbar_arrive_expect_tx(bar, 4096);
      port::bulk_copy_g2s(port::smem(), src, 2048, bar);
      port::bulk_copy_g2s(port::smem() + 2048, src + 2048, 2048, bar);
    }
    port::sync_block();
    port::mbar_wait(bar, 0);
    if (port::thread_id() == 0) std::memcpy(got.data(), port::smem(), 4096);
  });
  EXPECT_EQ(0, std::memcmp(got.data(), src, 4096));
  // More bytes than announced: an error at once.
  EXPECT_THAT(
      [&] {
        try {
          sim::launch(1, 32, 4096 + 64, false, [&] {
            auto* bar = reinterpret_cast<port::Mbar*>(port::smem() + 4096);
            if (port::thread_id() == 0) {
              port::mbar_init(bar, 1);
              port::mbar_arrive_expect_tx(bar, 1024);
              port::bulk_copy_g2s(port::smem(), src, 2048, bar);
            }
          });
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string();
      }(),
      HasSubstr("expecting 1024"));
  // Fewer: the waiters would hang on the GPU; here a deadlock naming the outstanding bytes.
  try {
    sim::launch(1, 32, 4096 + 64, false, [&] {
      auto* bar = reinterpret_cast<port::Mbar*>(port::smem() + 4096);
      if (port::thread_id() == 0) {
        port::mbar_init(bar, 1);
        port::mbar_arrive_expect_tx(bar, 4096);
        port::bulk_copy_g2s(port::smem(), src, 2048, bar);
      }
      port::sync_block();
      port::mbar_wait(bar, 0);
    });
    FAIL() << "a short copy went unnoticed";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("2048 transaction bytes outstanding"));
  }
}

}  // namespace
}  // namespace md::cuda
