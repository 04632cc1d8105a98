// The backend-independent half of the collectives (communicator.h): the deterministic sums over
// gathered contributions, and the single-process communicator.
#include "megadecode/dist/communicator.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"

namespace md::dist {

size_t elem_bytes(Elem e) {
  return e == Elem::kF32 ? 4 : 2;
}

void sum_blocks_in_order(const void* blocks, int n, size_t count, Elem e, void* out) {
  if (e == Elem::kF32) {
    const float* b = static_cast<const float*>(blocks);
    float* o = static_cast<float*>(out);
    for (size_t i = 0; i < count; ++i) {
      float s = b[i];
      for (int k = 1; k < n; ++k) s += b[size_t(k) * count + i];
      o[i] = s;
    }
    return;
  }
  const bf16* b = static_cast<const bf16*>(blocks);
  bf16* o = static_cast<bf16*>(out);
  for (size_t i = 0; i < count; ++i) {
    float s = bf16_to_f32(b[i]);
    for (int k = 1; k < n; ++k) s += bf16_to_f32(b[size_t(k) * count + i]);
    o[i] = f32_to_bf16(s);
  }
}

void* Communicator::scratch(size_t bytes) {
  if (bytes > scratch_bytes_) {
    scratch_ = std::make_unique<uint8_t[]>(bytes);
    scratch_bytes_ = bytes;
  }
  return scratch_.get();
}

void Communicator::broadcast_polled(void* data, size_t bytes, int root, double) {
  broadcast(data, bytes, root);
}

void Communicator::all_reduce_sum(void* data, size_t count, Elem e) {
  const int n = size();
  if (n == 1 || count == 0) return;
  const size_t eb = elem_bytes(e);
  if (n > 2 && count * eb >= kSplitAllReduceBytes) {
    // Reduce-scatter, then all-gather: rank b sums block b of every rank's data (in rank order,
    // as below, so the bits are the same), then every rank gathers the summed blocks. Each rank
    // sends about 2 (n - 1) / n of the message instead of (n - 1) times it.
    const size_t m = (count + size_t(n) - 1) / size_t(n), nm = size_t(n) * m;
    auto* buf = static_cast<uint8_t*>(scratch(eb * (3 * nm + m)));
    uint8_t* padded = buf;            // n blocks of m: the data, zeros past count
    uint8_t* got = padded + nm * eb;  // block `rank()` of every rank, in rank order
    uint8_t* mine = got + nm * eb;    // that block summed
    uint8_t* all = mine + m * eb;     // every rank's summed block
    std::memcpy(padded, data, count * eb);
    std::memset(padded + count * eb, 0, (nm - count) * eb);
    all_to_all(padded, got, m, e);
    sum_blocks_in_order(got, n, m, e, mine);
    all_gather(mine, all, m, e);
    std::memcpy(data, all, count * eb);
    return;
  }
  void* gathered = scratch(size_t(n) * count * elem_bytes(e));
  all_gather(data, gathered, count, e);
  sum_blocks_in_order(gathered, n, count, e, data);
}

void Communicator::reduce_scatter_sum(const void* send, void* recv, size_t count, Elem e) {
  const int n = size();
  if (n == 1) {
    std::memcpy(recv, send, count * elem_bytes(e));
    return;
  }
  if (count == 0) return;
  void* mine = scratch(size_t(n) * count * elem_bytes(e));
  all_to_all(send, mine, count, e);
  sum_blocks_in_order(mine, n, count, e, recv);
}

namespace {

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view backend() const override { return "local"; }
  void all_gather(const void* send, void* recv, size_t count, Elem e) override {
    MD_CHECK(send != recv, "all-gather: send and receive buffers are the same");
    std::memcpy(recv, send, count * elem_bytes(e));
  }
  void broadcast(void*, size_t, int root) override {
    MD_CHECK(root == 0, "broadcast: root {} is not a rank of 1", root);
  }
  void barrier() override {}

 protected:
  void all_to_all(const void* send, void* recv, size_t count, Elem e) override {
    std::memmove(recv, send, count * elem_bytes(e));
  }
};

}  // namespace

std::unique_ptr<Communicator> local_communicator() {
  return std::make_unique<LocalCommunicator>();
}

#if !defined(MD_HAVE_CUDA)
bool nccl_built() {
  return false;
}
std::unique_ptr<Communicator> nccl_communicator(Communicator&, int, double) {
  fail("this megadecode was built without CUDA, so without NCCL (build it where nvcc is found)");
}
#endif

}  // namespace md::dist
