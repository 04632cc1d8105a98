// The two kernels of the decode plan and the Device that runs them (device.h). Built twice: by
// nvcc for the GPU (make_gpu_device) and by the host compiler with MD_CUDA_SIM for the simulation
// (make_sim_device); the kernels are the same source.
//
// The megakernel (docs/cuda.md "Megakernel"): one block per SM, each walking its queue of the
// plan. Before an instruction, thread 0 waits for each of its counters to reach its target of
// this step (target + epoch * per_step: counters are monotonic and never reset), with an acquire
// load at device scope, then the block barrier hands that to every thread. After it, the block
// barrier collects the block's writes and thread 0 publishes them with a release add. The
// plan's global order makes the queues deadlock-free for any timing (src/exec/cpu/executor.cpp
// has the proof); a watchdog (bounded spin on the device clock, a global abort flag) turns a
// hang from a bad plan or the test hook into an error naming the instruction and counter.
#include <cstring>

#include "device.h"
#include "tiles.cuh"

#if defined(MD_CUDA_SIM)
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/kernels/cuda/sim.h"
#else
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>
#endif

MD_CUDA_BEGIN

// With programmatic dependent launch (cuda-opbyop on sm_90+), the next phase's blocks may be
// scheduled as soon as every block of this one has started; each waits for the previous phase
// to complete before it reads an activation. The step's tables and the weights were written
// before the step's first kernel, so the tile's first weight chunks stream in meanwhile.
MD_GLOBAL void phase_kernel(const DevStep* sp, uint32_t first) {
  port::launch_dependents();
  init_pipe();
  const DevStep& s = *sp;
  const plan::Instr in = s.instrs[first + port::block_id()];
  Pipe pipe;
  prefetch_tile(s, in, pipe);
  port::grid_dependency_wait();
  run_tile(s, in, pipe);
  if (pipe.pre_n) drain(pipe);  // no copy may outlive the block
}

