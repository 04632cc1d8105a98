// The MPI communicator's collectives, run under `mpirun -np N` (tests/CMakeLists.txt: Mpi.Np2,
// Mpi.Np4). Every rank's input is a function of (rank, element, seed), so each rank computes
// every expected result itself from the definition in communicator.h (sums in rank order in
// fp32; bf16 widened and rounded once) and checks the bits; then the ranks compare their results
// with each other. Timing is perturbed (random sleeps before the calls) to show it does not
// change a bit. Each rank runs every test; the job fails when any rank fails.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/dist/communicator.h"
#include "mpi_test.h"

namespace md::dist {
namespace {

// The run's communicator (mpi_main.cpp).
Communicator*& comm = test::mpi;

// Rank r's element i of run `seed`: values of mixed magnitudes and signs, so the order of the
// additions shows in the bits.
float input(int r, size_t i, uint64_t seed) {
  uint64_t x = (uint64_t(r) + 1) * 0x9e3779b97f4a7c15ull ^ (i + 1) * 0xbf58476d1ce4e5b9ull ^ seed;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 29;
  const double u = double(x >> 11) / double(uint64_t(1) << 53);
  const double mag = std::ldexp(1.0, int(x % 24) - 12);
  return float((u - 0.5) * mag);
}

std::vector<float> inputs(int r, size_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = input(r, i, seed);
  return v;
}

std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = f32_to_bf16(v[i]);
  return o;
}

void jitter(uint64_t salt) {
  const int us = int((uint64_t(comm->rank()) * 7919 + salt * 104729) % 2000);
  std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// Every rank holds the same bytes.
void expect_same_on_every_rank(const void* data, size_t bytes, const char* what) {
  const int n = comm->size();
  std::vector<uint8_t> all(bytes * size_t(n));
  std::vector<uint8_t> mine(static_cast<const uint8_t*>(data),
                            static_cast<const uint8_t*>(data) + bytes);
  // (bytes may be odd: gathered as bf16 pairs would not fit; gather whole floats of padding)
  const size_t padded = (bytes + 3) / 4 * 4;
  mine.resize(padded, 0);
  all.resize(padded * size_t(n));
  comm->all_gather(mine.data(), all.data(), padded / 4, Elem::kF32);
  for (int r = 1; r < n; ++r)
    EXPECT_EQ(std::memcmp(all.data(), all.data() + size_t(r) * padded, bytes), 0)
        << what << ": rank " << r << " differs from rank 0";
}

TEST(Mpi, RanksAndBackend) {
  EXPECT_EQ(comm->backend(), "mpi");
  EXPECT_GE(comm->size(), 2);
  EXPECT_GE(comm->rank(), 0);
  EXPECT_LT(comm->rank(), comm->size());
}

TEST(Mpi, AllGatherF32AndBf16) {
  const int n = comm->size();
  for (size_t count : {size_t(1), size_t(7), size_t(4096), size_t(300001)}) {
    const std::vector<float> mine = inputs(comm->rank(), count, count);
    std::vector<float> got(count * size_t(n));
    comm->all_gather(mine.data(), got.data(), count, Elem::kF32);
    for (int r = 0; r < n; ++r)
      EXPECT_EQ(
          std::memcmp(got.data() + size_t(r) * count, inputs(r, count, count).data(), count * 4), 0)
          << "f32 count " << count << " rank " << r;
    const std::vector<bf16> mb = to_bf16(mine);
    std::vector<bf16> gb(count * size_t(n));
    comm->all_gather(mb.data(), gb.data(), count, Elem::kBF16);
    for (int r = 0; r < n; ++r)
      EXPECT_EQ(std::memcmp(gb.data() + size_t(r) * count, to_bf16(inputs(r, count, count)).data(),
                            count * 2),
                0)
          << "bf16 count " << count << " rank " << r;
  }
}

TEST(Mpi, AllReduceSumsInRankOrder) {
  const int n = comm->size();
  // (The last two take the reduce-scatter + all-gather form on 3 or more ranks, one of them with
  // a count the ranks do not divide.)
  for (size_t count :
       {size_t(1), size_t(33), size_t(2304), size_t(1) << 18, (size_t(1) << 16) + 5}) {
    for (uint64_t rep = 0; rep < 3; ++rep) {
      const uint64_t seed = count * 16 + rep;
      std::vector<float> data = inputs(comm->rank(), count, seed);
      std::vector<bf16> datab = to_bf16(data);
      jitter(rep);
      comm->all_reduce_sum(data.data(), count, Elem::kF32);
      jitter(rep + 1);
      comm->all_reduce_sum(datab.data(), count, Elem::kBF16);
      size_t wrong = 0, wrongb = 0;
      for (size_t i = 0; i < count; ++i) {
        float s = input(0, i, seed), sb = bf16_to_f32(f32_to_bf16(input(0, i, seed)));
        for (int r = 1; r < n; ++r) {
          s += input(r, i, seed);
          sb += bf16_to_f32(f32_to_bf16(input(r, i, seed)));
        }
        wrong += std::memcmp(&s, &data[i], 4) != 0;
        const bf16 want = f32_to_bf16(sb);
        wrongb += want != datab[i];
      }
      EXPECT_EQ(wrong, 0u) << "f32 count " << count;
      EXPECT_EQ(wrongb, 0u) << "bf16 count " << count;
      expect_same_on_every_rank(data.data(), count * 4, "f32 all-reduce");
      expect_same_on_every_rank(datab.data(), count * 2, "bf16 all-reduce");
    }
  }
}

TEST(Mpi, ReduceScatterGivesEachRankItsBlock) {
  const int n = comm->size(), me = comm->rank();
  for (size_t count : {size_t(1), size_t(100), size_t(65536)}) {
    const std::vector<float> send = inputs(me, count * size_t(n), count);
    std::vector<float> got(count);
    jitter(count);
    comm->reduce_scatter_sum(send.data(), got.data(), count, Elem::kF32);
    size_t wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      const size_t at = size_t(me) * count + i;
      float s = input(0, at, count);
      for (int r = 1; r < n; ++r) s += input(r, at, count);
      wrong += std::memcmp(&s, &got[i], 4) != 0;
    }
    EXPECT_EQ(wrong, 0u) << "count " << count;
    const std::vector<bf16> sendb = to_bf16(send);
    std::vector<bf16> gotb(count);
    comm->reduce_scatter_sum(sendb.data(), gotb.data(), count, Elem::kBF16);
    size_t wrongb = 0;
    for (size_t i = 0; i < count; ++i) {
      const size_t at = size_t(me) * count + i;
      float s = 0;
      for (int r = 0; r < n; ++r) s += bf16_to_f32(f32_to_bf16(input(r, at, count)));
      wrongb += f32_to_bf16(s) != gotb[i];
    }
    EXPECT_EQ(wrongb, 0u) << "bf16 count " << count;
  }
}

TEST(Mpi, BroadcastFromEveryRoot) {
  for (int root = 0; root < comm->size(); ++root)
    for (size_t bytes : {size_t(0), size_t(1), size_t(13), size_t(1) << 20}) {
      std::vector<uint8_t> v(bytes);
      for (size_t i = 0; i < bytes; ++i) v[i] = uint8_t(comm->rank() == root ? i * 31 + 7 : 0);
      comm->broadcast(v.data(), bytes, root);
      size_t wrong = 0;
      for (size_t i = 0; i < bytes; ++i) wrong += v[i] != uint8_t(i * 31 + 7);
      EXPECT_EQ(wrong, 0u) << "root " << root << " bytes " << bytes;
    }
}

TEST(Mpi, BadCallsAreErrorsOnEveryRank) {
  std::vector<uint8_t> v(4);
  try {
    comm->broadcast(v.data(), v.size(), comm->size());
    ADD_FAILURE() << "a broadcast from a root outside the ranks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not a rank of"), std::string::npos) << e.what();
  }
  float x = 1;
  try {
    comm->all_gather(&x, &x, 1, Elem::kF32);
    ADD_FAILURE() << "an all-gather into its own send buffer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the same"), std::string::npos) << e.what();
  }
  comm->barrier();  // the communicator still works
  EXPECT_GE(comm->counters().calls, 1u);
}

}  // namespace
}  // namespace md::dist
