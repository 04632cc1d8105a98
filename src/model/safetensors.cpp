#include "megadecode/model/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>
#include <utility>

#include "megadecode/base/error.h"

namespace md {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr std::string_view kSingleFile = "model.safetensors";
constexpr std::string_view kIndexFile = "model.safetensors.index.json";
constexpr std::string_view kSuffix = ".safetensors";
// A valid header nests three levels deep (header, tensor, shape). The cap keeps hostile input from
// building deep trees that recursive code (dump, destructors in older nlohmann) would walk.
constexpr int kMaxJsonDepth = 16;

// strerror() is not thread-safe; the generic category gives the same text without shared state.
std::string errno_text(int e) {
  return std::error_code(e, std::generic_category()).message();
}

// Names and strings in messages come from untrusted files: escaping control characters keeps each
// message on one line, and the length cap keeps a megabyte-long name from flooding a log.
std::string printable(std::string_view s) {
  constexpr size_t kMax = 200;
  std::string out;
  for (size_t i = 0; i < s.size() && i < kMax; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kMax) out += "...";
  return out;
}

// A short description of a JSON value for messages: scalars are shown, containers only named.
std::string describe(const json& j) {
  if (j.is_structured()) return j.type_name();
  return printable(j.dump(-1, ' ', false, json::error_handler_t::replace));
}

std::string format_shape(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Byte size of a tensor, or false for a negative dimension or a size that does not fit in int64.
// A zero dimension is checked first: [2^40, 2^40, 0] is a valid empty tensor even though the
// product of its leading dimensions would overflow.
bool checked_nbytes(const std::vector<int64_t>& shape, DType dtype, uint64_t* out) {
  for (int64_t d : shape) {
    if (d < 0) return false;
  }
  for (int64_t d : shape) {
    if (d == 0) {
      *out = 0;
      return true;
    }
  }
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = n;
  return true;
}

// nlohmann keeps the last of two equal keys, so a file could otherwise carry two different
// definitions of one tensor and silently use one of them. The parse callback sees every key in
// document order, which is the only point where duplicates are still visible.
json parse_json(const uint8_t* begin, const uint8_t* end, const std::string& what) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        [[fallthrough]];
      case json::parse_event_t::array_start:
        MD_CHECK(depth < kMaxJsonDepth, "{}: JSON nested deeper than {} levels", what,
                 kMaxJsonDepth);
        break;
      case json::parse_event_t::object_end:
        keys.pop_back();
        break;
      case json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        MD_CHECK(keys.back().insert(key).second, "{}: duplicate key '{}' in JSON", what,
                 printable(key));
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(begin, end, on_event);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", what, printable(e.what()));
  }
}

std::optional<uint64_t> as_u64(const json& j) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer() && j.get<int64_t>() >= 0) {
    return static_cast<uint64_t>(j.get<int64_t>());
  }
  return std::nullopt;
}

// Byte range of a tensor within the data section, for the overlap check.
struct Range {
  uint64_t begin, end;
  const std::string* name;
};

