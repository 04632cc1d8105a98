// Greedy speculative decoding against plain batch-1 decode of the same executor, in the same run
// (bench.h "speculative").
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/bench/bench.h"
#include "megadecode/exec/executor.h"
#include "megadecode/kernels/cpu/bandwidth.h"
#include "megadecode/spec/speculative.h"

namespace md::bench {

namespace {

// Proposes the recorded continuation of the history (the agreeing draft).
class OracleDrafter : public Drafter {
 public:
  explicit OracleDrafter(const std::vector<int32_t>& truth) : truth_(truth) {}
  std::string_view name() const override { return "oracle"; }
  void reset() override {}
  void observe(std::span<const int32_t>, int64_t, std::span<const float>) override {}
  void propose(std::span<const int32_t> context, std::span<int32_t> out) override {
    for (size_t i = 0; i < out.size(); ++i) {
      const size_t at = context.size() + i;
      out[i] = at < truth_.size() ? truth_[at] : 0;
    }
  }

 private:
  const std::vector<int32_t>& truth_;
};

}  // namespace

SpeculativeBenchResult run_speculative(
    Model& m, const std::function<std::unique_ptr<Drafter>(Executor*)>& make_drafter,
    const SpeculativeBenchOptions& o) {
  MD_CHECK(o.steps >= 1 && o.reps >= 1 && o.context >= 1, "bench: steps, reps, context >= 1");
  std::vector<int> fixed = o.fixed_lengths.empty() ? std::vector<int>{-1} : o.fixed_lengths;
  for (int f : fixed)
    MD_CHECK(f >= -1 && f <= o.num_draft_tokens,
             "bench: --fixed-acceptance-length {} is not in 0..{} (--num-draft-tokens)", f,
             o.num_draft_tokens);
  const int64_t V = m.config().vocab_size;
  const int W = o.workers > 0 ? o.workers : online_cpus();
  Rng rng(29);
  std::vector<int32_t> prompt(size_t(o.context));
  for (auto& id : prompt) id = int32_t(rng.next() % uint64_t(std::max<int64_t>(V - 256, 1)));

  SpeculativeBenchResult res;
  res.num_draft_tokens = o.num_draft_tokens;
  std::vector<double> bw;
  const double total = double(o.reps) * double(o.executors.size()) * double(fixed.size());
  double done = 0;
  std::vector<float> logits(static_cast<size_t>(V));
  for (const std::string& n : o.executors) {
    ExecutorOptions eo;
    eo.workers = W;
    eo.device = o.device;
    eo.states = m.options().states;
    std::unique_ptr<Executor> ex = make_executor(m, parse_executor_kind(n), 1, eo);
    std::vector<int32_t> truth;  // the oracle's: the prompt and plain greedy decoding's tokens
    const std::unique_ptr<Drafter> drafter_of_ex =
        o.oracle ? std::make_unique<OracleDrafter>(truth) : make_drafter(ex.get());
    Drafter& drafter = *drafter_of_ex;
    res.drafter = std::string(drafter.name());
    auto first_token = [&] {
      int32_t best = 0;
      for (int64_t v = 1; v < V; ++v)
        if (logits[size_t(v)] > logits[size_t(best)]) best = int32_t(v);
      return best;
    };
    // Plain greedy decode: tokens/s of `steps` steps (the plan's in-step argmax).
    auto plain_block = [&] {
      SequenceState s = ex->new_sequence();
      ex->prefill(s, prompt, logits.data());
      int32_t next = first_token();
      SequenceState* p = &s;
      const double t0 = now_seconds();
      for (int i = 0; i < o.steps; ++i) {
        int32_t chosen = -1;
        ex->step(std::span(&p, 1), std::span(&next, 1), nullptr, &chosen);
        next = chosen;
      }
      return (now_seconds() - t0) / o.steps;
    };
    if (o.oracle) {
      SequenceState s = ex->new_sequence();
      ex->prefill(s, prompt, logits.data());
      truth = prompt;
      truth.push_back(first_token());
      SequenceState* p = &s;
      const size_t want = prompt.size() + size_t(o.steps) * size_t(o.num_draft_tokens + 1) +
                          size_t(o.num_draft_tokens) + 1;
      while (truth.size() < want) {
        int32_t chosen = -1;
        ex->step(std::span(&p, 1), std::span(&truth.back(), 1), nullptr, &chosen);
        truth.push_back(chosen);
      }
    }
    for (int f : fixed) {
      SpeculativeOptions so;
      so.num_draft_tokens = o.num_draft_tokens;
      so.fixed_acceptance_length = f;
      SpeculativeDecoder dec(*ex, drafter, so);
      auto spec_block = [&](SpeculativeStats* st) {
        SequenceState s = ex->new_sequence();
        dec.reset();
        dec.prefill(s, prompt, logits.data());
        std::vector<int32_t> history = prompt;
        history.push_back(first_token());
        dec.reset_stats();
        const double t0 = now_seconds();
        for (int i = 0; i < o.steps; ++i)
          dec.step(s, history, nullptr, [](int32_t) { return true; });
        const double t = now_seconds() - t0;
        // The agreeing draft's run must emit plain greedy decoding's tokens (exactness).
        if (o.oracle && f < 0)
          MD_CHECK(std::equal(history.begin(), history.end(), truth.begin()),
                   "bench: speculative decoding with the agreeing draft emitted other tokens "
                   "than plain greedy decoding");
        *st = dec.stats();
        return t;
      };
      SpeculativeStats st;
      plain_block();  // warm-up: the plans of both shapes compiled, caches warm
      spec_block(&st);
      std::vector<double> step_ms, draft_ms, verify_ms, tps, plain_ms, plain_tps, speedup;
      double accepted = 0, emitted = 0, steps = 0;
      for (int rep = 0; rep < o.reps; ++rep) {
        if (o.progress)
          o.progress(done / total,
                     fmt::format("speculative {} fixed {} rep {}/{}", n, f, rep + 1, o.reps));
        if (o.device == DeviceKind::kCpu)
          bw.push_back(cpu::measure_read_bandwidth_gbps(m.pool(), size_t(1) << 29, 1));
        std::this_thread::sleep_for(std::chrono::milliseconds(3));
        const double pt = plain_block();
        const double t = spec_block(&st);
        step_ms.push_back(t / double(st.steps) * 1e3);
        draft_ms.push_back(st.draft_seconds / double(st.steps) * 1e3);
        verify_ms.push_back(st.verify_seconds / double(st.steps) * 1e3);
        tps.push_back(double(st.emitted) / t);
        plain_ms.push_back(pt * 1e3);
        plain_tps.push_back(1.0 / pt);
        speedup.push_back(tps.back() / plain_tps.back());
        accepted += double(st.accepted);
        emitted += double(st.emitted);
        steps += double(st.steps);
        done += 1;
      }
      SpeculativeCell c;
      c.executor = n;
      c.fixed = f;
      c.step_ms = median(step_ms);
      c.draft_ms = median(draft_ms);
      c.verify_ms = median(verify_ms);
      c.accepted_per_step = accepted / steps;
      c.tokens_per_step = emitted / steps;
      c.tokens_per_s = median(tps);
      c.plain_ms = median(plain_ms);
      c.plain_tokens_per_s = median(plain_tps);
      c.speedup = median(speedup);
      res.cells.push_back(c);
    }
  }
  if (o.device == DeviceKind::kCpu) cpu::release_bandwidth_buffer();
  res.bandwidth_gbps = bw.empty() ? 0 : median(bw);
  return res;
}

}  // namespace md::bench
