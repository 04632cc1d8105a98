// Collectives between the ranks of a distributed run (docs/distributed.md): all-reduce,
// reduce-scatter, all-gather, broadcast and barrier on fp32 or bf16 buffers, over an existing
// distributed runtime: MPI between CPU processes, NCCL between GPUs (never a home-made transport).
//
// Determinism. Every reduction sums the ranks' contributions in rank order (0, 1, ..., size - 1)
// in fp32, on every rank (bf16 values are widened exactly and the fp32 sum is rounded to bf16
// once), so a result never depends on timing, message sizes or the runtime's algorithm, and all
// ranks hold the same bits. The sums are computed here from the gathered contributions (an
// all-gather for an all-reduce, an all-to-all for a reduce-scatter) rather than by the runtime's
// own reduction, whose order is unspecified; decode messages are a few rows of the hidden size,
// so the extra bytes are noise against the weights each rank streams.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace md::dist {

enum class Elem : uint8_t { kF32, kBF16 };
size_t elem_bytes(Elem e);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;  // "local", "mpi", "nccl"

  // data[i] = sum over ranks r (in rank order) of rank r's data[i], in place, on every rank.
  // By default: every rank gathers every contribution and sums them; from 3 ranks and
  // kSplitAllReduceBytes up, a reduce-scatter of blocks then an all-gather of the sums (the same
  // bits, about 2 / n of the bytes a rank receives, one more round trip).
  virtual void all_reduce_sum(void* data, size_t count, Elem e);
  static constexpr size_t kSplitAllReduceBytes = size_t(64) << 10;
  // recv[r * count .. (r + 1) * count) = rank r's send[0 .. count), on every rank (send and recv
  // distinct).
  virtual void all_gather(const void* send, void* recv, size_t count, Elem e) = 0;
  // send holds size() blocks of count elements; rank r receives block r summed over the ranks
  // (in rank order) in recv[0 .. count).
  virtual void reduce_scatter_sum(const void* send, void* recv, size_t count, Elem e);
  // data[0 .. bytes) of rank root, on every rank.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  // A broadcast whose arrival nobody can predict (a server's next step, exec/step_mirror.h): the
  // ranks that wait for it poll and sleep between polls (backing off to max_sleep_s) instead of
  // spinning inside the runtime, so an idle follower costs no CPU. Every rank calls this one,
  // not broadcast, for the message. Not counted in counters() (its time is idle time, not a
  // collective's cost). By default: broadcast.
  virtual void broadcast_polled(void* data, size_t bytes, int root, double max_sleep_s = 1e-3);
  virtual void barrier() = 0;

  // The runtime's calls through this communicator since it was made, the bytes this rank sent
  // and the seconds spent in them (each rank counts its own).
  struct Counters {
    uint64_t calls = 0, bytes_sent = 0;
    double seconds = 0;
  };
  const Counters& counters() const { return counters_; }

 protected:
  // recv[r * count .. (r + 1) * count) = rank r's block `rank()` of send (size() blocks of
  // count elements): the exchange under reduce_scatter_sum.
  virtual void all_to_all(const void* send, void* recv, size_t count, Elem e) = 0;
  // Scratch of at least `bytes` (reused between calls).
  void* scratch(size_t bytes);
  Counters counters_;

 private:
  std::unique_ptr<uint8_t[]> scratch_;
  size_t scratch_bytes_ = 0;
};

// out[i] = the sum over n blocks of `count` elements at blocks + k * count, in block order, in fp32
// (bf16: widened, summed, rounded once): the reduction every Communicator uses.
void sum_blocks_in_order(const void* blocks, int n, size_t count, Elem e, void* out);

// One process on its own (size 1): every collective is a copy.
std::unique_ptr<Communicator> local_communicator();

// MPI_COMM_WORLD (MPI initialized on first use with MPI_THREAD_SERIALIZED or better, finalized at
// exit). An md::Error when this build has no MPI (mpi_built() == false) or MPI cannot start.
bool mpi_built();
std::unique_ptr<Communicator> mpi_communicator();
// NCCL between the GPUs of bootstrap's ranks (its rank r drives CUDA device `device`; the NCCL id
// goes from rank 0 to the others through bootstrap.broadcast). Buffers are device pointers; every
// call returns when its result is in place. NCCL is loaded at run time (libnccl.so.2), so the
// binary needs it only when this is called. A collective that does not finish within timeout_s
// (a rank died, or a peer never joined) aborts the communicator with an md::Error instead of
// hanging. An md::Error when this build has no CUDA (nccl_built() == false), NCCL does not load
// or the device is not there.
bool nccl_built();
std::unique_ptr<Communicator> nccl_communicator(Communicator& bootstrap, int device,
                                                double timeout_s = 60);

}  // namespace md::dist
