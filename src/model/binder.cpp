// Binder: tensors by name, shape and dtype (model/binder.h).
#include "megadecode/model/binder.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/model/config.h"
#include "megadecode/model/safetensors.h"

namespace md {

Mat Binder::mat(const std::string& name, int64_t rows, int64_t cols, bool allow_f32,
                DType write_dtype) {
  const TensorInfo* t = lookup(name, {rows, cols}, write_dtype);
  Mat m;
  m.rows = rows;
  m.cols = cols;
  if (!t) return m;
  MD_CHECK(t->dtype == DType::BF16 || (allow_f32 && t->dtype == DType::F32),
           "tensor {} in {}: dtype {} is not supported for this weight (expected BF16{})", name,
           t->file, dtype_name(t->dtype), allow_f32 ? " or F32" : "");
  m.data = t->data;
  m.dtype = t->dtype;
  return m;
}

// An MXFP4 matrix [rows, cols]: `base`.weight_packed U8 [rows, cols/2] and `base`.weight_scale
// U8 [rows, cols/32] (compressed-tensors mxfp4-pack-quantized).
Mat Binder::mxfp4(const std::string& base, int64_t rows, int64_t cols) {
  Mat m;
  m.rows = rows;
  m.cols = cols;
  m.dtype = DType::U8;
  m.quant = WeightQuant::kMxfp4;
  m.group = 32;
  const TensorInfo* p = lookup(base + ".weight_packed", {rows, cols / 2}, DType::U8);
  const TensorInfo* s = lookup(base + ".weight_scale", {rows, cols / 32}, DType::U8);
  if (!p) return m;
  for (const TensorInfo* t : {p, s})
    MD_CHECK(t->dtype == DType::U8,
             "tensor {} in {}: dtype {} is not supported for an MXFP4 weight (expected U8)",
             t->name, t->file, dtype_name(t->dtype));
  // E8M0 255 is NaN (OCP MX): reject the checkpoint rather than compute NaNs. (Random scales
  // generated on a device never are: random_init.h.)
  const auto* sc = static_cast<const uint8_t*>(s->data);
  const size_t checked = ck_->device_only(s->data) ? 0 : s->nbytes;
  for (size_t i = 0; i < checked; ++i)
    MD_CHECK(sc[i] != 255, "tensor {} in {}: scale byte {} is 255 (NaN in E8M0)", s->name, s->file,
             i);
  m.data = p->data;
  m.scales = sc;
  return m;
}

void Binder::set_quant(const ModelConfig& c) {
  quant_ = c.linear_quant;
  quant_group_ = c.quant_group;
  quant_asymmetric_ = c.quant_asymmetric;
  quant_actorder_ = c.quant_actorder;
  quant_block_rows_ = c.quant_block_rows;
  quant_scale_name_ = c.quant_scale_name;
  quant_ignore_ = c.quant_ignore;
}

bool Binder::quantized_module(const std::string& module) const {
  if (quant_ == WeightQuant::kNone || quant_ignored(quant_ignore_, module)) return false;
  // MXFP4: the linears the checkpoint packs (K3's release leaves modules that are not nn.Linear,
  // such as the router and the latent projections, out of its ignore list); without a checkpoint
  // (make-model's specs) only the routed experts are, through mxfp4().
  if (quant_ == WeightQuant::kMxfp4) return ck_ && ck_->find(module + ".weight_packed") != nullptr;
  // FP8: the linears stored as F8_E4M3 (DeepSeek-style checkpoints keep some in bf16 without
  // listing them).
  if (quant_ == WeightQuant::kFp8) {
    const TensorInfo* t = ck_ ? ck_->find(module + ".weight") : nullptr;
    return t && t->dtype == DType::F8E4M3;
  }
  return true;
}

Mat Binder::bf16_linear(const std::string& module, int64_t rows, int64_t cols, const char* why,
                        bool allow_f32, DType write_dtype) {
  MD_CHECK(!quantized_module(module),
           "config.json: quantization_config quantizes {}, which megadecode reads as bf16 values "
           "({}); its `ignore` list must name it",
           module, why);
  return mat(module + ".weight", rows, cols, allow_f32, write_dtype);
}

Mat Binder::linear(const std::string& module, int64_t rows, int64_t cols) {
  if (quant_ == WeightQuant::kFp8 && !ck_ && !quant_ignored(quant_ignore_, module)) {
    // Specs of an FP8 config (inspect's byte counts): e4m3 weights and their block scales.
    const int64_t group = quant_group_ ? quant_group_ : cols, br = quant_block_rows_;
    lookup(module + ".weight", {rows, cols}, DType::F8E4M3);
    lookup(module + "." + quant_scale_name_, {br ? (rows + br - 1) / br : 1, cols / group},
           DType::F32);
    Mat m;
    m.rows = rows;
    m.cols = cols;
    return m;
  }
  if (!quantized_module(module)) return mat(module + ".weight", rows, cols);
  if (quant_ == WeightQuant::kMxfp4) {
    MD_CHECK(cols % 32 == 0,
             "{}: {} columns do not split into MXFP4's groups of 32 (the checkpoint packs it)",
             module, cols);
    return mxfp4(module, rows, cols);
  }
  if (quant_ == WeightQuant::kFp8) return fp8(module, *ck_->find(module + ".weight"), rows, cols);
  return packed_int(module, rows, cols);
}

Mat Binder::fp8(const std::string& module, const TensorInfo& w, int64_t rows, int64_t cols) {
  MD_CHECK(w.shape == (std::vector<int64_t>{rows, cols}),
           "tensor {} in {}: shape {} does not match the config (expected [{}, {}])", w.name,
           w.file, w.shape_str(), rows, cols);
  used_.insert(w.name);
  const int64_t group = quant_group_ ? quant_group_ : cols;
  MD_CHECK(cols % 32 == 0 && cols % group == 0,
           "{}: {} columns do not split into the checkpoint's FP8 scale blocks of {} columns (the "
           "kernels need whole blocks of a multiple of 32)",
           module, cols, group);
  const int64_t br = quant_block_rows_;  // 0: one scale for all rows
  const int64_t srows = br ? (rows + br - 1) / br : 1, scols = cols / group;
  const std::string sname = module + "." + quant_scale_name_;
  const TensorInfo* s = ck_->find(sname);
  MD_CHECK(s, "checkpoint {}: missing tensor {} (the FP8 scales of {})", ck_->dir(), sname, w.name);
  used_.insert(sname);
  MD_CHECK(s->dtype == DType::F32 || s->dtype == DType::BF16,
           "tensor {} in {}: dtype {} (expected F32 or BF16 scales)", s->name, s->file,
           dtype_name(s->dtype));
  MD_CHECK(s->numel() == srows * scols && (s->shape.empty() || s->shape[0] == srows),
           "tensor {} in {}: shape {} does not match the weight's {} scale blocks of {} x {} "
           "(expected [{}, {}])",
           s->name, s->file, s->shape_str(), w.shape_str(), br ? br : rows, group, srows, scols);
  MD_CHECK(!ck_->device_only(w.data), "{}: FP8 weights need host memory", w.name);
  const auto* v = static_cast<const uint8_t*>(w.data);
  for (size_t i = 0; i < w.nbytes; ++i)
    MD_CHECK((v[i] & 0x7f) != 0x7f, "tensor {} in {}: byte {} is 0x{:02x}, NaN in e4m3", w.name,
             w.file, i, v[i]);
  // The scales, expanded to one fp32 per row and group of columns for the kernels.
  auto buf = std::make_shared<std::vector<uint8_t>>(size_t(rows) * size_t(scols) * 4);
  auto* out = reinterpret_cast<float*>(buf->data());
  const auto* sb = static_cast<const uint8_t*>(s->data);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < scols; ++j) {
      const size_t at = size_t((br ? r / br : 0) * scols + j);
      float f;
      if (s->dtype == DType::F32) {
        std::memcpy(&f, sb + at * 4, 4);
      } else {
        bf16 h;
        std::memcpy(&h, sb + at * 2, 2);
        f = bf16_to_f32(h);
      }
      MD_CHECK(std::isfinite(f), "tensor {} in {}: scale {} is {} (FP8 scales must be finite)",
               s->name, s->file, at, f);
      out[r * scols + j] = f;
    }
  Mat m;
  m.rows = rows;
  m.cols = cols;
  m.dtype = DType::F8E4M3;
  m.quant = WeightQuant::kFp8;
  m.group = int32_t(group);
  m.data = w.data;
  m.scales = buf->data();
  owned_.push_back(std::move(buf));
  return m;
}

