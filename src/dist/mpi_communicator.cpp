// The communicator over MPI (communicator.h): MPI_COMM_WORLD, its collectives on bytes (the sums
// are communicator.cpp's, in rank order). Errors come back as md::Error naming the call and MPI's
// message (MPI_ERRORS_RETURN); a rank that dies ends the job through the launcher (OpenMPI's
// mpirun kills the other ranks), so nobody hangs on a collective that can no longer finish.
// Built when CMake finds MPI (MD_HAVE_MPI); otherwise mpi_communicator() says it is not built.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/dist/communicator.h"

#if defined(MD_HAVE_MPI)
#include <mpi.h>
#endif

namespace md::dist {

#if defined(MD_HAVE_MPI)

namespace {

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail("MPI: {} failed: {}", what, std::string_view(msg, size_t(len)));
}

// MPI is initialized once per process and finalized at exit (after every communicator is gone).
void init_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    int done = 0;
    MPI_Initialized(&done);
    if (!done) {
      int provided = 0;
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
      MD_CHECK(provided >= MPI_THREAD_SERIALIZED,
               "MPI: the library gives thread level {}, megadecode needs MPI_THREAD_SERIALIZED "
               "(collectives are issued by one worker thread at a time)",
               provided);
      std::atexit([] {
        int fin = 0;
        MPI_Finalized(&fin);
        if (!fin) MPI_Finalize();
      });
    }
    check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  });
}

// Counts of up to INT_MAX bytes per call (MPI's int counts): larger messages go in pieces.
constexpr size_t kMaxBytes = size_t(1) << 30;

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    init_once();
    check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }

  void all_gather(const void* send, void* recv, size_t count, Elem e) override {
    const size_t bytes = count * elem_bytes(e);
    MD_CHECK(bytes <= kMaxBytes, "all-gather: {} bytes a rank is over the {} a call takes", bytes,
             kMaxBytes);
    MD_CHECK(send != recv, "all-gather: send and receive buffers are the same");
    const double t0 = now_seconds();
    check(MPI_Allgather(send, int(bytes), MPI_BYTE, recv, int(bytes), MPI_BYTE, MPI_COMM_WORLD),
          "MPI_Allgather");
    note(bytes * size_t(size_ - 1), t0);
  }

  void broadcast(void* data, size_t bytes, int root) override {
    MD_CHECK(root >= 0 && root < size_, "broadcast: root {} is not a rank of {}", root, size_);
    const double t0 = now_seconds();
    auto* p = static_cast<uint8_t*>(data);
    for (size_t off = 0; off < bytes || off == 0; off += kMaxBytes) {
      const size_t n = std::min(kMaxBytes, bytes - off);
      check(MPI_Bcast(p + off, int(n), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
      if (bytes == 0) break;
    }
    note(rank_ == root ? bytes : 0, t0);
  }

  // MPI_Ibcast polled with MPI_Test: spinning for the first 200 us (a step that follows the
  // last one closely), then sleeping, 20 us at first and doubling up to max_sleep_s. The root's
  // part of a small nonblocking broadcast finishes at once (it only sends).
  void broadcast_polled(void* data, size_t bytes, int root, double max_sleep_s) override {
    MD_CHECK(root >= 0 && root < size_, "broadcast: root {} is not a rank of {}", root, size_);
    MD_CHECK(bytes <= kMaxBytes, "broadcast: {} bytes is over the {} a polled call takes", bytes,
             kMaxBytes);
    MPI_Request req;
    check(MPI_Ibcast(data, int(bytes), MPI_BYTE, root, MPI_COMM_WORLD, &req), "MPI_Ibcast");
    const double t0 = now_seconds();
    double sleep_s = 20e-6;
    for (;;) {
      int done = 0;
      check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      if (now_seconds() - t0 < 200e-6) continue;
      std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
      sleep_s = std::min(2 * sleep_s, std::max(max_sleep_s, 20e-6));
    }
  }

  void barrier() override {
    const double t0 = now_seconds();
    check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
    note(0, t0);
  }

 protected:
  void all_to_all(const void* send, void* recv, size_t count, Elem e) override {
    const size_t bytes = count * elem_bytes(e);
    MD_CHECK(bytes <= kMaxBytes, "reduce-scatter: {} bytes a block is over the {} a call takes",
             bytes, kMaxBytes);
    const double t0 = now_seconds();
    check(MPI_Alltoall(send, int(bytes), MPI_BYTE, recv, int(bytes), MPI_BYTE, MPI_COMM_WORLD),
          "MPI_Alltoall");
    note(bytes * size_t(size_ - 1), t0);
  }

 private:
  void note(size_t sent, double t0) {
    ++counters_.calls;
    counters_.bytes_sent += sent;
    counters_.seconds += now_seconds() - t0;
  }
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool mpi_built() {
  return true;
}

std::unique_ptr<Communicator> mpi_communicator() {
  return std::make_unique<MpiCommunicator>();
}

#else

bool mpi_built() {
  return false;
}

std::unique_ptr<Communicator> mpi_communicator() {
  fail("this megadecode was built without MPI (install libopenmpi-dev and rebuild)");
}

#endif

}  // namespace md::dist
