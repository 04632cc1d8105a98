// The backend-independent parts of the executor interface: step shapes, the decode-step and
// prefill conveniences over Executor::step, and the backend factory.
#include "megadecode/exec/executor.h"

#include <algorithm>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/exec/cpu_executor.h"
#include "megadecode/exec/cuda_executor.h"

namespace md {

int logit_row_count(std::span<const StepSeq> seqs) {
  int n = 0;
  for (const StepSeq& s : seqs) {
    if (s.logits == LogitRows::kAll) n += int(s.tokens.size());
    if (s.logits == LogitRows::kLast && !s.tokens.empty()) n += 1;
  }
  return n;
}

void Executor::step(std::span<SequenceState* const> seqs, std::span<const int32_t> tokens,
                    float* logits, int32_t* next_ids, std::span<const SampleRow> sampling) {
  MD_CHECK(tokens.size() == seqs.size(), "decode step: {} tokens for {} sequences", tokens.size(),
           seqs.size());
  std::vector<StepSeq> ss(seqs.size());
  for (size_t b = 0; b < seqs.size(); ++b)
    ss[b] = StepSeq{seqs[b], tokens.subspan(b, 1), LogitRows::kLast};
  run_step(ss, logits, next_ids, sampling, {});
}

void Executor::attach_draft(const DraftConfig&, const DraftWeights&) {
  fail("the {} executor does not run draft plans (the draft runs on the host)", name());
}

void Executor::draft_step(std::span<const DraftStepSeq>) {
  fail("the {} executor does not run draft plans (the draft runs on the host)", name());
}

namespace {

// A draft ring in host memory (the CPU executors' draft steps read it directly).
class HostDraftRing final : public DraftRingMemory {
 public:
  explicit HostDraftRing(const DraftConfig& c)
      : keys_(size_t(c.num_layers) * size_t(c.window) * size_t(c.kv_width()), 0.0f),
        values_(keys_.size(), 0.0f),
        positions_(size_t(c.window), -1) {}
  DraftRing ring() const override {
    return {const_cast<float*>(keys_.data()), const_cast<float*>(values_.data()),
            const_cast<int32_t*>(positions_.data())};
  }
  void clear() override {
    std::fill(keys_.begin(), keys_.end(), 0.0f);
    std::fill(values_.begin(), values_.end(), 0.0f);
    std::fill(positions_.begin(), positions_.end(), -1);
  }
  void read(std::vector<float>& k, std::vector<float>& v, std::vector<int32_t>& p) const override {
    k = keys_;
    v = values_;
    p = positions_;
  }

 private:
  std::vector<float> keys_, values_;
  std::vector<int32_t> positions_;
};

}  // namespace

std::unique_ptr<DraftRingMemory> Executor::new_draft_ring(const DraftConfig& c) {
  return std::make_unique<HostDraftRing>(c);
}

void Executor::prefill(SequenceState& seq, std::span<const int32_t> ids, float* logits, int chunk) {
  MD_CHECK(!ids.empty(), "prefill: no tokens given");
  MD_CHECK(chunk >= 1 && chunk <= plan::kMaxRows, "prefill: chunk {} is outside 1..{}", chunk,
           plan::kMaxRows);
  for (size_t i = 0; i < ids.size(); i += size_t(chunk)) {
    const size_t n = std::min(ids.size() - i, size_t(chunk));
    const bool last = i + n == ids.size();
    const StepSeq s{&seq, ids.subspan(i, n), last && logits ? LogitRows::kLast : LogitRows::kNone};
    run_step(std::span(&s, 1), logits, nullptr, {}, {});
  }
}

std::string_view device_kind_name(DeviceKind d) {
  return d == DeviceKind::kCpu ? "cpu" : d == DeviceKind::kCuda ? "cuda" : "cuda-sim";
}

DeviceKind parse_device_kind(std::string_view name) {
  if (name == "cpu") return DeviceKind::kCpu;
  if (name == "cuda") return DeviceKind::kCuda;
  if (name == "cuda-sim") return DeviceKind::kCudaSim;
  fail("unknown device '{}' (expected cpu, cuda or cuda-sim)", name);
}

int default_cpu_workers(const Model& m) {
  return cpus_per_rank(m.shard().world());
}

int default_workers(const Model& m, DeviceKind device) {
  return device == DeviceKind::kCpu ? default_cpu_workers(m) : 0;
}

std::unique_ptr<Executor> make_executor(Model& model, ExecutorKind kind, int max_batch,
                                        const ExecutorOptions& opt) {
  if (opt.device == DeviceKind::kCpu) return std::make_unique<CpuExecutor>(model, max_batch, kind, opt);
  return std::make_unique<CudaExecutor>(
      model, max_batch, kind, opt.device == DeviceKind::kCuda ? CudaTarget::kGpu : CudaTarget::kSim,
      opt);
}

}  // namespace md