Mat Binder::packed_int(const std::string& module, int64_t rows, int64_t cols) {
  const int bits = quant_ == WeightQuant::kInt8 ? 8 : 4;
  const int64_t group = quant_group_ ? quant_group_ : cols;
  MD_CHECK(cols % 32 == 0 && cols % group == 0,
           "{}: {} columns do not split into the checkpoint's int{} groups of {} (the kernels need "
           "whole groups of a multiple of 32 columns)",
           module, cols, bits, group);
  Mat m;
  m.rows = rows;
  m.cols = cols;
  m.dtype = DType::U8;
  m.quant = quant_;
  m.group = int32_t(group);
  const TensorInfo* p =
      lookup(module + ".weight_packed", {rows, cols * bits / 32}, DType::I32);
  const TensorInfo* s = lookup(module + ".weight_scale", {rows, cols / group}, DType::BF16);
  const TensorInfo* sh = lookup(module + ".weight_shape", {2}, DType::I64, /*read_at_load=*/true);
  const int64_t groups = cols / group;
  const TensorInfo* z =
      quant_asymmetric_
          ? lookup(module + ".weight_zero_point", {(rows + 7) / 8, groups}, DType::I32)
          : nullptr;
  const TensorInfo* gi =
      quant_actorder_ ? lookup(module + ".weight_g_idx", {cols}, DType::I32, /*read_at_load=*/true)
                      : nullptr;
  if (!p) return m;
  MD_CHECK(p->dtype == DType::I32,
           "tensor {} in {}: dtype {} (expected I32: packed int{} codes)", p->name, p->file,
           dtype_name(p->dtype), bits);
  MD_CHECK(s->dtype == DType::BF16,
           "tensor {} in {}: dtype {} (expected BF16: the int{} kernels read bf16 group scales)",
           s->name, s->file, dtype_name(s->dtype), bits);
  MD_CHECK(sh->dtype == DType::I32 || sh->dtype == DType::I64,
           "tensor {} in {}: dtype {} (expected I32 or I64)", sh->name, sh->file,
           dtype_name(sh->dtype));
  // (Read bytewise: safetensors packs tensors back to back, so an I64 after an odd number of
  // 4-byte elements is not 8-byte aligned in the mapping.)
  int64_t shape[2];
  for (int i = 0; i < 2; ++i) {
    if (sh->dtype == DType::I64) {
      std::memcpy(&shape[i], static_cast<const uint8_t*>(sh->data) + 8 * i, 8);
    } else {
      int32_t v;
      std::memcpy(&v, static_cast<const uint8_t*>(sh->data) + 4 * i, 4);
      shape[i] = v;
    }
  }
  MD_CHECK(shape[0] == rows && shape[1] == cols,
           "tensor {} in {}: [{}, {}] does not match the config (expected [{}, {}])", sh->name,
           sh->file, shape[0], shape[1], rows, cols);
  MD_CHECK(gi || !ck_->find(module + ".weight_g_idx"),
           "checkpoint {}: {}.weight_g_idx is present, but the config says int{} without "
           "activation order",
           ck_->dir(), module, bits);
  MD_CHECK(quant_asymmetric_ || !ck_->find(module + ".weight_zero_point"),
           "checkpoint {}: {}.weight_zero_point is present, but the config says symmetric int{}",
           ck_->dir(), module, bits);
  // A scale that is not finite (or is zero) would turn its whole group into NaN or 0.
  const auto* sc = static_cast<const bf16*>(s->data);
  if (!ck_->device_only(s->data))
    for (int64_t i = 0; i < rows * (cols / group); ++i)
      MD_CHECK((sc[i] & 0x7f80) != 0x7f80 && (sc[i] & 0x7fff) != 0,
               "tensor {} in {}: scale {} is {} (int{} scales must be finite and nonzero)",
               s->name, s->file, i, bf16_to_f32(sc[i]), bits);
  m.data = p->data;
  m.scales = static_cast<const uint8_t*>(s->data);
  if (gi) m = with_activation_order(m, *gi);
  if (z) return with_zero_points(m, *z);
  return m;
}

