// Decode speed per batch size and executor against the read bandwidth measured in the same run
// (bench.h). Executors are interleaved (A B A B ...) repetition by repetition, with a bandwidth
// sample before each repetition.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <thread>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/bench/bench.h"
#include "megadecode/dist/communicator.h"
#include "megadecode/exec/executor.h"
#include "megadecode/exec/cuda_executor.h"
#include "megadecode/kernels/cpu/bandwidth.h"
#include "megadecode/kernels/cpu/kda.h"
#include "megadecode/kernels/cpu/matmul.h"

namespace md::bench {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Machine this_machine() {
  Machine m;
  m.cpu_model = "unknown";
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const auto p = line.find(':');
      m.cpu_model = p == std::string::npos ? line : line.substr(p + 2);
      break;
    }
  m.cores = online_cpus();
  m.matmul_isa = cpu::matmul_isa();
  m.kda_isa = cpu::kda_isa();
  return m;
}

namespace {

double current_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  double pages_total = 0, pages_resident = 0;
  f >> pages_total >> pages_resident;
  return pages_resident * double(sysconf(_SC_PAGESIZE));
}

int64_t argmax(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

// One executor under test: a plan executor, or the reference path one sequence at a time.
struct Runner {
  std::string name;
  std::unique_ptr<Executor> ex;  // null: reference
  std::vector<double> run_s, wait_s;  // DecodeOptions::profile: per op, this timed block
};

}  // namespace

