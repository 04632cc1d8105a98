// Rank 0's steps run on every rank (exec/step_mirror.h). A message is a 16-byte header (magic,
// command, payload bytes), broadcast with broadcast_polled so that an idle follower sleeps, then
// the payload, broadcast plainly (every rank is awake by then).
#include "megadecode/exec/step_mirror.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <type_traits>

#include "megadecode/base/error.h"

namespace md {

namespace {

constexpr uint32_t kMagic = 0x6d645354;  // "mdST"
enum Command : uint32_t { kStep = 1, kCommit = 2, kStop = 3, kCopy = 4 };

struct Header {
  uint32_t magic = kMagic;
  uint32_t command = 0;
  uint64_t bytes = 0;
};
static_assert(sizeof(Header) == 16);

class Writer {
 public:
  explicit Writer(std::vector<uint8_t>& b) : b_(b) { b_.clear(); }
  template <class T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const size_t at = b_.size();
    b_.resize(at + sizeof(T));
    std::memcpy(b_.data() + at, &v, sizeof(T));
  }
  template <class T>
  void put_span(std::span<const T> v) {
    put(uint32_t(v.size()));
    const size_t at = b_.size();
    b_.resize(at + v.size_bytes());
    if (!v.empty()) std::memcpy(b_.data() + at, v.data(), v.size_bytes());
  }

 private:
  std::vector<uint8_t>& b_;
};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  template <class T>
  T get() {
    T v;
    need(sizeof(T));
    std::memcpy(&v, b_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  // An array (copied out: the message packs fields without alignment).
  template <class T>
  void get_array(std::vector<T>& out) {
    static_assert(std::is_trivially_copyable_v<T>);
    const uint32_t n = get<uint32_t>();
    need(size_t(n) * sizeof(T));
    out.resize(n);
    if (n) std::memcpy(out.data(), b_.data() + at_, size_t(n) * sizeof(T));
    at_ += size_t(n) * sizeof(T);
  }
  bool done() const { return at_ == b_.size(); }

 private:
  void need(size_t n) const {
    MD_CHECK(at_ + n <= b_.size(),
             "step mirror: a message from rank 0 is cut short ({} of {} bytes)", at_, b_.size());
  }
  std::span<const uint8_t> b_;
  size_t at_ = 0;
};

// Sampling rows travel field by field (their penalty pointer as the ids it points to).
void write_sampling(Writer& w, std::span<const SampleRow> rows) {
  w.put(uint32_t(rows.size()));
  for (const SampleRow& r : rows) {
    w.put(r.temperature);
    w.put(r.top_k);
    w.put(r.top_p);
    w.put(r.min_p);
    w.put(r.repetition_penalty);
    w.put(r.presence_penalty);
    w.put(r.frequency_penalty);
    w.put(r.uniform);
    w.put_span(std::span<const PenaltyCount>(r.penalties, r.penalties ? r.num_penalties : 0));
  }
}

}  // namespace

StepLeader::StepLeader(Executor& inner, dist::Communicator& comm) : inner_(inner), comm_(comm) {
  MD_CHECK(comm.rank() == 0, "step mirror: the leader is rank 0, not rank {}", comm.rank());
}

StepLeader::~StepLeader() {
  try {
    stop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megadecode: stopping the other ranks failed: %s\n", e.what());
  }
}

void StepLeader::send(uint32_t command, const std::vector<uint8_t>& payload) {
  MD_CHECK(!stopped_, "step mirror: the other ranks were stopped; no more steps can run");
  Header h;
  h.command = command;
  h.bytes = payload.size();
  comm_.broadcast_polled(&h, sizeof h, 0);
  if (!payload.empty()) comm_.broadcast(const_cast<uint8_t*>(payload.data()), payload.size(), 0);
  ++messages_;
}

void StepLeader::stop() {
  if (stopped_) return;
  send(kStop, {});
  stopped_ = true;
}

void StepLeader::run_step(std::span<const StepSeq> seqs, float* logits, int32_t* next_ids,
                          std::span<const SampleRow> sampling, const StepOptions& options) {
  // What cannot be put into a message is refused before anything is sent.
  for (const StepSeq& s : seqs)
    MD_CHECK(s.seq && s.seq->pool() == &inner_.states(),
             "step: a sequence that is not of this executor's state pool");
  Writer w(buf_);
  w.put_span(std::span<const int>(inner_.states().slots_in_use()));
  w.put(uint32_t(seqs.size()));
  for (const StepSeq& s : seqs) {
    w.put(int32_t(s.seq->slot()));
    w.put(int64_t(s.seq->pos));
    w.put(uint8_t(s.logits));
    w.put_span(s.tokens);
  }
  w.put(uint8_t(logits != nullptr));
  w.put(uint8_t(next_ids != nullptr));
  write_sampling(w, sampling);
  w.put(uint8_t(options.keep_for_commit));
  w.put_span(options.aux.layers);
  send(kStep, buf_);
  inner_.step(seqs, logits, next_ids, sampling, options);
}

void StepLeader::commit(SequenceState& seq, int k) {
  MD_CHECK(seq.pool() == &inner_.states(),
           "commit: a sequence that is not of this executor's state pool");
  Writer w(buf_);
  w.put(int32_t(seq.slot()));
  w.put(int32_t(k));
  send(kCommit, buf_);
  inner_.commit(seq, k);
}

void StepLeader::copy_sequence(SequenceState& dst, const SequenceState& src) {
  MD_CHECK(dst.pool() == &inner_.states() && src.pool() == &inner_.states(),
           "copy: a sequence that is not of this executor's state pool");
  Writer w(buf_);
  w.put_span(std::span<const int>(inner_.states().slots_in_use()));
  w.put(int32_t(dst.slot()));
  w.put(int32_t(src.slot()));
  w.put(int64_t(src.pos));
  send(kCopy, buf_);
  inner_.copy_sequence(dst, src);
}

namespace {

// A follower's copy of rank 0's sequences, by rank 0's slot.
class Follower {
 public:
  explicit Follower(Executor& ex) : ex_(ex) {}

