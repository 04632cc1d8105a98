// The communicator of the MPI test binary (tests/dist/mpi_main.cpp): MPI_COMM_WORLD of the run.
#pragma once
#include "megadecode/dist/communicator.h"

namespace md::test {
extern dist::Communicator* mpi;
}