// Activation-ordered groups: column k of the checkpoint belongs to group g_idx[k]. The codes are
// copied with the columns sorted by group (stably: ascending k within a group), so that groups
// are consecutive runs of `group` columns again and the scales (and zero points) keep their
// group index; col_perm[j] is the checkpoint column now at j, which the kernels' entry gathers
// the vectors by (kernels/cpu/linear.h). Every group must hold exactly `group` columns.
Mat Binder::with_activation_order(const Mat& m, const TensorInfo& gi) {
  MD_CHECK(gi.dtype == DType::I32, "tensor {} in {}: dtype {} (expected I32: group indices)",
           gi.name, gi.file, dtype_name(gi.dtype));
  MD_CHECK(!ck_->device_only(m.data), "{}: activation order needs the codes in host memory",
           gi.name);
  const int64_t K = m.cols, groups = K / m.group;
  std::vector<int64_t> count(static_cast<size_t>(groups), 0);
  std::vector<int32_t> g(static_cast<size_t>(K));
  std::memcpy(g.data(), gi.data, size_t(K) * 4);
  for (int64_t k = 0; k < K; ++k) {
    MD_CHECK(g[size_t(k)] >= 0 && g[size_t(k)] < groups,
             "tensor {} in {}: column {} is in group {}, outside the {} groups of {} columns",
             gi.name, gi.file, k, g[size_t(k)], groups, m.group);
    ++count[size_t(g[size_t(k)])];
  }
  for (int64_t j = 0; j < groups; ++j)
    MD_CHECK(count[size_t(j)] == m.group,
             "tensor {} in {}: group {} has {} columns (every group needs exactly {})", gi.name,
             gi.file, j, count[size_t(j)], m.group);
  auto perm = std::make_shared<std::vector<uint8_t>>(size_t(K) * 4);
  auto* cp = reinterpret_cast<int32_t*>(perm->data());
  std::vector<int64_t> next(static_cast<size_t>(groups));
  for (int64_t j = 0; j < groups; ++j) next[size_t(j)] = j * m.group;
  for (int64_t k = 0; k < K; ++k) cp[next[size_t(g[size_t(k)])]++] = int32_t(k);
  const size_t rb = m.code_row_bytes();
  auto codes = weight_buffer(size_t(m.rows) * rb);
  const auto* src = static_cast<const uint8_t*>(m.data);
  for (int64_t r = 0; r < m.rows; ++r) {
    const uint8_t* in = src + size_t(r) * rb;
    uint8_t* out = codes->data() + size_t(r) * rb;
    if (m.int8()) {
      for (int64_t j = 0; j < K; ++j) out[j] = in[cp[j]];
      continue;
    }
    for (int64_t j = 0; j < K; j += 2) {
      auto nib = [&](int64_t k) { return k % 2 ? in[k / 2] >> 4 : in[k / 2] & 15; };
      out[j / 2] = static_cast<uint8_t>(nib(cp[j]) | (nib(cp[j + 1]) << 4));
    }
  }
  Mat q = m;
  q.data = codes->data();
  q.col_perm = cp;
  owned_.push_back(std::move(codes));
  owned_.push_back(std::move(perm));
  return q;
}

