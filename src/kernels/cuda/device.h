// The CUDA backend's device: memory, copies and the two kernels of the decode plan, on a GPU
// (kernels.cu built by nvcc) or on the host simulation (the same kernels.cu built with
// MD_CUDA_SIM). The host executor (src/exec/cuda) sees only this interface, so it is one code for
// both. Device memory is addressed by plain pointers (unified addressing: copy() takes any
// direction).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "megadecode/model/random_init.h"

namespace md::cuda {

struct DevStep;
struct DevCommit;

// One chunk of a random tensor to generate in device memory (Device::fill_random): `out` is the
// tensor's device address.
struct RandomJob {
  RandomInit init;
  void* out = nullptr;
  uint64_t chunk = 0;
};

enum class Backend : uint8_t { kGpu, kSim };

struct DeviceInfo {
  std::string name;
  int sm_count = 0;
  size_t memory_bytes = 0;
  int cc_major = 0, cc_minor = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual Backend backend() const = 0;
  virtual const DeviceInfo& info() const = 0;
  // Zeroed device memory (256-byte aligned); free(nullptr) is a no-op.
  virtual void* alloc(size_t bytes) = 0;
  virtual void free(void* p) = 0;
  // Page-locked host memory for the step's inputs and outputs.
  virtual void* alloc_host(size_t bytes) = 0;
  virtual void free_host(void* p) = 0;
  // Copies in stream order (any direction); sync() waits for everything queued.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  // The op-by-op kernel: `count` blocks, block i runs instruction first + i of the step's plan.
  virtual void run_phase(const DevStep* step, uint32_t first, uint32_t count) = 0;
  // The persistent megakernel: `blocks` co-resident blocks (at most sm_count), block i walks its
  // queue.
  virtual void run_megakernel(const DevStep* step, uint32_t blocks) = 0;
  // A commit's KDA replay: `blocks` = KDA layers x heads blocks over *commit (device memory),
  // queued in stream order.
  virtual void run_commit(const DevCommit* commit, uint32_t blocks) = 0;
  // Generates the jobs' chunks (make-model's bytes, model/random_init.h) in device memory, one
  // device thread a chunk, and waits for them. `jobs` is host memory.
  virtual void fill_random(const RandomJob* jobs, size_t n) = 0;
  // Waits for the queued work; an md::Error on a device fault.
  virtual void sync() = 0;
  // The device's read bandwidth (GB/s) over a buffer of `bytes`, best of a few passes of a
  // streaming-read kernel: the floor the benchmark divides a step's bytes by. (The simulation
  // measures the host's memory, which says nothing about a GPU.)
  virtual double read_bandwidth_gbps(size_t bytes) = 0;
  // CUDA graphs (the GPU only; the simulation runs the calls as they come): capture the calls
  // between begin_capture and end_capture into graph `id`, replay it.
  virtual bool graphs() const { return false; }
  virtual void begin_capture() {}
  virtual void end_capture(int id) { (void)id; }
  // Ends a capture that failed part-way (the stream leaves capture mode; nothing is kept).
  virtual void abort_capture() {}
  virtual void replay(int id) { (void)id; }
};

// Throws md::Error(what): for the nvcc-built code, which keeps fmt (error.h) out of its host pass.
[[noreturn]] void throw_error(const std::string& what);

// The GPU (device 0): an md::Error "no CUDA device: ..." when the binary has no CUDA build, the
// driver is missing or no GPU is visible.
std::unique_ptr<Device> make_gpu_device();
// The host simulation (include/megadecode/kernels/cuda/sim.h).
std::unique_ptr<Device> make_sim_device();

}  // namespace md::cuda
