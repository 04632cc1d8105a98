// Helpers shared by the executor tests: reference-path options and bitwise comparisons of logits
// and sequence states.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "megadecode/engine/model.h"
#include "megadecode/exec/executor.h"
#include "megadecode/spec/speculative.h"

namespace md::test {

// The reference runs on one thread: its results do not depend on the thread count
// (ModelTest.ThreadCountDoesNotChangeBits), and a single thread keeps it fast on a loaded machine.
inline ModelOptions opts(Precision p) {
  ModelOptions o;
  o.precision = p;
  o.threads = 1;
  o.pin_threads = false;
  return o;
}

inline bool same_bits(const float* a, const float* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(float)) == 0;  // (empty: data() may be null)
}

inline void expect_same_bits(const float* a, const float* b, size_t n, const std::string& what) {
  if (same_bits(a, b, n)) return;
  size_t i = 0;
  while (i < n && std::memcmp(a + i, b + i, sizeof(float)) == 0) ++i;
  ADD_FAILURE() << what << ": first difference at " << i << ": " << a[i] << " vs " << b[i];
}

// Position, KDA states, conv caches and MLA caches (rows [0, pos), in the pools' storage type),
// bit for bit; the two states may live in different pools.
inline void expect_same_state(const SequenceState& a, const SequenceState& b,
                              const std::string& what) {
  ASSERT_TRUE(a.valid() && b.valid()) << what;
  EXPECT_EQ(a.pos, b.pos) << what;
  const ModelConfig& c = a.pool()->config();
  ASSERT_EQ(a.pool()->cache_bf16(), b.pool()->cache_bf16()) << what;
  const size_t state = size_t(c.kda_num_heads) * size_t(c.kda_head_dim) * size_t(c.kda_head_dim);
  const size_t conv = size_t(3) * size_t(c.kda_conv_size - 1) * size_t(c.kda_dim());
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string at = what + " state, layer " + std::to_string(l);
    if (c.attn_kind[size_t(l)] == AttnKind::KDA) {
      expect_same_bits(a.kda_state(l), b.kda_state(l), state, at + " (KDA state)");
      expect_same_bits(a.conv_cache(l), b.conv_cache(l), conv, at + " (conv cache)");
      continue;
    }
    const cpu::LatentCache x = a.latent(l), y = b.latent(l);
    const size_t row = size_t(c.mla_cache_width()) * x.elem_bytes();
    for (int64_t t = 0; t < std::min(a.pos, b.pos); ++t)
      if (std::memcmp(x.row(t), y.row(t), row) != 0) {
        ADD_FAILURE() << at << ": latent row " << t << " differs";
        break;
      }
  }
}

// A copy of `from` in the executor's state pool (what it steps).
inline SequenceState copy_of(md::Executor& ex, const SequenceState& from) {
  SequenceState s = ex.new_sequence();
  s.copy_from(from);
  return s;
}
inline std::vector<SequenceState> copies(md::Executor& ex, const std::vector<SequenceState>& from) {
  std::vector<SequenceState> out;
  for (const SequenceState& s : from) out.push_back(copy_of(ex, s));
  return out;
}

// One step of two executors in lockstep (executors.cpp's tests): the sequences named by ids
// (indices into a and b), fed token_of(id, step); both return logits and greedy ids.
struct LockstepStep {
  size_t step;
  const std::vector<int>& ids;
  std::vector<int32_t> tokens;
  std::vector<float> la, lb;    // [ids.size()][V]
  std::vector<int32_t> na, nb;  // the plans' next ids
};
// Steps ea over a and eb over b through `batches` (each a list of sequence indices), then calls
// check(const LockstepStep&) after each step.
template <class TokenOf, class Check>
void step_in_lockstep(md::Executor& ea, md::Executor& eb, std::vector<SequenceState>& a,
                      std::vector<SequenceState>& b, const std::vector<std::vector<int>>& batches,
                      int64_t V, TokenOf token_of, Check check) {
  for (size_t step = 0; step < batches.size(); ++step) {
    LockstepStep t{step, batches[step], {}, {}, {}, {}, {}};
    const size_t B = t.ids.size();
    std::vector<SequenceState*> pa, pb;
    for (int id : t.ids) {
      t.tokens.push_back(token_of(id, int(step)));
      pa.push_back(&a[size_t(id)]);
      pb.push_back(&b[size_t(id)]);
    }
    t.la.resize(B * size_t(V));
    t.lb.resize(B * size_t(V));
    t.na.assign(B, -1);
    t.nb.assign(B, -1);
    ea.step(pa, t.tokens, t.la.data(), t.na.data());
    eb.step(pb, t.tokens, t.lb.data(), t.nb.data());
    check(t);
  }
}

// Batched speculative steps (SpeculativeDecoder::step_batch) of sequences side by side, each
// with its drafter, until every got[b] holds n tokens (got[b] starts with the token after the
// prompt, hist[b] is the prompt and that token) or max_steps steps have run.
inline void speculate_batch(SpeculativeDecoder& dec, std::vector<SequenceState>& seqs,
                            std::vector<std::vector<int32_t>>& hist,
                            std::vector<std::vector<int32_t>>& got,
                            const std::vector<Drafter*>& drafters, int n, int max_steps) {
  for (int step = 0; step < max_steps; ++step) {
    std::vector<SpecSeq> qs;
    for (size_t b = 0; b < seqs.size(); ++b) {
      if (int(got[b].size()) >= n) continue;
      SpecSeq q;
      q.seq = &seqs[b];
      q.history = &hist[b];
      q.drafter = drafters[b];
      q.emit = [&got, b, n](int32_t t, std::span<const float>) {
        got[b].push_back(t);
        return int(got[b].size()) < n;
      };
      qs.push_back(std::move(q));
    }
    if (qs.empty()) return;
    dec.step_batch(qs);
  }
}

}  // namespace md::test
