#include "megadecode/server/metrics.h"

#include <fmt/format.h>

namespace md::server {

void Histogram::observe(double v) {
  std::lock_guard<std::mutex> lk(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++n_;
}

int64_t Histogram::count() const {
  std::lock_guard<std::mutex> lk(mu_);
  return n_;
}

std::string Histogram::render(const std::string& name, const std::string& help) const {
  std::lock_guard<std::mutex> lk(mu_);
  std::string out = fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  int64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cum);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, n_, name, sum_,
                     name, n_);
  return out;
}

namespace {
std::vector<double> latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
}
}  // namespace

Metrics::Metrics()
    : ttft(latency_buckets()),
      itl(latency_buckets()),
      batch({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64}),
      step_time({0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1}),
      step_rows({1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64}) {}

EngineObserver Metrics::observer() {
  EngineObserver o;
  o.time_to_first_token = [this](double s) { ttft.observe(s); };
  o.inter_token_latency = [this](double s) { itl.observe(s); };
  o.decode_batch = [this](int b) { batch.observe(b); };
  o.step = [this](double seconds, int rows) {
    step_time.observe(seconds);
    step_rows.observe(rows);
  };
  o.request_finished = [this](const std::string& reason) {
    std::lock_guard<std::mutex> lk(mu_);
    ++finished_[reason];
  };
  return o;
}

void Metrics::count_response(int status) {
  std::lock_guard<std::mutex> lk(mu_);
  ++responses_[status];
}

std::string Metrics::render(const EngineCounters& e) const {
  std::string out;
  auto gauge = [&](const char* name, const char* help, int64_t v, const char* type = "gauge") {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, v);
  };
  gauge("megadecode_requests_running", "sequences in decode slots", e.running.load());
  gauge("megadecode_requests_waiting", "sequences waiting for a slot", e.waiting.load());
  gauge("megadecode_prompt_tokens_total", "prompt tokens prefilled", e.prompt_tokens.load(),
        "counter");
  gauge("megadecode_generation_tokens_total", "tokens generated", e.generation_tokens.load(),
        "counter");
  gauge("megadecode_engine_steps_total", "executor steps run", e.steps.load(), "counter");
  // vLLM's prefix-cache counters (tokens): their ratio is the hit rate.
  gauge("megadecode_prefix_cache_queries_total", "prompt tokens looked up in the prefix cache",
        e.prefix_cache_queries.load(), "counter");
  gauge("megadecode_prefix_cache_hits_total", "prompt tokens restored from the prefix cache",
        e.prefix_cache_hits.load(), "counter");
  gauge("megadecode_prefix_cache_entries", "sequence states the prefix cache holds",
        e.prefix_cache_entries.load());
  gauge("megadecode_prefix_cache_bytes", "state-pool bytes the prefix cache holds",
        e.prefix_cache_bytes.load());
  if (e.speculative) {  // the names of vLLM's spec_decode counters
    gauge("megadecode_spec_decode_num_drafts_total",
          "speculative verifications (one per decoding sequence per verify step)",
          e.spec_drafts.load(), "counter");
    gauge("megadecode_spec_decode_num_draft_tokens_total", "draft tokens verified",
          e.spec_draft_tokens.load(), "counter");
    gauge("megadecode_spec_decode_num_accepted_tokens_total", "draft tokens accepted",
          e.spec_accepted_tokens.load(), "counter");
    out +=
        "# HELP megadecode_spec_decode_num_accepted_tokens_per_pos_total draft tokens accepted, "
        "by position in the draft (0: the first)\n"
        "# TYPE megadecode_spec_decode_num_accepted_tokens_per_pos_total counter\n";
    for (size_t k = 0; k < e.spec_accepted_at.size(); ++k)
      out += fmt::format(
          "megadecode_spec_decode_num_accepted_tokens_per_pos_total{{position=\"{}\"}} {}\n", k,
          e.spec_accepted_at[k].load());
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    out +=
        "# HELP megadecode_sequences_finished_total sequences finished, by reason\n"
        "# TYPE megadecode_sequences_finished_total counter\n";
    for (const auto& [reason, n] : finished_)
      out += fmt::format("megadecode_sequences_finished_total{{finish_reason=\"{}\"}} {}\n", reason,
                         n);
    out +=
        "# HELP megadecode_http_responses_total HTTP responses, by status\n"
        "# TYPE megadecode_http_responses_total counter\n";
    for (const auto& [status, n] : responses_)
      out += fmt::format("megadecode_http_responses_total{{status=\"{}\"}} {}\n", status, n);
  }
  out += ttft.render("megadecode_time_to_first_token_seconds",
                     "time from a request's arrival to its first generated token");
  out += itl.render("megadecode_inter_token_latency_seconds",
                    "time between consecutive tokens of a sequence");
  out += batch.render("megadecode_decode_batch_size", "decoding sequences per engine step");
  // Their sum against wall time is the share of the engine thread spent inside the executor.
  out += step_time.render("megadecode_engine_step_seconds", "wall time of each executor step");
  out += step_rows.render("megadecode_engine_step_rows",
                          "rows fed by each executor step (decode rows and prefill chunk rows)");
  return out;
}

}  // namespace md::server
