// Reading and writing safetensors checkpoints. Files are memory-mapped read-only and tensors are
// used in place; every header field and offset is validated against the file before use.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "megadecode/base/dtype.h"
#include "megadecode/model/mapped_file.h"
#include "megadecode/model/random_init.h"

namespace md {

struct ModelConfig;

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // points into the mapping
  size_t nbytes = 0;
  std::string file;  // the file it came from, for messages

  int64_t numel() const;
  std::string shape_str() const;  // e.g. "[32, 2304]"
};

// The tensors and metadata of one safetensors file.
struct SafetensorsContents {
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

// Parses and validates a whole safetensors file held in memory (the checks SafetensorsFile lists
// below); `name` is used in messages and as TensorInfo::file. Data pointers point into `data`.
// Exposed so that tests and the fuzz harness can exercise the parser without files.
SafetensorsContents parse_safetensors_buffer(const uint8_t* data, size_t size,
                                             const std::string& name);

// One .safetensors file. The constructor validates: 8-byte header length within the file, the
// header is a JSON object of tensors (plus optional "__metadata__" of string values), each with a
// known dtype, a non-negative shape, data_offsets [begin, end] with begin <= end inside the data
// section, end - begin == numel * dtype size, and no two tensors overlapping.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path, const LoadOptions& opt = {});
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const MappedFile& file() const { return *file_; }

 private:
  std::unique_ptr<MappedFile> file_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory: model.safetensors, or the shards listed by
// model.safetensors.index.json ("weight_map": name -> file). A tensor listed in the index but
// absent from its shard, or present in two shards, is an error.
class Checkpoint {
 public:
  // opt: how the files' bytes are brought in (model/mapped_file.h); its progress callback gets
  // the bytes of the whole checkpoint.
  explicit Checkpoint(const std::string& dir, const LoadOptions& opt = {});
  // make-model's random weights for (cfg, seed), never written to files (src/model/
  // random_checkpoint.cpp): the tensors bind_weights reads at load (norms, biases, conv taps) are
  // generated in host memory; every other tensor (the matrices: nearly all the bytes) exists only
  // as its recipe, for the CUDA executors to generate in device memory. Those tensors' data
  // pointers address reserved inaccessible memory, so a host read is a crash, never garbage.
  static std::unique_ptr<Checkpoint> random(const ModelConfig& cfg, uint64_t seed);
  const TensorInfo* find(const std::string& name) const;  // nullptr if absent
  const TensorInfo& get(const std::string& name) const;   // throws md::Error naming it
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::string& dir() const { return dir_; }  // Checkpoint::random: "random weights (seed S)"
  size_t total_bytes() const;
  // Bytes of the files currently mapped with huge pages (huge_mapped_bytes over every file), and
  // the files' bytes in all.
  size_t huge_page_bytes() const;
  size_t file_bytes() const;
  // The recipe of the tensor at `data` when its bytes are not in host memory (nullptr for every
  // tensor of a checkpoint read from files).
  const RandomInit* device_only(const void* data) const {
    auto it = device_only_.find(data);
    return it == device_only_.end() ? nullptr : &it->second;
  }
  // Every tensor's bytes are in host memory (what the CPU paths need).
  bool host_complete() const { return device_only_.empty(); }
  // A tensor of `bytes` whose bytes, like Checkpoint::random's, exist only as a recipe for the
  // device: address space is reserved for it (no memory) and device_only() knows it. Load-time
  // quantization of random device weights draws its codes and scales this way.
  const void* add_device_only(const RandomInit& r, size_t bytes);

 private:
  Checkpoint() = default;
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<const void*, RandomInit> device_only_;
  std::shared_ptr<void> storage_;  // Checkpoint::random: the host tensors and the reservation
  std::vector<std::shared_ptr<void>> reservations_;  // add_device_only's
};

// Writes a checkpoint without holding it in memory: tensors are produced one at a time by `fill`
// (which writes exactly nbytes into out) and streamed to disk. With shards > 1 the tensors are
// split in order into files model-0000i-of-0000K.safetensors of roughly equal size, plus
// model.safetensors.index.json; with shards == 1 a single model.safetensors is written.
struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  bool read_at_load = false;  // bind_weights converts it into a host vector (not used in place)
  size_t nbytes() const;
};
using TensorFiller = std::function<void(const TensorSpec& spec, uint8_t* out)>;
void write_checkpoint(const std::string& dir, const std::vector<TensorSpec>& specs,
                      const TensorFiller& fill, int shards = 1,
                      const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace md
