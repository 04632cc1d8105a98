// The collectives' arithmetic without a launcher: sum_blocks_in_order (the rank-order sums every
// communicator uses: fp32 adds in block order; bf16 widened, summed in fp32, rounded once) and the
// single-process communicator. The MPI communicator runs under mpirun (mpi_collectives.cpp).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "../cuda/cuda_test_util.h"
#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/dist/communicator.h"

namespace md::dist {
namespace {

TEST(Communicator, SumsBlocksInOrder) {
  // 1e8 + 1 - 1e8 in that order is 0 in fp32; in another order it would be 1.
  const std::vector<float> blocks = {1e8f, 2.0f, 1.0f, 3.0f, -1e8f, 4.0f};
  std::vector<float> out(2);
  sum_blocks_in_order(blocks.data(), 3, 2, Elem::kF32, out.data());
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 9.0f);
  // bf16: 256 + 1 + 1 is 258 in fp32, rounded once to bf16 (258 is representable); summed and
  // rounded pairwise in bf16 it would stay 256.
  const std::vector<bf16> b = {f32_to_bf16(256.0f), f32_to_bf16(1.0f), f32_to_bf16(1.0f)};
  bf16 o = 0;
  sum_blocks_in_order(b.data(), 3, 1, Elem::kBF16, &o);
  EXPECT_EQ(bf16_to_f32(o), 258.0f);
}

TEST(Communicator, LocalIsACopy) {
  auto c = local_communicator();
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->rank(), 0);
  std::vector<float> v = {1.5f, -2.0f}, g(2);
  c->all_reduce_sum(v.data(), 2, Elem::kF32);
  EXPECT_EQ(v, (std::vector<float>{1.5f, -2.0f}));
  c->all_gather(v.data(), g.data(), 2, Elem::kF32);
  EXPECT_EQ(g, v);
  c->reduce_scatter_sum(v.data(), g.data(), 2, Elem::kF32);
  EXPECT_EQ(g, v);
  c->broadcast(v.data(), 8, 0);
  c->barrier();
  EXPECT_THROW(c->broadcast(v.data(), 8, 1), Error);
  EXPECT_THROW(c->all_gather(v.data(), v.data(), 2, Elem::kF32), Error);
}

TEST(Communicator, MpiIsAClearErrorWhenNotBuiltOrNotLaunched) {
  if (mpi_built()) GTEST_SKIP() << "this build has MPI (mpi_collectives.cpp runs it under mpirun)";
  try {
    mpi_communicator();
    ADD_FAILURE() << "an MPI communicator from a build without MPI";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("built without MPI"), std::string::npos) << e.what();
  }
}

// Without a GPU (or without a CUDA build) an NCCL communicator is a clear error.
TEST(Communicator, NcclWithoutAGpuIsAClearError) {
  std::string why;
  if (nccl_built() && test::gpu_present(&why)) GTEST_SKIP() << "a GPU is here (CudaGpu.Nccl*)";
  auto boot = local_communicator();
  try {
    nccl_communicator(*boot, 0);
    ADD_FAILURE() << "an NCCL communicator without a GPU";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(m.find("no CUDA device") != std::string::npos ||
                m.find("built without CUDA") != std::string::npos)
        << m;
  }
}

// One rank on the GPU: NCCL's calls and the sum kernel on device buffers (a size-1 all-reduce is
// a no-op, so the reduce-scatter and the gather carry the check; several GPUs need mpirun).
TEST(CudaGpu, NcclOneRankCollectives) {
  MD_NEED_GPU();
  if (!nccl_built()) GTEST_SKIP() << "built without CUDA";
  auto boot = local_communicator();
  std::unique_ptr<Communicator> c = nccl_communicator(*boot, 0, 30);
  EXPECT_EQ(c->backend(), "nccl");
  EXPECT_EQ(c->size(), 1);
  std::unique_ptr<cuda::Device> dev = cuda::make_gpu_device();
  const std::vector<float> host = {1.5f, -2.25f, 1e8f, 3.0f};
  void* a = dev->alloc(16);
  void* b = dev->alloc(16);
  dev->copy(a, host.data(), 16);
  dev->sync();
  c->all_gather(a, b, 4, Elem::kF32);
  std::vector<float> got(4);
  dev->copy(got.data(), b, 16);
  dev->sync();
  EXPECT_EQ(got, host);
  c->reduce_scatter_sum(a, b, 4, Elem::kF32);
  c->broadcast(b, 16, 0);
  c->barrier();
  dev->copy(got.data(), b, 16);
  dev->sync();
  EXPECT_EQ(got, host);
  EXPECT_GE(c->counters().calls, 3u);
  dev->free(a);
  dev->free(b);
}

}  // namespace
}  // namespace md::dist