// Asymmetric int4: the codes stay in place, and the zero points are unpacked into one signed byte
// z = zc - 8 per row and group (zc the zero point's 4-bit code), which the int4 kernels' zero-point
// terms read (kernels/cpu/int4.h): each weight is (c - zc) * scale, exactly.
Mat Binder::with_zero_points(const Mat& m, const TensorInfo& z) {
  MD_CHECK(z.dtype == DType::I32, "tensor {} in {}: dtype {} (expected I32: packed zero points)",
           z.name, z.file, dtype_name(z.dtype));
  MD_CHECK(!ck_->device_only(z.data), "{}: zero points need to be in host memory", z.name);
  const int64_t groups = m.cols / m.group;
  auto buf = std::make_shared<std::vector<uint8_t>>(size_t(m.rows) * size_t(groups));
  const auto* zp = static_cast<const uint8_t*>(z.data);
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      // Row r's zero point of group g: nibble r % 8 of int32 [r / 8, g] (little-endian bytes).
      const uint8_t zbyte =
          zp[(size_t(r / 8) * size_t(groups) + size_t(g)) * 4 + size_t(r % 8) / 2];
      const int zc = r % 2 ? zbyte >> 4 : zbyte & 15;
      (*buf)[size_t(r) * size_t(groups) + size_t(g)] = static_cast<uint8_t>(int8_t(zc - 8));
    }
  Mat q = m;
  q.zero_points = reinterpret_cast<const int8_t*>(buf->data());
  owned_.push_back(std::move(buf));
  return q;
}

