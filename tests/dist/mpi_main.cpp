// main() of the MPI test binary (tests/dist: the collectives, the sharded models), run under
// `mpirun -np N`: every rank runs every test, and the job fails when any rank fails.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "megadecode/base/error.h"
#include "mpi_test.h"

namespace md::test {
dist::Communicator* mpi = nullptr;
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<md::dist::Communicator> c;
  try {
    c = md::dist::mpi_communicator();
  } catch (const md::Error& e) {
    fprintf(stderr, "mpi tests: %s\n", e.what());
    return 1;
  }
  md::test::mpi = c.get();
  // A rank asked to die (MD_MPI_TEST_DIE=r): the others wait in a barrier, and the launcher must
  // end the job (tests/dist/dead_rank.sh checks that it does, with an error, within seconds).
  if (const char* die = std::getenv("MD_MPI_TEST_DIE")) {
    if (c->rank() == std::atoi(die)) {
      fprintf(stderr, "rank %d exits on purpose\n", c->rank());
      std::_Exit(3);
    }
    c->barrier();
    return 0;
  }
  if (c->rank() != 0) {
    // Only rank 0 prints the progress; the others report their failures.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int failed = RUN_ALL_TESTS() != 0;
  // Every rank exits with the job's verdict.
  std::vector<float> f = {float(failed)};
  c->all_reduce_sum(f.data(), 1, md::dist::Elem::kF32);
  if (f[0] > 0 && c->rank() == 0) fprintf(stderr, "mpi tests: %g rank(s) failed\n", f[0]);
  return f[0] > 0 ? 1 : 0;
}