  // Rank 0 let go of the slots not in the message's list: so do we (before the step or copy, so
  // the pools stay in step).
  void release(Reader& r) {
    r.get_array(live_);
    const std::vector<int>& live = live_;
    for (auto it = seqs_.begin(); it != seqs_.end();) {
      if (!std::binary_search(live.begin(), live.end(), it->first))
        it = seqs_.erase(it);
      else
        ++it;
    }
  }

  void copy(Reader& r) {
    release(r);
    const int32_t dst = r.get<int32_t>(), src = r.get<int32_t>();
    const int64_t pos = r.get<int64_t>();
    MD_CHECK(r.done(), "step mirror: a copy message has trailing bytes");
    auto it = seqs_.find(src);
    MD_CHECK(it != seqs_.end() && it->second.pos == pos,
             "step mirror: a copy from slot {} at position {}, which this rank does not hold", src,
             pos);
    SequenceState& d = seqs_[dst];
    if (!d.valid()) d = ex_.new_sequence();
    ex_.copy_sequence(d, it->second);
  }

  void step(Reader& r) {
    release(r);
    const uint32_t n = r.get<uint32_t>();
    MD_CHECK(n <= uint32_t(ex_.max_batch()), "step mirror: a step of {} sequences (max batch {})",
             n, ex_.max_batch());
    step_.clear();
    tokens_.resize(std::max(tokens_.size(), size_t(n)));
    for (uint32_t i = 0; i < n; ++i) {
      const int32_t slot = r.get<int32_t>();
      const int64_t pos = r.get<int64_t>();
      const uint8_t mode = r.get<uint8_t>();
      MD_CHECK(mode <= uint8_t(LogitRows::kAll), "step mirror: logit rows mode {}", mode);
      SequenceState& s = seqs_[slot];
      if (pos == 0 && (!s.valid() || s.pos != 0)) {
        s = SequenceState();  // its slot and pages back first: the pools hold the same
        s = ex_.new_sequence();
      }
      MD_CHECK(s.valid() && s.pos == pos,
               "step mirror: rank 0's sequence in slot {} is at position {}, this rank's at {}",
               slot, pos, s.valid() ? s.pos : -1);
      StepSeq q;
      q.seq = &s;
      q.logits = LogitRows(mode);
      r.get_array(tokens_[i]);
      q.tokens = tokens_[i];
      step_.push_back(q);
    }
    const bool want_logits = r.get<uint8_t>() != 0;
    const bool want_ids = r.get<uint8_t>() != 0;
    read_sampling(r);
    StepOptions so;
    so.keep_for_commit = r.get<uint8_t>() != 0;
    r.get_array(aux_layers_);
    MD_CHECK(r.done(), "step mirror: a step message has trailing bytes");

    // This rank's own outputs, dropped: the same kinds rank 0 asked for, so the step is the same.
    const int rows = logit_row_count(step_);
    int token_rows = 0;
    for (const StepSeq& q : step_) token_rows += int(q.tokens.size());
    const size_t V = size_t(ex_.model().config().vocab_size);
    float* logits = nullptr;
    if (want_logits || !want_ids) {
      logits_.resize(size_t(rows) * V);
      logits = logits_.data();
    }
    ids_.resize(size_t(std::max(rows, 1)));
    if (!aux_layers_.empty()) {
      aux_.resize(size_t(token_rows) * aux_layers_.size() *
                  size_t(ex_.model().config().hidden_size));
      so.aux = {aux_layers_, aux_.data()};
    }
    ex_.step(step_, logits, want_ids ? ids_.data() : nullptr, sampling_, so);
  }

