// The thread pool binds its workers, and its caller only once the caller runs work: the thread
// that builds a pool (a program's main thread) passes its affinity on to every thread it starts
// afterwards, so binding it at construction put a server's HTTP threads and engine thread all on
// CPU 0 beside worker 0 while CPU 1 was left to worker 1 (bench/RESULTS.md, issue 11).
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <thread>

#include "megadecode/base/threads.h"

namespace md {
namespace {

int allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  pthread_getaffinity_np(pthread_self(), sizeof(set), &set);
  return CPU_COUNT(&set);
}

TEST(ThreadPool, BuildingAPoolLeavesTheCallersAffinityAlone) {
  const int online = int(std::thread::hardware_concurrency());
  if (online < 2) GTEST_SKIP() << "one CPU: pinning cannot be told from not pinning";
  // On a fresh thread, so the test runner's own thread is never bound.
  std::thread([&] {
    const int before = allowed_cpus();
    ASSERT_GE(before, 2) << "the test runs under an affinity mask of one CPU";
    ThreadPool pool(2, true);
    EXPECT_EQ(allowed_cpus(), before) << "construction pinned the calling thread";
    int child = 0;
    std::thread([&] { child = allowed_cpus(); }).join();
    EXPECT_EQ(child, before) << "a thread started after the pool inherited a pin";
    std::atomic<int> ran{0};
    pool.run([&](int, int) { ran.fetch_add(1); });
    EXPECT_EQ(ran.load(), 2);
    EXPECT_EQ(allowed_cpus(), 1) << "the caller, worker 0, runs pinned";
  }).join();
}

TEST(ThreadPool, UnpinnedPoolNeverBindsTheCaller) {
  std::thread([&] {
    const int before = allowed_cpus();
    ThreadPool pool(2, false);
    std::atomic<int> ran{0};
    pool.run([&](int, int) { ran.fetch_add(1); });
    EXPECT_EQ(ran.load(), 2);
    EXPECT_EQ(allowed_cpus(), before);
  }).join();
}

}  // namespace
}  // namespace md