// A vector of which only the first `n` entries are used, stored with any shape whose dimensions
// are all 1 but one of at least n (K3 ships A_log with more entries than heads); the specs
// record `write_shape`.
std::vector<float> Binder::vec_prefix(const std::string& name, int64_t n,
                                      std::vector<int64_t> write_shape, DType write_dtype) {
  if (!ck_) {
    specs_->push_back(TensorSpec{name, write_dtype, write_shape, /*read_at_load=*/true});
    return {};
  }
  const TensorInfo* t = ck_->find(name);
  MD_CHECK(t, "checkpoint {}: missing tensor {} (expected at least {} entries)", ck_->dir(), name,
           n);
  int big = 0;
  for (int64_t d : t->shape) big += d != 1;
  MD_CHECK(big <= 1 && t->numel() >= n,
           "tensor {} in {}: shape {} does not match the config (expected a vector of at least "
           "{} entries)",
           name, t->file, t->shape_str(), n);
  std::vector<float> v = vec(name, t->shape, write_dtype);
  v.resize(size_t(n));
  return v;
}

// A small tensor read into fp32 (any float dtype); `shape` is the exact expected shape.
std::vector<float> Binder::vec(const std::string& name, std::vector<int64_t> shape,
                               DType write_dtype) {
  const TensorInfo* t = lookup(name, shape, write_dtype, /*read_at_load=*/true);
  if (!t) return {};
  std::vector<float> out(static_cast<size_t>(t->numel()));
  switch (t->dtype) {
    case DType::F32: {
      auto* p = static_cast<const float*>(t->data);
      out.assign(p, p + out.size());
      break;
    }
    case DType::BF16: {
      auto* p = static_cast<const bf16*>(t->data);
      for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_f32(p[i]);
      break;
    }
    case DType::F16: {
      auto* p = static_cast<const uint16_t*>(t->data);
      for (size_t i = 0; i < out.size(); ++i) out[i] = f16_to_f32(p[i]);
      break;
    }
    default:
      fail("tensor {} in {}: dtype {} is not a floating-point type", name, t->file,
           dtype_name(t->dtype));
  }
  return out;
}

// Returns the number of tensors skipped as outside the language model.
int Binder::check_no_extra() {
  if (!ck_) return 0;
  std::vector<std::string> extra;
  int skipped = 0;
  for (const auto& [name, t] : ck_->tensors()) {
    if (used_.count(name)) continue;
    if (!language_prefix_.empty() && name.rfind(language_prefix_, 0) != 0) {
      if (skipped++ == 0) first_skipped_ = name;
      continue;
    }
    extra.push_back(name);
  }
  if (!extra.empty()) {
    if (extra.size() > 5) extra.resize(5), extra.push_back("...");
    fail("checkpoint {}: unexpected tensor(s) not used by the architecture: {}", ck_->dir(),
         fmt::join(extra, ", "));
  }
  return skipped;
}

const TensorInfo* Binder::lookup(const std::string& name, const std::vector<int64_t>& shape,
                                 DType write_dtype, bool read_at_load) {
  if (!ck_) {
    specs_->push_back(TensorSpec{name, write_dtype, shape, read_at_load});
    return nullptr;
  }
  const TensorInfo* t = ck_->find(name);
  MD_CHECK(t, "checkpoint {}: missing tensor {} (expected shape [{}])", ck_->dir(), name,
           fmt::join(shape, ", "));
  MD_CHECK(t->shape == shape, "tensor {} in {}: shape {} does not match the config (expected [{}])",
           name, t->file, t->shape_str(), fmt::join(shape, ", "));
  used_.insert(name);
  return t;
}

FfnWeights bind_ffn(Binder& b, const std::string& p, const char* g, const char* u, const char* d,
                    int64_t D, int64_t I, bool mxfp4) {
  FfnWeights f;
  if (mxfp4) {
    f.gate = b.mxfp4(p + g, I, D);
    f.up = b.mxfp4(p + u, I, D);
    f.down = b.mxfp4(p + d, D, I);
    return f;
  }
  f.gate = b.linear(p + g, I, D);
  f.up = b.linear(p + u, I, D);
  f.down = b.linear(p + d, D, I);
  return f;
}

}  // namespace md
