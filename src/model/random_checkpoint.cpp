// Checkpoint::random: make-model's random weights without files (safetensors.h). The host part is
// what bind_weights reads into vectors at load; the rest is reserved address space and recipes,
// which the CUDA executors turn into device memory (exec/cuda, kernels/cuda random_kernel).
#include <sys/mman.h>

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/model/presets.h"
#include "megadecode/model/safetensors.h"
#include "megadecode/model/weights.h"

namespace md {

namespace {

// The host tensors' bytes and the inaccessible reservation that gives the others addresses.
struct RandomStorage {
  std::vector<uint8_t> host;
  void* reserved = nullptr;
  size_t reserved_bytes = 0;
  ~RandomStorage() {
    if (reserved) munmap(reserved, reserved_bytes);
  }
};

size_t align_up(size_t n) {
  return (n + 255) / 256 * 256;
}

}  // namespace

std::unique_ptr<Checkpoint> Checkpoint::random(const ModelConfig& cfg, uint64_t seed) {
  std::unique_ptr<Checkpoint> ck(new Checkpoint());
  ck->dir_ = fmt::format("random weights (seed {})", seed);
  const std::vector<TensorSpec> specs = expected_tensors(cfg);
  size_t host_bytes = 0, device_bytes = 0;
  for (const TensorSpec& t : specs)
    (t.read_at_load ? host_bytes : device_bytes) += align_up(t.nbytes());
  auto storage = std::make_shared<RandomStorage>();
  storage->host.resize(host_bytes);
  if (device_bytes) {
    // Address space only: PROT_NONE and MAP_NORESERVE commit no memory, even for 100 GB.
    void* p = mmap(nullptr, device_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    MD_CHECK(p != MAP_FAILED, "random weights: cannot reserve {} bytes of address space",
             device_bytes);
    storage->reserved = p;
    storage->reserved_bytes = device_bytes;
  }
  size_t host_off = 0, device_off = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& t = specs[i];
    const RandomInit in = random_init(t, cfg, seed, i);
    TensorInfo info;
    info.name = t.name;
    info.dtype = t.dtype;
    info.shape = t.shape;
    info.nbytes = t.nbytes();
    info.file = ck->dir_;
    if (t.read_at_load) {
      uint8_t* out = storage->host.data() + host_off;
      for (uint64_t c = 0; c < in.chunks(); ++c) fill_random_chunk(in, c, out);
      info.data = out;
      host_off += align_up(info.nbytes);
    } else {
      info.data = static_cast<uint8_t*>(storage->reserved) + device_off;
      device_off += align_up(info.nbytes);
      ck->device_only_.emplace(info.data, in);
    }
    ck->tensors_.emplace(t.name, std::move(info));
  }
  ck->storage_ = std::move(storage);
  return ck;
}

const void* Checkpoint::add_device_only(const RandomInit& r, size_t bytes) {
  MD_CHECK(bytes > 0 && r.numel * r.element_bytes() == bytes,
           "random weights: a recipe of {} elements of {} bytes for a tensor of {} bytes", r.numel,
           r.element_bytes(), bytes);
  void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  MD_CHECK(p != MAP_FAILED, "random weights: cannot reserve {} bytes of address space", bytes);
  reservations_.push_back(std::shared_ptr<void>(p, [bytes](void* q) { munmap(q, bytes); }));
  device_only_.emplace(p, r);
  return p;
}

}  // namespace md
