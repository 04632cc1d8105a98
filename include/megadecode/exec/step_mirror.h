// Steps decided on one rank and run on all (docs/distributed.md "Serving"): in a distributed run
// every rank's executor must run the same steps (their collectives meet inside the plan), but
// only rank 0 knows them when they come from outside, as a server's continuous batching does.
// StepLeader is rank 0's executor for such a caller: each step and commit is broadcast to the
// other ranks, which run it on their own executors in follow_steps, then it runs locally.
//
// What travels is the step's whole input: per sequence its slot in rank 0's pool, its position,
// tokens and logit rows; the sampling rows (penalty ids included); keep_for_commit and the aux
// layers; which outputs were asked for; and the slots rank 0 holds. A follower keeps one
// sequence per rank-0 slot: a slot rank 0 no longer holds is released before the step, a
// sequence at position 0 starts fresh (a new request in a reused slot), and a position that
// disagrees with the follower's is a desync (an md::Error that ends the follower, and the job
// with it). Since every rank validates the same input, a step that rank 0 refuses is refused
// everywhere before any collective, and the run goes on. Outputs (logits, tokens, aux rows) are
// rank 0's alone; followers compute and drop theirs.
//
// Copies between sequences (copy_sequence: the prefix cache's) travel the same way: the slots, and
// the slots rank 0 holds, so that a follower frees what rank 0 freed before it copies.
//
// Speculative decoding over a host drafter works as it is (steps with keep_for_commit, then
// commits); draft plans (runs_drafts) are not mirrored, so StepLeader reports none.
#pragma once
#include <cstdint>
#include <vector>

#include "megadecode/dist/communicator.h"
#include "megadecode/exec/executor.h"

namespace md {

class StepLeader final : public Executor {
 public:
  // inner: rank 0's executor of a sharded model; comm: the run's communicator (rank 0 of it).
  StepLeader(Executor& inner, dist::Communicator& comm);
  ~StepLeader() override;  // stop()

  // Ends the followers' loops (they return from follow_steps); later steps are an md::Error.
  void stop();

  void commit(SequenceState& seq, int k) override;
  void copy_sequence(SequenceState& dst, const SequenceState& src) override;
  StatePool& states() override { return inner_.states(); }
  const plan::Plan& plan(int batch, int rows = 1) override { return inner_.plan(batch, rows); }
  std::string_view name() const override { return inner_.name(); }
  const Model& model() const override { return inner_.model(); }
  int workers() const override { return inner_.workers(); }
  int max_batch() const override { return inner_.max_batch(); }
  const StepStats& last_step_stats() const override { return inner_.last_step_stats(); }
  void set_watchdog_seconds(double s) override { inner_.set_watchdog_seconds(s); }

  uint64_t messages_sent() const { return messages_; }

 protected:
  void run_step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids,
                std::span<const SampleRow> sampling, const StepOptions& options) override;

 private:
  void send(uint32_t command, const std::vector<uint8_t>& payload);
  Executor& inner_;
  dist::Communicator& comm_;
  bool stopped_ = false;
  uint64_t messages_ = 0;
  std::vector<uint8_t> buf_;
};

// A follower rank's loop: runs rank 0's steps and commits on `ex` (this rank's executor of the
// same sharded model) until rank 0's StepLeader stops. Returns the steps run. A step that fails
// with an md::Error is reported on stderr and the loop goes on (rank 0 fails it the same way);
// a desync or a broken message is an md::Error.
int64_t follow_steps(Executor& ex, dist::Communicator& comm);

}  // namespace md
