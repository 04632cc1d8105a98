// Plan validation, statistics (bytes per op and worker, critical path) and the text dump.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "megadecode/base/util.h"
#include "megadecode/plan/ops.h"
#include "megadecode/plan/plan.h"

namespace md::plan {

std::string_view weight_kind_name(WeightKind k) {
  static const char* names[] = {
      "embed",       "lm_head",     "final_norm",   "input_norm",  "post_attn_norm", "kda.q",
      "kda.k",       "kda.v",       "kda.f_a",      "kda.f_b",     "kda.b",          "kda.g_a",
      "kda.g_b",     "kda.o",       "kda.q_conv",   "kda.k_conv",  "kda.v_conv",     "kda.A_log",
      "kda.dt_bias", "kda.o_norm",  "mla.q",        "mla.kv_a",    "mla.kv_a_norm",  "mla.kv_b",
      "mla.o",       "dense.gate",  "dense.up",     "dense.down",  "router",         "router_bias",
      "shared.gate", "shared.up",   "shared.down",  "expert.gate", "expert.up",      "expert.down",
      "kda.g",       "mla.q_a",     "mla.q_a_norm", "mla.q_b",     "mla.g",          "latent_down",
      "latent_up",   "latent_norm", "attn_res",     "mlp_res",     "output_res",     "draft.fc",
      "draft.hidden_norm", "draft.q", "draft.k", "draft.v", "draft.o", "draft.q_norm",
      "draft.k_norm", "markov_w1", "markov_w2"};
  const size_t i = size_t(k);
  return i < std::size(names) ? names[i] : "?";
}

namespace {

std::string layer_str(uint16_t layer) {
  return layer == kNoLayer ? std::string("--") : fmt::format("L{}", layer);
}

// Whether a buffer-table entry may stand in an operand slot (plan/ops.h).
bool fits(const Plan& p, const BufferDesc& b, Slot s) {
  const bool weight = b.kind == BufKind::kWeight && b.count == 1;
  switch (s) {
    case Slot::kAct:
      return b.kind == BufKind::kArena;
    case Slot::kActOpt:
      return b.kind == BufKind::kArena || b.kind == BufKind::kNull;
    case Slot::kWeight:
      return weight;
    case Slot::kWeightOpt:
      return weight || b.kind == BufKind::kNull;
    case Slot::kWeightSet:
      return b.kind == BufKind::kWeight && int64_t(b.count) == p.cfg.num_experts;
    case Slot::kKdaState:
      return b.kind == BufKind::kState && b.sub == uint8_t(StateKind::kKdaState);
    case Slot::kConvCache:
      return b.kind == BufKind::kState && b.sub == uint8_t(StateKind::kConvCache);
    case Slot::kMlaCache:
      return b.kind == BufKind::kState && b.sub == uint8_t(StateKind::kMlaCache);
    case Slot::kDraftRing:
      return b.kind == BufKind::kState && b.sub == uint8_t(StateKind::kDraftRing);
    case Slot::kTokens:
      return b.kind == BufKind::kTokens;
    case Slot::kLogits:
      return b.kind == BufKind::kLogits;
    case Slot::kActOrLogits:
      return b.kind == BufKind::kArena || b.kind == BufKind::kLogits;
  }
  return false;
}

std::string counter_str(const Plan& p, uint32_t c) {
  if (c == kNone || c >= p.counters.size()) return "none";
  const CounterDesc& d = p.counters[c];
  return fmt::format("c{}({} {} g{})", c, op_name(d.op), layer_str(d.layer), d.group);
}

}  // namespace

std::string describe_instr(const Plan& p, const Instr& in) {
  std::string s = fmt::format("#{} {} {}", in.id, op_name(in.op), layer_str(in.layer));
  switch (in.op) {
    case Op::kMlaLatent:
      s += fmt::format(" seqs [{}, {})", in.r0, in.r1);
      break;
    case Op::kEmbed:
    case Op::kFfnNorm:
    case Op::kRouter:
    case Op::kLatentNorm:
    case Op::kCombine:
    case Op::kSample:
      if (in.r1 == in.r0 + 1)
        s += fmt::format(" {} {}", in.op == Op::kSample ? "logit row" : "token row", in.r0);
      else
        s += fmt::format(" {} [{}, {})", in.op == Op::kSample ? "logit rows" : "token rows", in.r0,
                         in.r1);
      break;
    case Op::kKdaCore:
    case Op::kMlaCore:
    case Op::kMlaMerge:
      s += fmt::format(" seq {} heads [{}, {})", in.seq, in.r0, in.r1);
      if (in.op == Op::kMlaCore && in.splits > 1)
        s += fmt::format(" kv split {}/{}", in.slot, in.splits);
      else if (in.op == Op::kMlaMerge)
        s += fmt::format(" of {} kv splits", in.splits);
      break;
    case Op::kExpertGateUp:
    case Op::kExpertDown:
      s += fmt::format(" slot {} rows [{}, {})", in.slot, in.r0, in.r1);
      break;
    case Op::kDraftCtxNorm:
      s += fmt::format(" context rows [{}, {})", in.r0, in.r1);
      break;
    case Op::kDraftCtxWrite:
      s += fmt::format(" seq {}", in.seq);
      break;
    case Op::kDraftAttn:
      s += fmt::format(" seq {} kv heads [{}, {})", in.seq, in.r0, in.r1);
      break;
    case Op::kDraftMarkov:
      s += fmt::format(" slot {} tile {} rows [{}, {})", in.slot, in.seq, in.r0, in.r1);
      break;
    case Op::kDraftPick:
      s += fmt::format(" slot {} seqs [{}, {})", in.slot, in.r0, in.r1);
      break;
    default:
      s += fmt::format(" rows [{}, {})", in.r0, in.r1);
      if (in.nargs > 0 && in.args < p.buffers.size()) {
        const BufferDesc& w = p.buffers[in.args];
        if (w.kind == BufKind::kWeight && w.offset < p.weights.size())
          s += fmt::format(" of {}", weight_kind_name(p.weights[w.offset].kind));
      }
      break;
  }
  for (const Wait& w : in.wait)
    if (w.counter != kNone) s += fmt::format(" wait {}>={}", counter_str(p, w.counter), w.target);
  if (in.signal != kNone) s += fmt::format(" signal {}", counter_str(p, in.signal));
  s += fmt::format(" args {}+{} ~{}", in.args, in.nargs, human_bytes(double(in.est_bytes)));
  return s;
}

namespace {

std::string operand_str(const Plan& p, const BufferDesc& b) {
  switch (b.kind) {
    case BufKind::kArena:
      return fmt::format("arena+{}", b.offset);
    case BufKind::kWeight:
      if (b.offset >= p.weights.size()) return "weight?";
      {
        const std::string layer = layer_str(p.weights[b.offset].layer);
        return fmt::format("{}{}{}{}", weight_kind_name(p.weights[b.offset].kind),
                           layer == "--" ? "" : "@", layer == "--" ? "" : layer,
                           b.count > 1 ? fmt::format("[{}]", b.count) : std::string());
      }
    case BufKind::kState:
      return fmt::format("state{}@{}", int(b.sub), layer_str(b.layer));
    case BufKind::kTokens:
      return "tokens";
    case BufKind::kLogits:
      return "logits";
    case BufKind::kNull:
      break;
  }
  return "-";
}

}  // namespace

std::string describe_operands(const Plan& p, const Instr& in) {
  std::string s;
  for (uint32_t k = 0; k < in.nargs && in.args + k < p.buffers.size(); ++k)
    s += fmt::format("{}{}={}", k ? " " : "", operand_name(in.op, k),
                     operand_str(p, p.buffers[in.args + k]));
  return s;
}

std::vector<std::string> validate_plan(const Plan& p) {
  std::vector<std::string> errs;
  auto err = [&](std::string m) {
    if (errs.size() < 50) errs.push_back(std::move(m));
  };
  const size_t n = p.instrs.size();
  // Signallers per counter, and the last one in global order.
  std::vector<uint32_t> signals(p.counters.size(), 0), last(p.counters.size(), 0);
  for (size_t i = 0; i < n; ++i) {
    const Instr& in = p.instrs[i];
    if (in.id != i) err(fmt::format("instruction {} has id {}", i, in.id));
    if (in.signal != kNone) {
      if (in.signal >= p.counters.size()) {
        err(fmt::format("{}: signal counter out of range", describe_instr(p, in)));
        continue;
      }
      ++signals[in.signal];
      last[in.signal] = uint32_t(i);
    }
  }
  for (size_t c = 0; c < p.counters.size(); ++c)
    if (signals[c] != p.counters[c].per_step)
      err(fmt::format("counter {}: per_step {} but {} signallers", counter_str(p, uint32_t(c)),
                      p.counters[c].per_step, signals[c]));
  for (size_t i = 0; i < n; ++i) {
    const Instr& in = p.instrs[i];
    for (const Wait& w : in.wait) {
      if (w.counter == kNone) continue;
      if (w.counter >= p.counters.size()) {
        err(fmt::format("{}: wait on a counter out of range", describe_instr(p, in)));
        continue;
      }
      if (w.target == 0 || w.target > signals[w.counter])
        err(fmt::format("{}: target {} unreachable ({} signallers)", describe_instr(p, in),
                        w.target, signals[w.counter]));
      if (signals[w.counter] > 0 && last[w.counter] >= i)
        err(fmt::format("{}: waits on {} whose producer #{} is not earlier in the global order",
                        describe_instr(p, in), counter_str(p, w.counter), last[w.counter]));
    }
    if (uint64_t(in.args) + in.nargs > p.buffers.size()) {
      err(fmt::format("{}: operands out of range", describe_instr(p, in)));
      continue;
    }
    // Operands against the op table: count, and what stands in each slot.
    const OpDesc& d = op_desc(in.op);
    const size_t fixed = d.operands.size();
    const bool mix = d.mix_tail && (in.flags & kFlagAttnRes);
    if (mix ? in.nargs < fixed + 2 : in.nargs != fixed) {
      err(fmt::format("{}: {} operands, the op takes {}{}", describe_instr(p, in), in.nargs, fixed,
                      mix ? " + a mix of at least one source" : ""));
      continue;
    }
    for (size_t k = 0; k < in.nargs; ++k) {
      const BufferDesc& b = p.buffers[in.args + k];
      const Slot want = k < fixed                          ? d.operands[k].slot
                        : k == fixed + arg::MixTail::res_w ? Slot::kWeight
                                                           : Slot::kAct;
      if (!fits(p, b, want))
        err(fmt::format("{}: operand {} ({}) is of the wrong kind", describe_instr(p, in), k,
                        operand_name(in.op, uint32_t(k))));
    }
    if (in.flags & ~(d.flags | kFlagTestStall))
      err(fmt::format("{}: flags {:#x} the op does not take", describe_instr(p, in), in.flags));
  }
  for (const BufferDesc& b : p.buffers) {
    // A decode plan's buffers hold a row per token row; a draft plan's have different row
    // counts (context rows, block rows, one per sequence), of which at least one must fit.
    const uint64_t rows = p.draft.on ? 1 : uint64_t(p.token_rows());
    if (b.kind == BufKind::kArena && b.offset + b.stride * rows > p.arena_bytes)
      err(fmt::format("arena buffer at {} exceeds the arena", b.offset));
    if (b.kind == BufKind::kArena && (b.offset % 64 || b.stride % 64))
      err(fmt::format("arena buffer at {} is not 64-byte aligned", b.offset));
    if (b.kind == BufKind::kWeight && b.offset + b.count > p.weights.size())
      err("weight operand out of range");
  }
  // The residual stream entering each layer (Plan::residual_buffer, the aux capture's rows): the
  // very buffer its producer writes.
  auto same_buffer = [](const BufferDesc& a, const BufferDesc& b) {
    return a.kind == b.kind && a.offset == b.offset && a.stride == b.stride && a.count == b.count;
  };
  if (p.draft.on) {
    // A draft plan has no aux capture: no residual-stream names.
    if (!p.residual_buffer.empty()) err("a draft plan names residual-stream buffers");
  } else if (p.residual_buffer.size() != size_t(p.cfg.num_layers)) {
    err(fmt::format("{} residual-stream buffers for {} layers", p.residual_buffer.size(),
                    p.cfg.num_layers));
  } else {
    for (size_t l = 0; l < p.residual_buffer.size(); ++l) {
      const uint32_t r = p.residual_buffer[l];
      if (r >= p.buffers.size() || p.buffers[r].kind != BufKind::kArena ||
          int64_t(p.buffers[r].count) != p.cfg.hidden_size) {
        err(fmt::format("layer {}: the residual-stream buffer is not an arena buffer of {} values",
                        l, p.cfg.hidden_size));
        continue;
      }
      const Op producer = l == 0 ? Op::kEmbed : Op::kCombine;
      const uint16_t layer = l == 0 ? kNoLayer : uint16_t(l - 1);
      const uint32_t slot = l == 0 ? uint32_t(arg::Embed::x0) : uint32_t(arg::Combine::x_next);
      int producers = 0;
      for (const Instr& in : p.instrs) {
        if (in.op != producer || in.layer != layer || in.nargs <= slot) continue;
        ++producers;
        if (!same_buffer(p.buffers[in.args + slot], p.buffers[r]))
          err(fmt::format("layer {}: the residual-stream buffer is not what {} writes", l,
                          describe_instr(p, in)));
      }
      if (producers == 0) err(fmt::format("layer {}: nothing writes the residual stream", l));
    }
  }
  // Queues: a partition of the program, each in increasing global order.
  std::vector<int> seen(n, 0);
  if (int(p.queues.size()) != p.workers || int(p.queue_ids.size()) != p.workers)
    err("queue count differs from the worker count");
  for (size_t w = 0; w < p.queue_ids.size(); ++w) {
    const auto& q = p.queue_ids[w];
    for (size_t j = 0; j < q.size(); ++j) {
      if (q[j] >= n) {
        err(fmt::format("queue {} names instruction {} out of range", w, q[j]));
        continue;
      }
      ++seen[q[j]];
      if (j > 0 && q[j] <= q[j - 1])
        err(fmt::format("queue {} is not in global order at position {}", w, j));
      if (w < p.queues.size() &&
          (j >= p.queues[w].size() || std::memcmp(&p.queues[w][j], &p.instrs[q[j]], 64) != 0))
        err(fmt::format("queue {} position {} differs from instruction {}", w, j, q[j]));
    }
  }
  for (size_t i = 0; i < n; ++i)
    if (seen[i] != 1) err(fmt::format("instruction {} is in {} queues", i, seen[i]));
  // Op-by-op phases: a partition too, and waits only on counters finished in earlier phases.
  std::vector<int> phase_of(n, -1), seen2(n, 0);
  for (size_t ph = 0; ph < p.phase_instrs.size(); ++ph)
    for (const auto& share : p.phase_instrs[ph])
      for (uint32_t i : share)
        if (i < n) {
          phase_of[i] = int(ph);
          ++seen2[i];
        }
  std::vector<int> ctr_phase(p.counters.size(), -1);
  for (size_t i = 0; i < n; ++i) {
    if (seen2[i] != 1) err(fmt::format("instruction {} is in {} phase shares", i, seen2[i]));
    const uint32_t c = p.instrs[i].signal;
    if (c != kNone && c < p.counters.size()) ctr_phase[c] = std::max(ctr_phase[c], phase_of[i]);
  }
  for (size_t i = 0; i < n; ++i)
    for (const Wait& w : p.instrs[i].wait)
      if (w.counter != kNone && w.counter < p.counters.size() &&
          ctr_phase[w.counter] >= phase_of[i])
        err(fmt::format("{}: op-by-op phase {} waits on a counter finished in phase {}",
                        describe_instr(p, p.instrs[i]), phase_of[i], ctr_phase[w.counter]));
  return errs;
}

PlanStats plan_stats(const Plan& p) {
  PlanStats s;
  s.instrs_per_op.assign(kNumOps, 0);
  s.bytes_per_op.assign(kNumOps, 0.0);
  for (const Instr& in : p.instrs) {
    ++s.instrs_per_op[size_t(in.op)];
    s.bytes_per_op[size_t(in.op)] += in.est_bytes;
    s.total_bytes += in.est_bytes;
  }
  for (const auto& q : p.queue_ids) {
    double b = 0;
    for (uint32_t i : q) b += p.instrs[i].est_bytes;
    s.bytes_per_worker.push_back(b);
    s.instrs_per_worker.push_back(int(q.size()));
  }
  // Critical path: longest chain through the wait edges (a waiter depends on every signaller of
  // the counter it waits for), weighted by estimated bytes.
  const size_t n = p.instrs.size();
  std::vector<double> cp(n, 0.0);
  std::vector<uint32_t> pred(n, kNone);
  std::vector<double> ctr_best(p.counters.size(), 0.0);
  std::vector<uint32_t> ctr_arg(p.counters.size(), kNone);
  for (size_t i = 0; i < n; ++i) {
    const Instr& in = p.instrs[i];
    double base = 0;
    for (const Wait& w : in.wait)
      if (w.counter != kNone && ctr_arg[w.counter] != kNone && ctr_best[w.counter] > base) {
        base = ctr_best[w.counter];
        pred[i] = ctr_arg[w.counter];
      }
    cp[i] = base + in.est_bytes;
    if (in.signal != kNone && (ctr_arg[in.signal] == kNone || cp[i] > ctr_best[in.signal])) {
      ctr_best[in.signal] = cp[i];
      ctr_arg[in.signal] = uint32_t(i);
    }
  }
  if (n > 0) {
    uint32_t end = uint32_t(std::max_element(cp.begin(), cp.end()) - cp.begin());
    s.critical_path_bytes = cp[end];
    for (uint32_t i = end; i != kNone; i = pred[i]) s.critical_path.push_back(i);
    std::reverse(s.critical_path.begin(), s.critical_path.end());
  }
  // Re-run the scheduler's cost model on the queues as built.
  const double sync = double(p.options.sync_cost_bytes);
  std::vector<double> done(p.counters.size(), 0.0);
  std::vector<int> ctr_owner(p.counters.size(), -1);
  std::vector<double> free_at(p.queue_ids.size(), 0.0);
  // Process in global order: every waiter's producers are earlier, so their finish is known.
  std::vector<int> owner(n, 0);
  for (size_t w = 0; w < p.queue_ids.size(); ++w)
    for (uint32_t i : p.queue_ids[w]) owner[i] = int(w);
  for (size_t i = 0; i < n; ++i) {
    const Instr& in = p.instrs[i];
    double ready = 0;
    for (const Wait& w : in.wait)
      if (w.counter != kNone)
        ready = std::max(ready, done[w.counter] + (ctr_owner[w.counter] == owner[i] ? 0.0 : sync));
    double& f = free_at[size_t(owner[i])];
    f = std::max(f, ready) + tile_cost(in, p.options);
    if (in.signal != kNone) {
      done[in.signal] = std::max(done[in.signal], f);
      int& o = ctr_owner[in.signal];
      o = o == -1 || o == owner[i] ? owner[i] : -2;
    }
    s.est_makespan = std::max(s.est_makespan, f);
  }
  double total_cost = 0;
  for (const Instr& in : p.instrs) total_cost += tile_cost(in, p.options);
  s.est_ideal = total_cost / std::max(p.workers, 1);
  return s;
}

std::string describe_plan(const Plan& p, bool dump) {
  const PlanStats s = plan_stats(p);
  const ModelConfig& c = p.cfg;
  std::string o;
  o += fmt::format(
      "decode plan: batch {} x {} token rows, {} workers; {} layers ({} KDA, {} MLA); {} "
      "instructions (64 B each), {} stages, {} op-by-op barrier phases, {} counters, {} "
      "buffer-table entries, {} weight-table entries, arena {}; megakernel queues: {}\n",
      p.batch, p.rows, p.workers, c.num_layers, c.num_kda_layers(), c.num_mla_layers(),
      p.instrs.size(), p.stages.size(), p.phases.size(), p.counters.size(), p.buffers.size(),
      p.weights.size(), human_bytes(double(p.arena_bytes)),
      p.options.scheduler == Scheduler::kList ? "list schedule" : "op-by-op phase shares");
  o += fmt::format("\n{:<16} {:>8} {:>12} {:>7}\n", "op", "instrs", "bytes", "share");
  for (int op = 0; op < kNumOps; ++op) {
    if (!s.instrs_per_op[size_t(op)]) continue;
    o += fmt::format("{:<16} {:>8} {:>12} {:>6.1f}%\n", op_name(Op(op)),
                     s.instrs_per_op[size_t(op)], human_bytes(s.bytes_per_op[size_t(op)]),
                     100.0 * s.bytes_per_op[size_t(op)] / std::max(s.total_bytes, 1.0));
  }
  o += fmt::format("{:<16} {:>8} {:>12}\n", "total", p.instrs.size(), human_bytes(s.total_bytes));
  o += "(expert slots are counted as full experts; at run time a slot beyond the batch's "
       "distinct experts is empty)\n";
  o += fmt::format("\n{:<8} {:>8} {:>12} {:>7}\n", "worker", "instrs", "bytes", "share");
  for (size_t w = 0; w < s.bytes_per_worker.size(); ++w)
    o += fmt::format("{:<8} {:>8} {:>12} {:>6.1f}%\n", w, s.instrs_per_worker[w],
                     human_bytes(s.bytes_per_worker[w]),
                     100.0 * s.bytes_per_worker[w] / std::max(s.total_bytes, 1.0));
  o += fmt::format(
      "\ncritical path: {} instructions, {} ({:.1f}% of the step's bytes; one worker's fair share "
      "is {:.1f}%)\n",
      s.critical_path.size(), human_bytes(s.critical_path_bytes),
      100.0 * s.critical_path_bytes / std::max(s.total_bytes, 1.0), 100.0 / p.workers);
  // The path compressed into runs of one op and layer.
  std::string path;
  for (size_t j = 0; j < s.critical_path.size();) {
    const Instr& a = p.instrs[s.critical_path[j]];
    size_t k = j;
    double bytes = 0;
    while (k < s.critical_path.size() && p.instrs[s.critical_path[k]].op == a.op &&
           p.instrs[s.critical_path[k]].layer == a.layer)
      bytes += p.instrs[s.critical_path[k++]].est_bytes;
    path += fmt::format("{}{} {}{} ({})", path.empty() ? "  " : " -> ", op_name(a.op),
                        layer_str(a.layer), k - j > 1 ? fmt::format(" x{}", k - j) : "",
                        human_bytes(bytes));
    j = k;
  }
  // Wrap the path at ~100 columns.
  std::string wrapped, line;
  for (size_t i = 0; i < path.size();) {
    size_t nxt = path.find(" -> ", i + 1);
    std::string piece = path.substr(i, nxt == std::string::npos ? std::string::npos : nxt - i);
    if (line.size() + piece.size() > 100) {
      wrapped += line + "\n";
      line = "  ";
      if (piece.rfind(" -> ", 0) == 0) piece = "-> " + piece.substr(4);
    }
    line += piece;
    i = nxt == std::string::npos ? path.size() : nxt;
  }
  o += wrapped + line + "\n";
  o += fmt::format(
      "scheduler estimate (bytes + {} per instruction + {} per cross-worker wait): makespan {} vs "
      "ideal {} ({:.1f}%)\n",
      human_bytes(double(p.options.instr_overhead_bytes)),
      human_bytes(double(p.options.sync_cost_bytes)), human_bytes(s.est_makespan),
      human_bytes(s.est_ideal), 100.0 * s.est_ideal / std::max(s.est_makespan, 1.0));
  if (dump) {
    for (size_t w = 0; w < p.queues.size(); ++w) {
      o += fmt::format("\n== queue {} ({} instructions)\n", w, p.queues[w].size());
      for (const Instr& in : p.queues[w])
        o += describe_instr(p, in) + "\n      " + describe_operands(p, in) + "\n";
    }
    o += "\n== op-by-op phases\n";
    for (size_t ph = 0; ph < p.phases.size(); ++ph) {
      o += fmt::format("phase {}:", ph);
      for (uint32_t st = p.phases[ph].first; st < p.phases[ph].second; ++st)
        o += fmt::format(" {} {}", op_name(p.stages[st].op), layer_str(p.stages[st].layer));
      for (size_t w = 0; w < p.phase_instrs[ph].size(); ++w)
        o += fmt::format(" | w{}: {}", w, p.phase_instrs[ph][w].size());
      o += "\n";
    }
  }
  return o;
}

}  // namespace md::plan
