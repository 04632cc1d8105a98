// The communicator over NCCL (communicator.h), built by nvcc with the GPU kernels. NCCL is loaded
// at run time (dlopen of libnccl.so.2), so a binary built here starts on machines without it.
// Collectives take device buffers: the gathers, all-to-alls and broadcasts are NCCL's; the sums
// are a kernel here, in rank order in fp32 (the definition in communicator.h), so every rank gets
// the same bits whatever NCCL's algorithm. Each call waits for its stream, polling NCCL's
// asynchronous error state, and aborts the communicator when the call does not finish in time (a
// peer that died would otherwise leave this rank waiting forever).
//
// No fmt here (nvcc 13 rejects fmt 9's constexpr code): errors go through cuda::throw_error.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <chrono>
#include <cstring>
#include <string>
#include <type_traits>
#include <thread>

#include "../kernels/cuda/device.h"
#include "megadecode/base/bf16.h"
#include "megadecode/dist/communicator.h"

namespace md::dist {

namespace {

// The NCCL ABI this file uses (nccl.h 2.x: ncclUniqueId is 128 bytes; results and data types are
// ints). Declared here rather than through nccl.h so that the build needs no NCCL library.
constexpr int kIdBytes = 128;
struct NcclId {
  char internal[kIdBytes];
};
using NcclComm = struct ncclComm*;
enum : int { kNcclSuccess = 0, kNcclInProgress = 7 };
enum : int { kNcclUint8 = 1, kNcclFloat32 = 7, kNcclBfloat16 = 9 };

struct NcclApi {
  int (*get_unique_id)(NcclId*) = nullptr;
  int (*comm_init_rank)(NcclComm*, int, NcclId, int) = nullptr;
  int (*comm_destroy)(NcclComm) = nullptr;
  int (*comm_abort)(NcclComm) = nullptr;
  int (*comm_get_async_error)(NcclComm, int*) = nullptr;
  const char* (*get_error_string)(int) = nullptr;
  int (*all_gather)(const void*, void*, size_t, int, NcclComm, cudaStream_t) = nullptr;
  int (*all_to_all)(const void*, void*, size_t, int, NcclComm, cudaStream_t) = nullptr;
  int (*broadcast)(const void*, void*, size_t, int, int, NcclComm, cudaStream_t) = nullptr;
};

const NcclApi& nccl() {
  static NcclApi api = [] {
    NcclApi a;
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) cuda::throw_error(std::string("NCCL: cannot load libnccl.so.2: ") + dlerror());
    auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, name));
      if (!f) cuda::throw_error(std::string("NCCL: libnccl has no ") + name);
    };
    sym(a.get_unique_id, "ncclGetUniqueId");
    sym(a.comm_init_rank, "ncclCommInitRank");
    sym(a.comm_destroy, "ncclCommDestroy");
    sym(a.comm_abort, "ncclCommAbort");
    sym(a.comm_get_async_error, "ncclCommGetAsyncError");
    sym(a.get_error_string, "ncclGetErrorString");
    sym(a.all_gather, "ncclAllGather");
    sym(a.all_to_all, "ncclAlltoAll");
    sym(a.broadcast, "ncclBroadcast");
    return a;
  }();
  return api;
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) cuda::throw_error(std::string("NCCL communicator: ") + what + ": " +
                                          cudaGetErrorString(e));
}

// out[i] = sum over n blocks of count elements, in block order, in fp32 (bf16 rounded once).
__global__ void sum_blocks_kernel(const void* blocks, int n, size_t count, bool bf16v, void* out) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    if (bf16v) {
      const auto* b = static_cast<const uint16_t*>(blocks);
      float s = ::md::bf16_to_f32(b[i]);
      for (int k = 1; k < n; ++k) s += ::md::bf16_to_f32(b[size_t(k) * count + i]);
      static_cast<uint16_t*>(out)[i] = ::md::f32_to_bf16(s);
    } else {
      const auto* b = static_cast<const float*>(blocks);
      float s = b[i];
      for (int k = 1; k < n; ++k) s += b[size_t(k) * count + i];
      static_cast<float*>(out)[i] = s;
    }
  }
}

