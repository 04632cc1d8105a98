// Binds checkpoint tensors to typed weights by name, shape and dtype, and records the expected
// tensor specs when there is no checkpoint: one walk over an architecture's tensors serves both
// the loader and make-model, so the two cannot disagree. Used by the target models
// (model/weights.cpp) and the speculative draft (spec/draft_model.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "megadecode/base/dtype.h"
#include "megadecode/model/config.h"
#include "megadecode/model/weights.h"

namespace md {

class Checkpoint;
struct TensorInfo;
struct TensorSpec;

class Binder {
 public:
  // With a checkpoint: bind and validate (a missing tensor or a wrong shape or dtype is an
  // md::Error naming it). Without (ck == nullptr): append what would be read to *specs.
  // language_prefix: tensors outside it are not the language model's (K3's vision tower): they are
  // skipped, not reported as unexpected. Empty: every tensor must be used.
  Binder(const Checkpoint* ck, std::vector<TensorSpec>* specs, std::string language_prefix = "")
      : ck_(ck), specs_(specs), language_prefix_(std::move(language_prefix)) {}

  // A [rows, cols] matrix used in place (BF16, or F32 where allowed).
  Mat mat(const std::string& name, int64_t rows, int64_t cols, bool allow_f32 = false,
          DType write_dtype = DType::BF16);
  // An MXFP4 matrix [rows, cols]: `base`.weight_packed U8 [rows, cols/2] and `base`.weight_scale
  // U8 [rows, cols/32] (compressed-tensors mxfp4-pack-quantized).
  Mat mxfp4(const std::string& base, int64_t rows, int64_t cols);

  // A checkpoint with quantized linears (ModelConfig::linear_quant and the quant_* fields): which
  // modules are quantized and how. Set before the walk.
  void set_quant(const ModelConfig& c);
  // A linear layer's weight [rows, cols] of module `module` (no ".weight"): bf16 `module`.weight,
  // or, when the checkpoint quantizes the module:
  //  * int4 / int8 (pack-quantized) from `module`.weight_packed I32 [rows, cols * bits / 32]
  //    (compressed-tensors' pack_to_int32: q + 2^(bits-1) in the int32's bits from the least
  //    significant up, which is the kernels' byte layout), `module`.weight_scale BF16
  //    [rows, cols/group] and `module`.weight_shape I32/I64 [2] = {rows, cols};
  //    With zero points (asymmetric int4: `module`.weight_zero_point I32 [ceil(rows/8), groups],
  //    pack_to_int32 along the rows: z + 8 of row 8i + k in bits 4k of int32 [i, g]) every weight
  //    is (q - z) * scale: the codes stay in place and z is unpacked to one signed byte a row
  //    and group (Mat::zero_points, memory the Binder owns: take_owned()), which the int4
  //    kernels' zero-point terms read; int4's bytes plus one a group.
  //    With activation-ordered groups (`actorder: "group"`: `module`.weight_g_idx I32 [cols],
  //    each column's group): the codes copied with the columns sorted by group (memory the
  //    Binder owns) and Mat::col_perm, by which the kernels' entry gathers the vectors.
  //  * MXFP4 (mxfp4-pack-quantized) as mxfp4() reads it;
  //  * FP8, when `module`.weight is F8_E4M3: that tensor in place, and its scale tensor (F32 or
  //    BF16: [ceil(rows/br), ceil(cols/bc)] per block, [rows, 1] per channel, [1] for the tensor)
  //    expanded to fp32 per row and group of columns (memory the Binder owns).
  Mat linear(const std::string& module, int64_t rows, int64_t cols);
  // Memory matrices point into instead of the mapping (asymmetric int4's zero points): for
  // ModelWeights::owned.
  std::vector<std::shared_ptr<const void>> take_owned() { return std::move(owned_); }
  // A linear layer megadecode reads as bf16 values (the router gate, MLA's kv_b): an md::Error
  // naming it when the checkpoint quantizes it.
  Mat bf16_linear(const std::string& module, int64_t rows, int64_t cols, const char* why,
                  bool allow_f32 = false, DType write_dtype = DType::BF16);
  // A vector of which only the first `n` entries are used, stored with any shape whose dimensions
  // are all 1 but one of at least n (K3 ships A_log with more entries than heads); the specs
  // record `write_shape`.
  std::vector<float> vec_prefix(const std::string& name, int64_t n,
                                std::vector<int64_t> write_shape, DType write_dtype);
  // A small tensor read into fp32 (any float dtype); `shape` is the exact expected shape.
  std::vector<float> vec(const std::string& name, std::vector<int64_t> shape,
                         DType write_dtype = DType::BF16);
  // An md::Error listing tensors the walk did not use (inside the language prefix); returns the
  // number skipped as outside it.
  int check_no_extra();
  const std::string& first_skipped() const { return first_skipped_; }

 private:
  const TensorInfo* lookup(const std::string& name, const std::vector<int64_t>& shape,
                           DType write_dtype, bool read_at_load = false);

  const Checkpoint* ck_;
  std::vector<TensorSpec>* specs_;
  std::string language_prefix_;
  std::set<std::string> used_;
  std::string first_skipped_;
  WeightQuant quant_ = WeightQuant::kNone;
  int quant_group_ = 0;
  bool quant_asymmetric_ = false;
  bool quant_actorder_ = false;
  int quant_block_rows_ = 0;
  std::string quant_scale_name_;
  Mat fp8(const std::string& module, const TensorInfo& w, int64_t rows, int64_t cols);
  std::vector<std::string> quant_ignore_;
  std::vector<std::shared_ptr<const void>> owned_;
  bool quantized_module(const std::string& module) const;
  Mat packed_int(const std::string& module, int64_t rows, int64_t cols);
  Mat with_zero_points(const Mat& m, const TensorInfo& z);
  Mat with_activation_order(const Mat& m, const TensorInfo& gi);
};

// A gated MLP p+g / p+u / p+d (".weight" appended for bf16; MXFP4 pairs otherwise): gate and up
// [I, D], down [D, I].
FfnWeights bind_ffn(Binder& b, const std::string& p, const char* g, const char* u, const char* d,
                    int64_t D, int64_t I, bool mxfp4 = false);

}  // namespace md