// The bandwidth probe: every thread streams 16-byte loads over the buffer (grid-stride), folding
// them into a value that is stored only if it has an impossible value (so the loads stay).
MD_GLOBAL void read_kernel(const port::U4* p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = size_t(port::grid_blocks()) * port::block_threads();
  for (size_t i = size_t(port::block_id()) * port::block_threads() + port::thread_id(); i < n;
       i += stride) {
    const port::U4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Random weights (Device::fill_random): one thread per chunk, make-model's generator replayed
// (model/random_init.h), so the device's bytes are the files' bytes.
inline constexpr uint32_t kRandomThreads = 128;
MD_GLOBAL void random_kernel(const RandomJob* jobs, uint32_t n) {
  const uint32_t i = port::block_id() * port::block_threads() + port::thread_id();
  if (i < n) fill_random_chunk(jobs[i].init, jobs[i].chunk, jobs[i].out);
}

// A commit's KDA replay (Device::run_commit): block i takes head i % heads of KDA layer i / heads.
MD_GLOBAL void commit_kernel(const DevCommit* cp) {
  const DevCommit& cm = *cp;
  const uint32_t b = port::block_id();
  kda_commit_block(cm, cm.layers[b / uint32_t(cm.heads)], int(b % uint32_t(cm.heads)));
}

MD_DEV bool reached(uint32_t value, uint32_t target) {
  return int32_t(value - target) >= 0;
}

enum : uint32_t { kIdle, kRunning, kWaiting, kStalled, kFinished };

MD_GLOBAL void megakernel(const DevStep* sp) {
  const DevStep& s = *sp;
  init_pipe();
  Pipe pipe;
  const uint32_t b = port::block_id();
  DevStatus& st = s.status[b];
  volatile uint32_t* stop = block_word();  // thread 0's verdict for the block
  // The block's queue, or its part in this launch (DevStep::queue_end: a distributed plan's
  // segment between two collectives).
  const uint32_t qend = s.queue_end ? s.queue_end[b] : s.queue_off[b + 1];
  for (uint32_t q = s.queue_off[b]; q < qend; ++q) {
    const plan::Instr in = s.instrs[s.queue_ids[q]];
    // The tile's first weight chunks stream in while thread 0 waits for its inputs (issued here
    // unless the previous tile's tail did). A tile that streams no weights lends the stages to
    // the next instruction's first chunks for its wait and its run.
    pipe.after_tile = q + 1 < qend ? first_stream(s, s.instrs[s.queue_ids[q + 1]]) : StreamRef{};
    prefetch_tile(s, in, pipe);
    if (!streams_weights(in.op) && pipe.after_tile.w && !pipe.pre_n) {
      prefetch(*pipe.after_tile.w, pipe.after_tile.r0, pipe.after_tile.r1, pipe);
      pipe.pre_next = pipe.pre_n > 0;
    }
    if (port::thread_id() == 0) {
      st.instr = in.id;
      uint32_t aborted = 0;
      for (int k = 0; k < 2 && !aborted; ++k) {
        const plan::Wait w = in.wait[k];
        if (w.counter == plan::kNone) continue;
        const uint32_t target = w.target + s.epoch * s.per_step[w.counter];
        const uint64_t t0 = port::now_ns();
        for (uint32_t i = 0; !reached(port::load_acquire(&s.counters[w.counter]), target); ++i) {
          if (i == 0) {
            st.counter = w.counter;
            st.target = target;
            st.state = kWaiting;
          }
          if (port::load_relaxed(s.abort) != 0 ||
              ((i & 255) == 255 && port::now_ns() - t0 > s.watchdog_ns)) {
            port::store_relaxed(s.abort, 1);
            aborted = 1;
            break;
          }
          port::pause("a plan counter");
        }
      }
      if (!aborted && (in.flags & plan::kFlagTestStall)) {
        st.state = kStalled;
        const uint64_t t0 = port::now_ns();
        while (port::load_relaxed(s.abort) == 0 && port::now_ns() - t0 <= s.watchdog_ns)
          port::pause("the test hook's stall");
        port::store_relaxed(s.abort, 1);
        aborted = 1;
      }
      if (!aborted) st.state = kRunning;
      *stop = aborted;
    }
    port::sync_block();
    if (*stop) {
      if (pipe.pre_n) drain(pipe);  // no copy may outlive the block
      return;
    }
    // (pipe.after_tile: the next instruction's first stream, which this tile's last GEMV issues
    // at its tail.)
    run_tile(s, in, pipe);
    port::sync_block();
    if (port::thread_id() == 0 && in.signal != plan::kNone) {
      port::fence_device();
      port::atomic_add_release(&s.counters[in.signal], 1);
    }
  }
  if (pipe.pre_n) drain(pipe);  // (none expected: the last instruction has no successor)
  if (port::thread_id() == 0) st.state = kFinished;
}

MD_CUDA_END

namespace md::cuda {

namespace {
// Random-weight jobs per launch (one thread each).
constexpr size_t kMaxJobs = size_t(1) << 18;
}  // namespace

#if defined(MD_CUDA_SIM)

namespace {

class SimDevice final : public Device {
 public:
  SimDevice() {
    info_.name = "cuda-sim (host simulation)";
    info_.sm_count = sim::config().sm_count;
    info_.cc_major = 9;
    info_.cc_minor = 0;
  }
  Backend backend() const override { return Backend::kSim; }
  const DeviceInfo& info() const override { return info_; }
  void* alloc(size_t bytes) override {
    const size_t n = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, n);
    MD_CHECK(p != nullptr, "cuda-sim: cannot allocate {} bytes of device memory", bytes);
    std::memset(p, 0, n);
    return p;
  }
  void free(void* p) override { std::free(p); }
  void* alloc_host(size_t bytes) override { return alloc(bytes); }
  void free_host(void* p) override { std::free(p); }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void zero(void* p, size_t bytes) override {
    if (bytes) std::memset(p, 0, bytes);
  }
  void run_phase(const DevStep* step, uint32_t first, uint32_t count) override {
    sim::launch(count, kTileThreads, kSmemBytes, false, [=] { phase_kernel(step, first); });
  }
  void run_megakernel(const DevStep* step, uint32_t blocks) override {
    sim::launch(blocks, kTileThreads, kSmemBytes, true, [=] { megakernel(step); });
  }
  void run_commit(const DevCommit* commit, uint32_t blocks) override {
    sim::launch(blocks, kTileThreads, kSmemBytes, false, [=] { commit_kernel(commit); });
  }
  void fill_random(const RandomJob* jobs, size_t n) override {
    for (size_t i = 0; i < n; i += kMaxJobs) {
      const uint32_t m = uint32_t(std::min(n - i, kMaxJobs));
      const RandomJob* p = jobs + i;
      sim::launch((m + kRandomThreads - 1) / kRandomThreads, kRandomThreads, 0, false,
                  [=] { random_kernel(p, m); });
    }
  }
  void sync() override {}
  double read_bandwidth_gbps(size_t bytes) override {
    std::vector<uint64_t> buf(bytes / 8, 1);
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      uint64_t acc = 0;
      for (uint64_t v : buf) acc ^= v;
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (acc == 0x9e3779b9u) buf[0] = acc;
      best = std::max(best, double(bytes) / s / 1e9);
    }
    return best;
  }

 private:
  DeviceInfo info_;
};

}  // namespace

std::unique_ptr<Device> make_sim_device() {
  return std::make_unique<SimDevice>();
}

#else  // the GPU

namespace {

// Errors after which the context is unusable (a trap, a fault): every later call fails too.
bool sticky(cudaError_t e) {
  return e == cudaErrorIllegalAddress || e == cudaErrorLaunchFailure ||
         e == cudaErrorIllegalInstruction || e == cudaErrorMisalignedAddress ||
         e == cudaErrorInvalidAddressSpace || e == cudaErrorInvalidPc ||
         e == cudaErrorHardwareStackError || e == cudaErrorAssert;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw_error(std::string("CUDA: ") + what + " failed: " + cudaGetErrorString(e) + " (" +
                std::to_string(int(e)) + ")" +
                (sticky(e) ? "; a device fault: the CUDA context is lost, restart the process "
                             "(a device trap prints its reason on stdout)"
                           : ""));
}

class GpuDevice final : public Device {
 public:
  GpuDevice() {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
      throw_error(std::string("no CUDA device: ") +
                  (e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports no GPU"));
    check(cudaSetDevice(0), "cudaSetDevice");
    cudaDeviceProp p{};
    check(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties");
    info_.name = p.name;
    info_.sm_count = p.multiProcessorCount;
    info_.memory_bytes = p.totalGlobalMem;
    info_.cc_major = p.major;
    info_.cc_minor = p.minor;
    if (p.major < 8)
      throw_error(std::string("CUDA: ") + p.name + " (compute capability " +
                  std::to_string(p.major) + "." + std::to_string(p.minor) +
                  ") is older than sm_80");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaFuncSetAttribute(phase_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(kSmemBytes)),
          "cudaFuncSetAttribute(phase_kernel)");
    check(cudaFuncSetAttribute(megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(kSmemBytes)),
          "cudaFuncSetAttribute(megakernel)");
    check(cudaFuncSetAttribute(commit_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(kSmemBytes)),
          "cudaFuncSetAttribute(commit_kernel)");
  }
  ~GpuDevice() override {
    for (auto& g : graphs_)
      if (g) cudaGraphExecDestroy(g);
    if (stream_) cudaStreamDestroy(stream_);
  }
  Backend backend() const override { return Backend::kGpu; }
  const DeviceInfo& info() const override { return info_; }
  void* alloc(size_t bytes) override {
    void* p = nullptr;
    check(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc");
    // Zeroed in this device's stream order: a plain cudaMemset runs on the legacy stream, which a
    // non-blocking stream does not wait for, so it could land after the copies that follow.
    if (bytes) check(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemset");
    return p;
  }
  void free(void* p) override {
    // (cudaFree waits for the device; a buffer is never freed while this stream still uses it.)
    if (p) cudaFree(p);
  }
  void* alloc_host(size_t bytes) override {
    void* p = nullptr;
    check(cudaMallocHost(&p, std::max<size_t>(bytes, 1)), "cudaMallocHost");
    return p;
  }
  void free_host(void* p) override {
    if (p) cudaFreeHost(p);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpy");
  }
  void zero(void* p, size_t bytes) override {
    if (bytes) check(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemset");
  }
  void run_phase(const DevStep* step, uint32_t first, uint32_t count) override {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(count);
    cfg.blockDim = dim3(kTileThreads);
    cfg.dynamicSmemBytes = kSmemBytes;
    cfg.stream = stream_;
    cudaLaunchAttribute attr[1]{};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = info_.cc_major >= 9 ? 1 : 0;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    check(cudaLaunchKernelEx(&cfg, phase_kernel, step, first), "phase kernel launch");
  }
  void run_megakernel(const DevStep* step, uint32_t blocks) override {
    void* args[] = {&step};
    check(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(megakernel), dim3(blocks),
                                      dim3(kTileThreads), args, kSmemBytes, stream_),
          "megakernel launch (cooperative: one block per SM)");
  }
  void run_commit(const DevCommit* commit, uint32_t blocks) override {
    commit_kernel<<<blocks, kTileThreads, kSmemBytes, stream_>>>(commit);
    check(cudaGetLastError(), "commit kernel launch");
  }
  void fill_random(const RandomJob* jobs, size_t n) override {
    if (n == 0) return;
    const size_t batch = std::min(n, kMaxJobs);
    auto* d = static_cast<RandomJob*>(alloc(batch * sizeof(RandomJob)));
    for (size_t i = 0; i < n; i += batch) {
      const uint32_t m = uint32_t(std::min(n - i, batch));
      check(cudaMemcpyAsync(d, jobs + i, m * sizeof(RandomJob), cudaMemcpyHostToDevice, stream_),
            "cudaMemcpy (random weight jobs)");
      random_kernel<<<(m + kRandomThreads - 1) / kRandomThreads, kRandomThreads, 0, stream_>>>(d,
                                                                                           m);
      check(cudaGetLastError(), "random weights kernel launch");
      check(cudaStreamSynchronize(stream_), "random weights generation");
    }
    free(d);
  }
  void sync() override { check(cudaStreamSynchronize(stream_), "the decode step"); }
  double read_bandwidth_gbps(size_t bytes) override {
    void* p = alloc(bytes);
    void* sink = alloc(16);
    cudaEvent_t a, b;
    check(cudaEventCreate(&a), "cudaEventCreate");
    check(cudaEventCreate(&b), "cudaEventCreate");
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
      check(cudaEventRecord(a, stream_), "cudaEventRecord");
      read_kernel<<<unsigned(info_.sm_count) * 4, 512, 0, stream_>>>(
          static_cast<const port::U4*>(p), bytes / 16, static_cast<uint32_t*>(sink));
      check(cudaEventRecord(b, stream_), "cudaEventRecord");
      check(cudaEventSynchronize(b), "the bandwidth probe");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
      if (rep > 0) best = std::max(best, double(bytes) / (double(ms) * 1e-3) / 1e9);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    free(sink);
    free(p);
    return best;
  }
  bool graphs() const override { return true; }
  void begin_capture() override {
    check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "graph capture");
  }
  void end_capture(int id) override {
    cudaGraph_t g = nullptr;
    check(cudaStreamEndCapture(stream_, &g), "graph capture");
    if (size_t(id) >= graphs_.size()) graphs_.resize(size_t(id) + 1, nullptr);
    if (graphs_[size_t(id)]) cudaGraphExecDestroy(graphs_[size_t(id)]);
    graphs_[size_t(id)] = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&graphs_[size_t(id)], g, 0);
    cudaGraphDestroy(g);
    check(e, "graph instantiate");
  }
  void abort_capture() override {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(stream_, &g);
      if (g) cudaGraphDestroy(g);
    }
    cudaGetLastError();  // the capture's error is reported by the caller
  }
  void replay(int id) override {
    if (size_t(id) >= graphs_.size() || !graphs_[size_t(id)])
      throw_error("CUDA: graph " + std::to_string(id) + " was never instantiated");
    check(cudaGraphLaunch(graphs_[size_t(id)], stream_), "graph launch");
  }

 private:
  DeviceInfo info_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaGraphExec_t> graphs_;
};

}  // namespace

std::unique_ptr<Device> make_gpu_device() {
  return std::make_unique<GpuDevice>();
}

#endif

}  // namespace md::cuda