int nccl_type(Elem e) {
  return e == Elem::kF32 ? kNcclFloat32 : kNcclBfloat16;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& boot, int device, double timeout_s)
      : rank_(boot.rank()), size_(boot.size()), timeout_s_(timeout_s) {
    if (!(timeout_s > 0)) cuda::throw_error("NCCL communicator: the timeout must be positive");
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
      cuda::throw_error(std::string("no CUDA device: ") +
                        (e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports no GPU"));
    if (device < 0 || device >= n)
      cuda::throw_error("NCCL communicator: device " + std::to_string(device) + " of " +
                        std::to_string(n));
    device_ = device;
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    const NcclApi& api = nccl();
    NcclId id{};
    if (rank_ == 0) check(api.get_unique_id(&id), "ncclGetUniqueId");
    boot.broadcast(&id, sizeof id, 0);
    check(api.comm_init_rank(&comm_, size_, id, rank_), "ncclCommInitRank");
  }
  ~NcclCommunicator() override {
    if (comm_) (aborted_ ? nccl().comm_abort : nccl().comm_destroy)(comm_);
    if (scratch_) cudaFree(scratch_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "nccl"; }

  void all_gather(const void* send, void* recv, size_t count, Elem e) override {
    if (send == recv) cuda::throw_error("all-gather: send and receive buffers are the same");
    const auto t0 = std::chrono::steady_clock::now();
    check(nccl().all_gather(send, recv, count, nccl_type(e), comm_, stream_), "ncclAllGather");
    finish("ncclAllGather", count * elem_bytes(e) * size_t(size_ - 1), t0);
  }
  void all_reduce_sum(void* data, size_t count, Elem e) override {
    if (size_ == 1 || count == 0) return;
    void* g = device_scratch(size_t(size_) * count * elem_bytes(e));
    all_gather(data, g, count, e);
    sum(g, count, e, data);
  }
  void reduce_scatter_sum(const void* send, void* recv, size_t count, Elem e) override {
    if (count == 0) return;
    if (size_ == 1) {
      check_cuda(cudaMemcpyAsync(recv, send, count * elem_bytes(e), cudaMemcpyDeviceToDevice,
                                 stream_),
                 "cudaMemcpyAsync");
      check_cuda(cudaStreamSynchronize(stream_), "reduce-scatter");
      return;
    }
    void* g = device_scratch(size_t(size_) * count * elem_bytes(e));
    all_to_all(send, g, count, e);
    sum(g, count, e, recv);
  }
  void broadcast(void* data, size_t bytes, int root) override {
    if (root < 0 || root >= size_)
      cuda::throw_error("broadcast: root " + std::to_string(root) + " is not a rank of " +
                        std::to_string(size_));
    const auto t0 = std::chrono::steady_clock::now();
    check(nccl().broadcast(data, data, bytes, kNcclUint8, root, comm_, stream_), "ncclBroadcast");
    finish("ncclBroadcast", rank_ == root ? bytes : 0, t0);
  }
  void barrier() override {
    // One gathered byte a rank: nobody returns before every rank has called.
    void* g = device_scratch(size_t(size_) * 2);
    const auto t0 = std::chrono::steady_clock::now();
    check(nccl().all_gather(g, static_cast<uint8_t*>(g) + size_, 1, kNcclUint8, comm_, stream_),
          "ncclAllGather (barrier)");
    finish("the barrier", 0, t0);
  }

 protected:
  void all_to_all(const void* send, void* recv, size_t count, Elem e) override {
    const auto t0 = std::chrono::steady_clock::now();
    check(nccl().all_to_all(send, recv, count, nccl_type(e), comm_, stream_), "ncclAlltoAll");
    finish("ncclAlltoAll", count * elem_bytes(e) * size_t(size_ - 1), t0);
  }

 private:
  void check(int rc, const char* what) {
    if (rc == kNcclSuccess || rc == kNcclInProgress) return;
    cuda::throw_error(std::string("NCCL: ") + what + " failed: " + nccl().get_error_string(rc));
  }
  // Waits for the stream, watching NCCL's asynchronous errors and the timeout.
  void finish(const char* what, size_t sent, std::chrono::steady_clock::time_point t0) {
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) check_cuda(q, what);
      int async = kNcclSuccess;
      nccl().comm_get_async_error(comm_, &async);
      if (async != kNcclSuccess && async != kNcclInProgress) {
        aborted_ = true;
        cuda::throw_error(std::string("NCCL: ") + what + " failed: " +
                          nccl().get_error_string(async));
      }
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (dt > timeout_s_) {
        aborted_ = true;
        cuda::throw_error(std::string("NCCL: ") + what + " did not finish within " +
                          std::to_string(timeout_s_) + " s (a rank died or never joined?)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    ++counters_.calls;
    counters_.bytes_sent += sent;
    counters_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void sum(const void* blocks, size_t count, Elem e, void* out) {
    const int threads = 256;
    const int grid = int(std::min<size_t>((count + threads - 1) / threads, 1024));
    sum_blocks_kernel<<<grid, threads, 0, stream_>>>(blocks, size_, count, e == Elem::kBF16, out);
    check_cuda(cudaGetLastError(), "the sum kernel");
    check_cuda(cudaStreamSynchronize(stream_), "the sum kernel");
  }
  void* device_scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      if (scratch_) cudaFree(scratch_);
      scratch_ = nullptr;
      check_cuda(cudaMalloc(&scratch_, bytes), "cudaMalloc");
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

  int rank_ = 0, size_ = 1, device_ = 0;
  double timeout_s_;
  cudaStream_t stream_ = nullptr;
  NcclComm comm_ = nullptr;
  bool aborted_ = false;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

}  // namespace

bool nccl_built() {
  return true;
}

std::unique_ptr<Communicator> nccl_communicator(Communicator& bootstrap, int device,
                                               double timeout_s) {
  return std::make_unique<NcclCommunicator>(bootstrap, device, timeout_s);
}

}  // namespace md::dist