TensorInfo parse_tensor(const std::string& file, const std::string& key, const json& value,
                        const uint8_t* base, uint64_t data_size, Range* range) {
  const std::string tn = printable(key);
  MD_CHECK(!key.empty(), "{}: empty tensor name in header", file);
  MD_CHECK(value.is_object(), "{}: entry for tensor '{}' must be a JSON object, got {}", file, tn,
           describe(value));
  for (const auto& [field, v] : value.items()) {
    MD_CHECK(field == "dtype" || field == "shape" || field == "data_offsets",
             "{}: unexpected field '{}' for tensor '{}'", file, printable(field), tn);
  }
  auto field = [&](const char* f) -> const json& {
    auto it = value.find(f);
    MD_CHECK(it != value.end(), "{}: tensor '{}' has no \"{}\"", file, tn, f);
    return *it;
  };

  TensorInfo t;
  t.name = key;
  t.file = file;
  const json& jd = field("dtype");
  MD_CHECK(jd.is_string(), "{}: dtype of tensor '{}' must be a string, got {}", file, tn,
           describe(jd));
  const auto dtype = dtype_from_name(jd.get_ref<const std::string&>());
  MD_CHECK(dtype.has_value(),
           "{}: unsupported dtype {} for tensor '{}' (supported: BF16, F16, F32, U8, I32, I64, F8_E4M3)", file,
           printable(jd.get_ref<const std::string&>()), tn);
  t.dtype = *dtype;

  const json& js = field("shape");
  MD_CHECK(js.is_array(),
           "{}: shape of tensor '{}' must be an array of non-negative integers, got {}", file, tn,
           describe(js));
  for (const json& d : js) {
    const auto v = as_u64(d);
    MD_CHECK(v && *v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
             "{}: shape of tensor '{}' has invalid dimension {} (must be a non-negative integer)",
             file, tn, describe(d));
    t.shape.push_back(static_cast<int64_t>(*v));
  }

  const json& jo = field("data_offsets");
  MD_CHECK(jo.is_array() && jo.size() == 2,
           "{}: data_offsets of tensor '{}' must be [begin, end], got {}", file, tn, describe(jo));
  const auto begin = as_u64(jo[0]), end = as_u64(jo[1]);
  MD_CHECK(begin && end,
           "{}: data_offsets of tensor '{}' must be non-negative integers, got [{}, {}]", file, tn,
           describe(jo[0]), describe(jo[1]));
  MD_CHECK(*begin <= *end, "{}: data_offsets of tensor '{}' have begin {} > end {}", file, tn,
           *begin, *end);
  MD_CHECK(*end <= data_size,
           "{}: data_offsets of tensor '{}' end at {}, beyond the data section ({} bytes)", file,
           tn, *end, data_size);

  uint64_t nbytes = 0;
  MD_CHECK(checked_nbytes(t.shape, t.dtype, &nbytes),
           "{}: shape {} of tensor '{}' is too large (byte size overflows)", file,
           format_shape(t.shape), tn);
  MD_CHECK(*end - *begin == nbytes,
           "{}: tensor '{}' has {} bytes in data_offsets but {} {} needs {} bytes", file, tn,
           *end - *begin, dtype_name(t.dtype), format_shape(t.shape), nbytes);
  t.data = base + *begin;
  t.nbytes = static_cast<size_t>(nbytes);
  *range = Range{*begin, *end, nullptr};
  return t;
}

void check_no_overlap(const std::string& file, std::vector<Range>& ranges) {
  // Empty tensors occupy no bytes, so they may sit anywhere, even inside another tensor.
  std::erase_if(ranges, [](const Range& r) { return r.begin == r.end; });
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Range* reach = nullptr;  // the range seen so far that ends last
  for (const Range& r : ranges) {
    if (reach && r.begin < reach->end) {
      fail("{}: tensors '{}' [{}, {}) and '{}' [{}, {}) overlap", file, printable(*reach->name),
           reach->begin, reach->end, printable(*r.name), r.begin, r.end);
    }
    if (!reach || r.end > reach->end) reach = &r;
  }
}

// Adds one shard's tensors to a checkpoint, rejecting a name already taken by another shard.
void merge_shard(const SafetensorsFile& shard, std::map<std::string, TensorInfo>* all) {
  for (const auto& [name, info] : shard.tensors()) {
    auto [it, inserted] = all->emplace(name, info);
    MD_CHECK(inserted, "tensor '{}' is present in two shards: {} and {}", printable(name),
             it->second.file, info.file);
  }
}

