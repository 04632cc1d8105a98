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
  const std::vector<int> batches = o.batches.empty() ? std::vector<int>{1} : o.batches;
  for (int b : batches) MD_CHECK(b >= 1 && b <= 64, "bench: speculative batch {} is not in 1..64", b);
  const int max_b = *std::max_element(batches.begin(), batches.end());
  const int64_t V = m.config().vocab_size;
  const int W = o.workers > 0 ? o.workers : default_workers(m, o.device);
  const int K = o.num_draft_tokens;
  // One random prompt per sequence (different prompts route to different experts).
  Rng rng(29);
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(max_b));
  for (auto& p : prompts) {
    p.resize(size_t(o.context));
    for (auto& id : p) id = int32_t(rng.next() % uint64_t(std::max<int64_t>(V - 256, 1)));
  }

  SpeculativeBenchResult res;
  res.num_draft_tokens = K;
  std::vector<double> bw;
  const double total =
      double(o.reps) * double(o.executors.size()) * double(fixed.size()) * double(batches.size());
  double done = 0;
  std::vector<float> logits(static_cast<size_t>(V));
  auto argmax = [&] {
    int32_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (logits[size_t(v)] > logits[size_t(best)]) best = int32_t(v);
    return best;
  };
  for (const std::string& n : o.executors) {
    ExecutorOptions eo;
    eo.workers = W;
    eo.device = o.device;
    eo.states = m.options().states;
    eo.states.max_sequences = std::max(eo.states.max_sequences, 2 * max_b);
    std::unique_ptr<Executor> ex = make_executor(m, parse_executor_kind(n), max_b, eo);
    // The oracle's recordings: each prompt and plain greedy decoding's tokens after it.
    std::vector<std::vector<int32_t>> truth(static_cast<size_t>(max_b));
    std::vector<std::unique_ptr<Drafter>> drafters;
    for (int b = 0; b < max_b; ++b)
      drafters.push_back(o.oracle ? std::make_unique<OracleDrafter>(truth[size_t(b)])
                                  : make_drafter(ex.get()));
    res.drafter = std::string(drafters[0]->name());
    const std::vector<int> aux(drafters[0]->aux_layers().begin(), drafters[0]->aux_layers().end());
    if (o.oracle) {
      for (int b = 0; b < max_b; ++b) {
        SequenceState s = ex->new_sequence();
        ex->prefill(s, prompts[size_t(b)], logits.data());
        std::vector<int32_t>& t = truth[size_t(b)];
        t = prompts[size_t(b)];
        t.push_back(argmax());
        SequenceState* p = &s;
        const size_t want = t.size() + size_t(o.steps) * size_t(K + 1) + size_t(K);
        while (t.size() < want) {
          int32_t chosen = -1;
          ex->step(std::span(&p, 1), std::span(&t.back(), 1), nullptr, &chosen);
          t.push_back(chosen);
        }
      }
    }
    for (int B : batches) {
      // Plain greedy decode at batch B: seconds per step (the plan's in-step argmax).
      auto plain_block = [&] {
        std::vector<SequenceState> s;
        std::vector<SequenceState*> p;
        std::vector<int32_t> next, chosen(static_cast<size_t>(B));
        for (int b = 0; b < B; ++b) {
          s.push_back(ex->new_sequence());
          ex->prefill(s.back(), prompts[size_t(b)], logits.data());
          next.push_back(argmax());
        }
        for (SequenceState& x : s) p.push_back(&x);
        const double t0 = now_seconds();
        for (int i = 0; i < o.steps; ++i) {
          ex->step(p, next, nullptr, chosen.data());
          next = chosen;
        }
        return (now_seconds() - t0) / o.steps;
      };
      for (int f : fixed) {
        SpeculativeOptions so;
        so.num_draft_tokens = K;
        so.fixed_acceptance_length = f;
        SpeculativeDecoder dec(*ex, aux, so);
        auto spec_block = [&](SpeculativeStats* st) {
          std::vector<SequenceState> s;
          std::vector<std::vector<int32_t>> hist(static_cast<size_t>(B));
          for (int b = 0; b < B; ++b) {
            s.push_back(ex->new_sequence());
            Drafter& d = *drafters[size_t(b)];
            d.reset();
            SpeculativeDecoder one(*ex, d, so);
            one.prefill(s.back(), prompts[size_t(b)], logits.data());
            hist[size_t(b)] = prompts[size_t(b)];
            hist[size_t(b)].push_back(argmax());
          }
          std::vector<SpecSeq> qs(static_cast<size_t>(B));
          for (int b = 0; b < B; ++b) {
            qs[size_t(b)].seq = &s[size_t(b)];
            qs[size_t(b)].history = &hist[size_t(b)];
            qs[size_t(b)].drafter = drafters[size_t(b)].get();
            qs[size_t(b)].emit = [](int32_t, std::span<const float>) { return true; };
          }
          dec.reset_stats();
          const double t0 = now_seconds();
          for (int i = 0; i < o.steps; ++i) dec.step_batch(qs);
          const double t = now_seconds() - t0;
          // The agreeing draft's run must emit plain greedy decoding's tokens (exactness).
          if (o.oracle && f < 0)
            for (int b = 0; b < B; ++b)
              MD_CHECK(std::equal(hist[size_t(b)].begin(), hist[size_t(b)].end(),
                                  truth[size_t(b)].begin()),
                       "bench: speculative decoding with the agreeing draft emitted other "
                       "tokens than plain greedy decoding");
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
            o.progress(done / total, fmt::format("speculative {} batch {} fixed {} rep {}/{}", n,
                                                 B, f, rep + 1, o.reps));
          if (o.device == DeviceKind::kCpu)
            bw.push_back(cpu::measure_read_bandwidth_gbps(m.pool(), size_t(1) << 29, 1));
          std::this_thread::sleep_for(std::chrono::milliseconds(3));
          const double pt = plain_block();
          const double t = spec_block(&st);
          // Per batched step (stats count each sequence's step; batches the executor steps).
          const double nb = double(std::max<int64_t>(st.batches, 1));
          step_ms.push_back(t / nb * 1e3);
          draft_ms.push_back(st.draft_seconds / nb * 1e3);
          verify_ms.push_back(st.verify_seconds / nb * 1e3);
          tps.push_back(double(st.emitted) / t);
          plain_ms.push_back(pt * 1e3);
          plain_tps.push_back(double(B) / pt);
          speedup.push_back(tps.back() / plain_tps.back());
          accepted += double(st.accepted);
          emitted += double(st.emitted);
          steps += double(st.steps);
          done += 1;
        }
        SpeculativeCell c;
        c.executor = n;
        c.batch = B;
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
  }
  if (o.device == DeviceKind::kCpu) cpu::release_bandwidth_buffer();
  res.bandwidth_gbps = bw.empty() ? 0 : median(bw);
  return res;
}

}  // namespace md::bench
