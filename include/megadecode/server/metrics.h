// Prometheus metrics of the server: counters, gauges and fixed-bucket histograms, rendered in the
// text exposition format for GET /metrics.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "megadecode/server/engine_loop.h"

namespace md::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds)
      : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  // The metric's lines (_bucket with cumulative counts, _sum, _count).
  std::string render(const std::string& name, const std::string& help) const;
  int64_t count() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket (not cumulative); the last is +Inf
  double sum_ = 0;
  int64_t n_ = 0;
};

class Metrics {
 public:
  Metrics();
  // An observer feeding the latency histograms (for EngineLoop).
  EngineObserver observer();
  void count_response(int status);  // HTTP responses by status
  std::string render(const EngineCounters& engine) const;

  Histogram ttft, itl, batch, step_time, step_rows;

 private:
  mutable std::mutex mu_;
  std::map<int, int64_t> responses_;
  std::map<std::string, int64_t> finished_;
};

}  // namespace md::server