// Entry paths of a directory, sorted. Iterating with error codes keeps filesystem_error (a
// different exception type) from escaping on an unreadable directory.
std::vector<fs::path> list_dir(const std::string& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) out.push_back(it->path());
  MD_CHECK(!ec, "cannot list directory {}: {}", dir, ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

// Shard names come from the index; anything but a plain name could reach outside the directory.
bool plain_file_name(const std::string& s) {
  return !s.empty() && s.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos &&
         s.find("..") == std::string::npos && s != ".";
}

bool is_shard_name(const std::string& s) {
  // model-00001-of-00003.safetensors
  if (s.size() != 32 || !s.starts_with("model-") || !s.ends_with(kSuffix)) return false;
  if (s.compare(11, 4, "-of-") != 0) return false;
  auto digits = [&](size_t pos) {
    return std::all_of(s.begin() + pos, s.begin() + pos + 5,
                       [](char c) { return c >= '0' && c <= '9'; });
  };
  return digits(6) && digits(15);
}

// Writes a file under a temporary name and renames it into place on commit(), so that a failed
// write never leaves a truncated file under the final name.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    MD_CHECK(fd_ >= 0, "cannot create {}: {}", tmp_, errno_text(errno));
  }
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      // Linux transfers at most ~2 GiB per call; larger tensors take several.
      const ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      MD_CHECK(w > 0, "cannot write {}: {}", tmp_, w < 0 ? errno_text(errno) : "no progress");
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  // Some file systems (NFS) report write errors only when the file is closed.
  void close() {
    const int fd = std::exchange(fd_, -1);
    MD_CHECK(::close(fd) == 0, "cannot write {}: {}", tmp_, errno_text(errno));
  }
  void commit() {
    MD_CHECK(::rename(tmp_.c_str(), path_.c_str()) == 0, "cannot rename {} to {}: {}", tmp_, path_,
             errno_text(errno));
    committed_ = true;
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

// Index of the first tensor of each shard, plus specs.size() at the end. A shard is closed once
// the running byte count passes its equal share of the total (a tensor goes to the shard holding
// most of it), but every shard gets at least one tensor.
std::vector<size_t> shard_starts(const std::vector<uint64_t>& sizes, size_t shards) {
  using u128 = unsigned __int128;
  const size_t n = sizes.size();
  u128 total = 0, cum = 0;
  for (uint64_t s : sizes) total += s;
  std::vector<size_t> starts{0};
  for (size_t i = 0; i < n; ++i) {
    const size_t cur = starts.size() - 1;
    if (i > starts.back() && cur + 1 < shards) {
      const bool must = n - i == shards - 1 - cur;  // one tensor left per remaining shard
      const bool full = (cum + sizes[i] / 2) * shards >= total * (cur + 1);
      if (must || full) starts.push_back(i);
    }
    cum += sizes[i];
  }
  starts.push_back(n);
  return starts;
}

std::string dump_json(const nlohmann::ordered_json& j, int indent, const std::string& what) {
  try {
    return j.dump(indent);
  } catch (const json::exception& e) {  // invalid UTF-8 in a tensor name or metadata
    fail("{}: cannot encode header: {}", what, e.what());
  }
}

}  // namespace