DecodeResult run_decode(Model& m, const DecodeOptions& o) {
  MD_CHECK(!o.batches.empty() && !o.executors.empty(), "bench: no batch sizes or executors");
  MD_CHECK(o.steps >= 1 && o.reps >= 1 && o.context >= 1, "bench: steps, reps, context >= 1");
  const ModelConfig& cfg = m.config();
  const int64_t V = cfg.vocab_size;
  DecodeResult res;
  const int asked_workers = o.workers > 0 ? o.workers : default_workers(m, o.device);
  res.workers = asked_workers;
  res.reference_threads = m.pool().size();
  const int maxb = *std::max_element(o.batches.begin(), o.batches.end());
  // A distributed rank runs plan executors only; the ranks start every timed block together.
  dist::Communicator* comm = m.communicator();
  for (const std::string& n : o.executors)
    MD_CHECK(n != "reference" || !m.shard().sharded(),
             "bench: the reference path runs whole models only; with --tp/--ep give "
             "--executor megakernel,opbyop");
  std::vector<Runner> runners;
  for (const std::string& n : o.executors) {
    Runner r;
    r.name = n;
    if (n != "reference") {
      ExecutorOptions eo;
      eo.workers = asked_workers;
      eo.states = m.options().states;
      eo.device = o.device;
      eo.profile = o.profile;
      r.ex = make_executor(m, parse_executor_kind(n), maxb, eo);
    }
    if (r.ex) res.workers = r.ex->workers();  // a CUDA executor's: the blocks it runs
    if (auto* cx = dynamic_cast<CudaExecutor*>(r.ex.get())) res.device = cx->device_name();
    runners.push_back(std::move(r));
  }
  const size_t E = runners.size();
  struct Acc {
    std::vector<double> ms, comm_ms, comm_calls;
    double bytes = 0;
    int n = 0;
    std::vector<double> run_s, wait_s;  // per op, summed over the timed steps
  };
  std::map<std::pair<int, size_t>, Acc> acc;
  res.peak_rss_bytes = current_rss_bytes();
  const double total = double(o.batches.size()) * o.reps * double(E);
  double done = 0;
  auto report = [&](const std::string& what) {
    if (o.progress) o.progress(done / total, what);
  };
  Rng rng(7);
  int moe_layers = 0;
  for (FfnKind k : cfg.ffn_kind) moe_layers += k == FfnKind::MoE;
  // The prefill runs on the reference path, or, when the weights exist only on a device, through
  // the first plan executor (its state pool then holds the snapshots).
  Executor* prefiller = nullptr;
  if (!m.weights_on_host() || m.shard().sharded())
    for (Runner& r : runners)
      if (!prefiller && r.ex) prefiller = r.ex.get();
  for (int B : o.batches) {
    // B sequences prefilled with `context` random tokens; decode continues greedily.
    std::vector<SequenceState> seqs;
    std::vector<int32_t> tokens(static_cast<size_t>(B));
    std::vector<float> logits(size_t(B) * size_t(V));
    std::vector<int32_t> next(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) {
      report(fmt::format("batch {}: prefill {}/{}", B, b + 1, B));
      SequenceState s = prefiller ? prefiller->new_sequence() : m.new_sequence();
      std::vector<int32_t> prompt(static_cast<size_t>(o.context));
      for (auto& id : prompt) id = int32_t(rng.next() % uint64_t(std::max<int64_t>(V - 256, 1)));
      if (prefiller)
        prefiller->prefill(s, prompt, logits.data());
      else
        m.forward(s, prompt, logits.data(), false);
      tokens[size_t(b)] = int32_t(argmax(logits.data(), V));
      seqs.push_back(std::move(s));
    }
    // Every timed block starts from this snapshot, so each executor and repetition decodes the
    // same tokens at the same positions (context .. context + steps). Each runner decodes its
    // own copies, in its own state pool (the reference path's: the model's).
    const std::vector<SequenceState> snapshot = std::move(seqs);
    const std::vector<int32_t> first_tokens = tokens;
    std::vector<std::vector<SequenceState>> work(E);
    for (size_t e = 0; e < E; ++e)
      for (int b = 0; b < B; ++b)
        work[e].push_back(runners[e].ex ? runners[e].ex->new_sequence() : m.new_sequence());
    std::vector<SequenceState*> ptrs;
    auto restore = [&](size_t e) {
      ptrs.clear();
      for (size_t b = 0; b < snapshot.size(); ++b) {
        work[e][b].copy_from(snapshot[b]);
        ptrs.push_back(&work[e][b]);
      }
      tokens = first_tokens;
    };
    // One step of a runner (timed part only: the argmax that picks the next tokens is not).
    auto step = [&](Runner& r, double* seconds, double* bytes) {
      std::vector<int64_t> pos;
      for (auto* s : ptrs) pos.push_back(s->pos);
      const double t0 = now_seconds();
      // A CUDA executor draws the greedy tokens on the device and returns only them, as a serving
      // engine on a GPU does (the logits would cross PCIe each step: 5 MB at batch 8 on kl48);
      // CPU executors return the logits in host memory, and the argmax is not timed.
      const bool ids_only = r.ex && o.device != DeviceKind::kCpu;
      if (ids_only) {
        r.ex->step(ptrs, tokens, nullptr, next.data());
      } else if (r.ex) {
        r.ex->step(ptrs, tokens, logits.data());
      } else {
        for (int b = 0; b < B; ++b)
          m.forward(*ptrs[size_t(b)], std::span(&tokens[size_t(b)], 1),
                    logits.data() + size_t(b) * size_t(V), false);
      }
      if (seconds) *seconds += now_seconds() - t0;
      if (seconds && r.ex && o.profile) {
        const StepStats& st = r.ex->last_step_stats();
        r.run_s.resize(plan::kNumOps);
        r.wait_s.resize(plan::kNumOps);
        for (int k = 0; k < plan::kNumOps; ++k) {
          r.run_s[size_t(k)] += st.run_by_op[size_t(k)];
          r.wait_s[size_t(k)] += st.wait_by_op[size_t(k)];
        }
      }
      if (bytes) {
        if (r.ex) {
          *bytes += r.ex->last_step_stats().total();
        } else {  // one forward per sequence: each reads every weight it uses
          for (int64_t p : pos)
            *bytes += decode_step_bytes(m, std::span(&p, 1), cfg.num_experts_per_token * moe_layers)
                          .total();
        }
      }
      for (int b = 0; b < B; ++b)
        tokens[size_t(b)] =
            ids_only ? next[size_t(b)] : int32_t(argmax(logits.data() + size_t(b) * size_t(V), V));
    };
    for (size_t e = 0; e < E; ++e) {  // warm-up: plans compiled, weights and caches touched
      restore(e);
      for (int i = 0; i < 2; ++i) step(runners[e], nullptr, nullptr);
    }
    for (int rep = 0; rep < o.reps; ++rep) {
      report(fmt::format("batch {}: read bandwidth", B));
      // The floor is the executors' memory: the CPU's, or the device's (a copy kernel there).
      CudaExecutor* cx = nullptr;
      for (Runner& r : runners)
        if (!cx && r.ex) cx = dynamic_cast<CudaExecutor*>(r.ex.get());
      res.bandwidth_samples_gbps.push_back(
          cx ? cx->measure_read_bandwidth_gbps(size_t(1) << (o.device == DeviceKind::kCuda ? 32 : 28))
             : cpu::measure_read_bandwidth_gbps(m.pool(), size_t(1) << 29, 1));
      for (size_t e = 0; e < E; ++e) {
        Runner& r = runners[e];
        report(fmt::format("batch {}: {} rep {}/{}", B, r.name, rep + 1, o.reps));
        // Let the previous runner's idle threads stop spinning, then one untimed step (on a
        // scratch copy) to wake this runner's threads.
        restore(e);
        std::this_thread::sleep_for(std::chrono::milliseconds(3));
        step(r, nullptr, nullptr);
        restore(e);
        if (comm) comm->barrier();
        const dist::Communicator::Counters c0 = comm ? comm->counters() : dist::Communicator::Counters{};
        double secs = 0, bytes = 0;
        r.run_s.assign(r.run_s.size(), 0.0);
        r.wait_s.assign(r.wait_s.size(), 0.0);
        for (int i = 0; i < o.steps; ++i) step(r, &secs, &bytes);
        Acc& pa = acc[{B, e}];
        pa.run_s.resize(r.run_s.size());
        pa.wait_s.resize(r.wait_s.size());
        for (size_t k = 0; k < r.run_s.size(); ++k) {
          pa.run_s[k] += r.run_s[k];
          pa.wait_s[k] += r.wait_s[k];
        }
        for (auto* s : ptrs) res.max_pos = std::max(res.max_pos, s->pos);
        Acc& a = acc[{B, e}];
        a.ms.push_back(secs / o.steps * 1e3);
        if (comm) {
          const dist::Communicator::Counters& c1 = comm->counters();
          a.comm_ms.push_back((c1.seconds - c0.seconds) / o.steps * 1e3);
          a.comm_calls.push_back(double(c1.calls - c0.calls) / o.steps);
        }
        a.bytes += bytes;
        a.n += o.steps;
        done += 1;
      }
      res.peak_rss_bytes = std::max(res.peak_rss_bytes, current_rss_bytes());
    }
  }
  cpu::release_bandwidth_buffer();
  res.bandwidth_gbps = median(res.bandwidth_samples_gbps);
  for (int B : o.batches) {
    size_t mk = E, ob = E;
    for (size_t e = 0; e < E; ++e) {
      const Acc& a = acc[{B, e}];
      DecodeCell c;
      c.batch = B;
      c.executor = runners[e].name;
      c.ms_reps = a.ms;
      c.ms = median(a.ms);
      c.bytes = a.bytes / std::max(a.n, 1);
      c.gbps = c.bytes / (c.ms * 1e-3) / 1e9;
      c.tokens_per_s = B * 1e3 / c.ms;
      c.pct_of_bandwidth = 100.0 * c.gbps / res.bandwidth_gbps;
      c.collective_ms = median(a.comm_ms);
      c.collective_calls = median(a.comm_calls);
      for (size_t k = 0; k < a.run_s.size(); ++k) {
        c.run_ms_by_op.push_back(a.run_s[k] * 1e3 / std::max(a.n, 1));
        c.wait_ms_by_op.push_back(a.wait_s[k] * 1e3 / std::max(a.n, 1));
      }
      res.cells.push_back(c);
      if (c.executor == "megakernel") mk = e;
      if (c.executor == "opbyop") ob = e;
    }
    if (mk < E && ob < E) {
      std::vector<double> r;
      const auto& a = acc[{B, mk}].ms;
      const auto& b = acc[{B, ob}].ms;
      for (size_t i = 0; i < a.size() && i < b.size(); ++i) r.push_back(b[i] / a[i]);
      res.megakernel_over_opbyop[B] = median(r);
    }
  }
  return res;
}

}  // namespace md::bench