  void commit(Reader& r) {
    const int32_t slot = r.get<int32_t>();
    const int32_t k = r.get<int32_t>();
    MD_CHECK(r.done(), "step mirror: a commit message has trailing bytes");
    auto it = seqs_.find(slot);
    MD_CHECK(it != seqs_.end(), "step mirror: a commit of slot {}, which this rank does not hold",
             slot);
    ex_.commit(it->second, k);
  }

 private:
  void read_sampling(Reader& r) {
    const uint32_t n = r.get<uint32_t>();
    MD_CHECK(n <= 4096, "step mirror: {} sampling rows", n);
    sampling_.assign(n, SampleRow{});
    penalties_.resize(n);
    for (uint32_t j = 0; j < n; ++j) {
      SampleRow& s = sampling_[j];
      s.temperature = r.get<float>();
      s.top_k = r.get<int32_t>();
      s.top_p = r.get<float>();
      s.min_p = r.get<float>();
      s.repetition_penalty = r.get<float>();
      s.presence_penalty = r.get<float>();
      s.frequency_penalty = r.get<float>();
      s.uniform = r.get<double>();
      r.get_array(penalties_[j]);
      s.penalties = penalties_[j].empty() ? nullptr : penalties_[j].data();
      s.num_penalties = uint32_t(penalties_[j].size());
    }
  }

  Executor& ex_;
  std::map<int32_t, SequenceState> seqs_;
  std::vector<StepSeq> step_;
  std::vector<SampleRow> sampling_;
  std::vector<std::vector<PenaltyCount>> penalties_;
  std::vector<int> live_, aux_layers_;
  std::vector<std::vector<int32_t>> tokens_;
  std::vector<float> logits_, aux_;
  std::vector<int32_t> ids_;
};

}  // namespace

int64_t follow_steps(Executor& ex, dist::Communicator& comm) {
  MD_CHECK(comm.rank() != 0, "step mirror: rank 0 leads; it does not follow");
  Follower f(ex);
  std::vector<uint8_t> payload;
  int64_t steps = 0;
  for (;;) {
    Header h{0, 0, 0};
    comm.broadcast_polled(&h, sizeof h, 0);
    MD_CHECK(h.magic == kMagic, "step mirror: a message from rank 0 without the header's magic");
    MD_CHECK(h.bytes <= (uint64_t(1) << 30), "step mirror: a {}-byte message", h.bytes);
    payload.resize(size_t(h.bytes));
    if (h.bytes > 0) comm.broadcast(payload.data(), size_t(h.bytes), 0);
    Reader r(payload);
    switch (h.command) {
      case kStop:
        return steps;
      case kCommit:
        f.commit(r);
        break;
      case kCopy:
        f.copy(r);
        break;
      case kStep:
        try {
          f.step(r);
          ++steps;
        } catch (const Error& e) {
          // The same input fails the same way on rank 0, which reports it; a desync or a broken
          // message is not that, and ends this rank.
          if (std::string_view(e.what()).find("step mirror:") != std::string_view::npos) throw;
          std::fprintf(stderr, "megadecode rank %d: a step failed (as on rank 0): %s\n",
                       comm.rank(), e.what());
        }
        break;
      default:
        fail("step mirror: unknown command {} from rank 0", h.command);
    }
  }
}

}  // namespace md