int64_t TensorInfo::numel() const {
  // Zero first: the leading dimensions of an empty tensor may multiply past int64.
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const {
  return format_shape(shape);
}

size_t TensorSpec::nbytes() const {
  uint64_t n = 0;
  MD_CHECK(checked_nbytes(shape, dtype, &n),
           "tensor '{}': shape {} has a negative dimension or its byte size overflows",
           printable(name), format_shape(shape));
  return static_cast<size_t>(n);
}

SafetensorsContents parse_safetensors_buffer(const uint8_t* data, size_t size,
                                             const std::string& name) {
  MD_CHECK(size >= 8, "{}: file is {} bytes, shorter than the 8-byte header length", name, size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
  MD_CHECK(n > 0, "{}: header length is 0", name);
  MD_CHECK(n <= size - 8, "{}: header length {} goes beyond the end of the file ({} bytes)", name,
           n, size);
  const uint8_t* base = data + 8 + n;
  const uint64_t data_size = size - 8 - n;

  const json header = parse_json(data + 8, base, name + ": header");
  MD_CHECK(header.is_object(), "{}: header must be a JSON object, got {}", name, describe(header));
  SafetensorsContents out;
  std::vector<Range> ranges;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      MD_CHECK(value.is_object(), "{}: __metadata__ must be an object of strings, got {}", name,
               describe(value));
      for (const auto& [mk, mv] : value.items()) {
        MD_CHECK(mv.is_string(), "{}: __metadata__ value of '{}' must be a string, got {}", name,
                 printable(mk), describe(mv));
        out.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    Range r{};
    TensorInfo t = parse_tensor(name, key, value, base, data_size, &r);
    auto it = out.tensors.emplace(key, std::move(t)).first;
    r.name = &it->first;
    ranges.push_back(r);
  }
  check_no_overlap(name, ranges);
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path, const LoadOptions& opt)
    : file_(std::make_unique<MappedFile>(path, opt)) {
  SafetensorsContents c = parse_safetensors_buffer(file_->data(), file_->size(), path);
  tensors_ = std::move(c.tensors);
  metadata_ = std::move(c.metadata);
}

namespace {

// Per-file load options whose progress reports bytes of the whole list of files.
class LoadProgress {
 public:
  LoadProgress(const LoadOptions& opt, const std::vector<fs::path>& paths) : opt_(opt) {
    std::error_code ec;
    for (const fs::path& p : paths) {
      const auto n = fs::file_size(p, ec);
      if (!ec) total_ += double(n);
    }
  }
  LoadOptions next() {
    LoadOptions o = opt_;
    if (opt_.progress) {
      o.progress = [this](double d, double t) {
        opt_.progress(base_ + d, total_);
        if (d == t) base_ += t;
      };
    }
    return o;
  }

 private:
  LoadOptions opt_;
  double total_ = 0, base_ = 0;
};

}  // namespace

Checkpoint::Checkpoint(const std::string& dir, const LoadOptions& opt) : dir_(dir) {
  std::error_code ec;
  MD_CHECK(fs::is_directory(dir, ec), "checkpoint {} is not a directory{}", dir,
           ec ? ": " + ec.message() : "");
  const fs::path index_path = fs::path(dir) / kIndexFile;
  const bool has_index = fs::exists(index_path, ec);
  MD_CHECK(!ec, "cannot stat {}: {}", index_path.string(), ec.message());
  if (!has_index) {
    // No index: take every *.safetensors file, so a model.safetensors or an index-less set of
    // shards both load; merge_shard still rejects a tensor present twice. Anything unreadable
    // under that name (a directory, a dangling link) is reported by MappedFile.
    std::vector<fs::path> paths;
    for (const fs::path& p : list_dir(dir)) {
      const std::string fname = p.filename().string();
      if (fname.ends_with(kSuffix) && fname.size() > kSuffix.size()) paths.push_back(p);
    }
    MD_CHECK(!paths.empty(), "checkpoint {} has no {}, {} or other *{} files", dir, kSingleFile,
             kIndexFile, kSuffix);
    LoadProgress progress(opt, paths);
    for (const auto& p : paths) {
      files_.push_back(std::make_unique<SafetensorsFile>(p.string(), progress.next()));
      merge_shard(*files_.back(), &tensors_);
    }
    return;
  }

  const std::string ipath = index_path.string();
  MappedFile index_file(ipath);
  const json index = parse_json(index_file.data(), index_file.data() + index_file.size(), ipath);
  MD_CHECK(index.is_object(), "{}: must be a JSON object, got {}", ipath, describe(index));
  const auto meta = index.find("metadata");
  MD_CHECK(meta == index.end() || meta->is_object(), "{}: \"metadata\" must be an object, got {}",
           ipath, describe(*meta));
  const auto wm = index.find("weight_map");
  MD_CHECK(wm != index.end(), "{}: no \"weight_map\"", ipath);
  MD_CHECK(wm->is_object(), "{}: \"weight_map\" must be an object, got {}", ipath, describe(*wm));
  MD_CHECK(!wm->empty(), "{}: \"weight_map\" is empty", ipath);

  std::set<std::string> shard_names;
  for (const auto& [name, file] : wm->items()) {
    MD_CHECK(file.is_string(), "{}: weight_map entry of tensor '{}' must be a file name, got {}",
             ipath, printable(name), describe(file));
    const auto& fname = file.get_ref<const std::string&>();
    MD_CHECK(plain_file_name(fname),
             "{}: shard '{}' of tensor '{}' is not a plain file name in the checkpoint directory",
             ipath, printable(fname), printable(name));
    shard_names.insert(fname);
  }
  std::map<std::string, const SafetensorsFile*> shards;
  std::vector<fs::path> shard_paths;
  for (const std::string& fname : shard_names) {
    shard_paths.push_back(fs::path(dir) / fname);
    MD_CHECK(fs::exists(shard_paths.back(), ec), "{}: shard {} is missing", ipath,
             shard_paths.back().string());
  }
  LoadProgress progress(opt, shard_paths);
  for (const std::string& fname : shard_names) {
    const fs::path p = fs::path(dir) / fname;
    files_.push_back(std::make_unique<SafetensorsFile>(p.string(), progress.next()));
    shards[fname] = files_.back().get();
    // Tensors a shard holds beyond the weight_map are kept: the index is only a lookup table.
    merge_shard(*files_.back(), &tensors_);
  }
  for (const auto& [name, file] : wm->items()) {
    const auto& fname = file.get_ref<const std::string&>();
    MD_CHECK(shards.at(fname)->tensors().contains(name),
             "{}: tensor '{}' is listed in shard {} but absent from it", ipath, printable(name),
             fname);
  }
}

const TensorInfo* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorInfo& Checkpoint::get(const std::string& name) const {
  const TensorInfo* t = find(name);
  MD_CHECK(t != nullptr, "tensor '{}' not found in checkpoint {}", printable(name), dir_);
  return *t;
}

size_t Checkpoint::total_bytes() const {
  size_t total = 0;
  for (const auto& [name, t] : tensors_) total += t.nbytes;
  return total;
}

size_t Checkpoint::huge_page_bytes() const {
  size_t n = 0;
  for (const auto& f : files_) n += huge_mapped_bytes(f->file().data(), f->file().size());
  return n;
}

size_t Checkpoint::file_bytes() const {
  size_t n = 0;
  for (const auto& f : files_) n += f->file().size();
  return n;
}

void write_checkpoint(const std::string& dir, const std::vector<TensorSpec>& specs,
                      const TensorFiller& fill, int shards,
                      const std::map<std::string, std::string>& metadata) {
  MD_CHECK(shards >= 1, "write_checkpoint {}: shard count {} must be at least 1", dir, shards);
  const auto nshards = static_cast<size_t>(shards);
  MD_CHECK(nshards == 1 || nshards <= specs.size(),
           "write_checkpoint {}: cannot split {} tensors into {} shards", dir, specs.size(),
           shards);
  std::vector<uint64_t> sizes;
  std::set<std::string_view> names;
  for (const TensorSpec& s : specs) {
    MD_CHECK(!s.name.empty() && s.name != "__metadata__",
             "write_checkpoint {}: invalid tensor name '{}'", dir, printable(s.name));
    MD_CHECK(names.insert(s.name).second, "write_checkpoint {}: duplicate tensor name '{}'", dir,
             printable(s.name));
    sizes.push_back(s.nbytes());
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  MD_CHECK(!ec, "cannot create checkpoint directory {}: {}", dir, ec.message());

  const std::vector<size_t> starts =
      nshards == 1 ? std::vector<size_t>{0, specs.size()} : shard_starts(sizes, nshards);
  std::vector<uint8_t> buffer(1);  // reused for every tensor; never empty, so data() is non-null
  std::vector<std::unique_ptr<AtomicFile>> files;
  std::set<std::string> written;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  uint64_t total_size = 0;
  for (size_t k = 0; k < nshards; ++k) {
    const std::string fname =
        nshards == 1 ? std::string(kSingleFile)
                     : fmt::format("model-{:05d}-of-{:05d}{}", k + 1, nshards, kSuffix);
    const std::string path = (fs::path(dir) / fname).string();
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    uint64_t offset = 0;
    for (size_t i = starts[k]; i < starts[k + 1]; ++i) {
      header[specs[i].name] = {{"dtype", std::string(dtype_name(specs[i].dtype))},
                               {"shape", specs[i].shape},
                               {"data_offsets", {offset, offset + sizes[i]}}};
      offset += sizes[i];
      weight_map[specs[i].name] = fname;
    }
    total_size += offset;
    // Padding the header keeps the data section, and so every tensor, 8-byte aligned in memory.
    std::string text = dump_json(header, -1, path);
    text.append((8 - text.size() % 8) % 8, ' ');
    uint8_t len[8];
    for (int b = 0; b < 8; ++b) len[b] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * b));

    files.push_back(std::make_unique<AtomicFile>(path));
    AtomicFile& f = *files.back();
    f.write(len, sizeof(len));
    f.write(text.data(), text.size());
    for (size_t i = starts[k]; i < starts[k + 1]; ++i) {
      if (sizes[i] > buffer.size()) buffer.resize(sizes[i]);
      fill(specs[i], buffer.data());
      f.write(buffer.data(), sizes[i]);
    }
    f.close();
    written.insert(fname);
  }
  if (nshards > 1) {
    const std::string path = (fs::path(dir) / kIndexFile).string();
    nlohmann::ordered_json index = {{"metadata", {{"total_size", total_size}}},
                                    {"weight_map", std::move(weight_map)}};
    const std::string text = dump_json(index, 2, path) + "\n";
    files.push_back(std::make_unique<AtomicFile>(path));
    files.back()->write(text.data(), text.size());
    files.back()->close();
    written.insert(std::string(kIndexFile));
  }
  for (auto& f : files) f->commit();

  // Files of an earlier layout in the same directory would mislead readers: an old index wins over
  // a new model.safetensors, and without an index every *.safetensors is loaded.
  for (const fs::path& p : list_dir(dir)) {
    const std::string fname = p.filename().string();
    const bool ours = fname == kSingleFile || fname == kIndexFile || is_shard_name(fname);
    if (!ours || written.contains(fname)) continue;
    MD_CHECK(fs::remove(p, ec) || !ec, "cannot remove stale {}: {}", p.string(), ec.message());
  }
}

}  // namespace md
