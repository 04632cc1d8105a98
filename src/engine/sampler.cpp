#include "megadecode/engine/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "megadecode/base/error.h"

namespace md {

namespace {

bool finite(float v) {
  return std::isfinite(v);
}

// Candidate order: higher logit first, ties to the lower id, so every selection path (heap,
// nth_element, buckets) keeps the same tokens as a full stable sort would.
struct Better {
  template <typename C>
  bool operator()(const C& a, const C& b) const {
    return a.x > b.x || (a.x == b.x && a.id < b.id);
  }
};

// Below this top-k a bounded heap (O(V log k), no full candidate array) beats nth_element.
constexpr int kHeapTopK = 1024;
// Top-p buckets: weights are in [0, 1], so the float's top bits (sign 0, exponent, 5 mantissa
// bits) index at most 0x3F800000 >> 18 = 4064 buckets.
constexpr uint32_t kBucketShift = 18;
constexpr uint32_t kBuckets = (0x3F800000u >> kBucketShift) + 1;

}  // namespace

void SamplingParams::validate() const {
  MD_CHECK(finite(temperature) && temperature >= 0.0f,
           "invalid sampling parameter temperature={}: must be a finite number >= 0", temperature);
  MD_CHECK(top_k >= 0, "invalid sampling parameter top_k={}: must be >= 0 (0 = off)", top_k);
  MD_CHECK(finite(top_p) && top_p > 0.0f && top_p <= 1.0f,
           "invalid sampling parameter top_p={}: must be in (0, 1]", top_p);
  MD_CHECK(finite(min_p) && min_p >= 0.0f && min_p <= 1.0f,
           "invalid sampling parameter min_p={}: must be in [0, 1]", min_p);
  MD_CHECK(finite(repetition_penalty) && repetition_penalty > 0.0f,
           "invalid sampling parameter repetition_penalty={}: must be a finite number > 0",
           repetition_penalty);
  MD_CHECK(finite(presence_penalty) && presence_penalty >= -2.0f && presence_penalty <= 2.0f,
           "invalid sampling parameter presence_penalty={}: must be in [-2, 2]", presence_penalty);
  MD_CHECK(finite(frequency_penalty) && frequency_penalty >= -2.0f && frequency_penalty <= 2.0f,
           "invalid sampling parameter frequency_penalty={}: must be in [-2, 2]",
           frequency_penalty);
  MD_CHECK(max_tokens >= 1, "invalid sampling parameter max_tokens={}: must be >= 1", max_tokens);
  for (int32_t id : stop_token_ids)
    MD_CHECK(id >= 0, "invalid sampling parameter stop_token_ids: negative id {}", id);
  for (const auto& s : stop_strings)
    MD_CHECK(!s.empty(), "invalid sampling parameter stop_strings: empty string");
}

Sampler::Sampler(const SamplingParams& params, int64_t vocab)
    : params_(params), vocab_(vocab), rng_(params.seed) {
  params_.validate();
  MD_CHECK(vocab > 0 && vocab <= INT32_MAX, "sampler: invalid vocabulary size {}", vocab);
  for (int32_t id : params_.stop_token_ids)
    MD_CHECK(id < vocab, "invalid sampling parameter stop_token_ids: id {} >= vocabulary size {}",
             id, vocab);
}

bool Sampler::has_penalties() const {
  return params_.repetition_penalty != 1.0f || params_.presence_penalty != 0.0f ||
         params_.frequency_penalty != 0.0f;
}

void Sampler::set_prompt_length(size_t n) {
  prompt_len_ = n;
  for (int32_t id : touched_) counts_[size_t(id)] = 0, seen_[size_t(id)] = 0;
  touched_.clear();
  counted_len_ = 0;
}

void Sampler::update_counts(std::span<const int32_t> history) {
  if (!prompt_len_) prompt_len_ = history.size();
  if (counts_.empty()) {
    counts_.assign(size_t(vocab_), 0);
    seen_.assign(size_t(vocab_), 0);
  }
  if (history.size() < counted_len_) set_prompt_length(*prompt_len_);  // not our sequence: recount
  for (size_t i = counted_len_; i < history.size(); ++i) {
    int32_t id = history[i];
    MD_CHECK(id >= 0 && id < vocab_, "sampler: history token id {} outside vocabulary of {}", id,
             vocab_);
    if (!seen_[size_t(id)]) {
      seen_[size_t(id)] = 1;
      touched_.push_back(id);
    }
    if (i >= *prompt_len_) ++counts_[size_t(id)];
  }
  counted_len_ = history.size();
}

SampleRow Sampler::row_without_draw(std::span<const int32_t> history) {
  SampleRow r;
  r.temperature = params_.temperature;
  r.top_k = params_.top_k;
  r.top_p = params_.top_p;
  r.min_p = params_.min_p;
  r.repetition_penalty = params_.repetition_penalty;
  r.presence_penalty = params_.presence_penalty;
  r.frequency_penalty = params_.frequency_penalty;
  if (has_penalties()) {
    update_counts(history);
    entries_.clear();
    for (int32_t id : touched_) entries_.push_back(PenaltyCount{id, counts_[size_t(id)]});
    r.penalties = entries_.data();
    r.num_penalties = uint32_t(entries_.size());
  }
  return r;
}

SampleRow Sampler::prepare(std::span<const int32_t> history) {
  SampleRow r = row_without_draw(history);
  if (!r.greedy()) r.uniform = rng_.uniform();
  return r;
}

void Sampler::penalize(std::span<float> logits, std::span<const int32_t> history) {
  MD_CHECK(int64_t(logits.size()) == vocab_, "sampler: got {} logits for a vocabulary of {}",
           logits.size(), vocab_);
  apply_penalties(row_without_draw(history), logits);
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> history) {
  MD_CHECK(int64_t(logits.size()) == vocab_, "sampler: got {} logits for a vocabulary of {}",
           logits.size(), vocab_);
  return sample_row(prepare(history), logits, scratch_);
}

LogitMax logit_max(std::span<const float> logits, int32_t first_id) {
  LogitMax m{-INFINITY, -1};
  for (size_t i = 0; i < logits.size(); ++i) {
    const float v = logits[i];
    MD_CHECK(!std::isnan(v), "sampler: logit {} is NaN", size_t(first_id) + i);
    if (v > m.value) m = {v, first_id + int32_t(i)};
  }
  return m;
}

namespace {

int32_t argmax(std::span<const float> logits) {
  const LogitMax m = logit_max(logits);
  MD_CHECK(m.id >= 0, "sampler: every logit is -inf");
  return m.id;
}

// Steps 3-6 on penalised logits: the support and weights the draw walks (see
// SampleDistribution). Weights are exp(x - max x), so the most likely token has w = 1 and min-p is
// simply w >= min_p.
SampleDistribution truncated_distribution(const SampleRow& row, std::span<const float> logits,
                                          SampleScratch& sc) {
  using Cand = SampleScratch::Cand;
  const size_t V = logits.size();
  const float inv_t = 1.0f / row.temperature;
  const double top_p = row.top_p;
  const float min_p = row.min_p;

  float mx = -INFINITY;
  for (size_t i = 0; i < V; ++i) {
    MD_CHECK(!std::isnan(logits[i]), "sampler: logit {} is NaN", i);
    mx = std::max(mx, logits[i] * inv_t);
  }
  MD_CHECK(mx > -INFINITY, "sampler: every logit is -inf");

  std::vector<Cand>& cands = sc.cands;
  cands.clear();
  const size_t k = row.top_k > 0 && size_t(row.top_k) < V ? size_t(row.top_k) : V;
  if (k == V && top_p >= 1.0) {
    // No truncation by rank: one pass in id order, no selection.
    cands.reserve(V);
    double total = 0;
    for (size_t i = 0; i < V; ++i) {
      const float x = logits[i] * inv_t;
      const float w = std::exp(x - mx);
      if (w < min_p) continue;
      cands.push_back(Cand{int32_t(i), x, w});
      total += w;
    }
    return SampleDistribution{cands, total};
  }

  // Candidate set: the k best tokens (unsorted; order within the set does not change the
  // distribution, and the selection is deterministic).
  Better better;
  if (k < V && k <= size_t(kHeapTopK)) {
    cands.reserve(k);
    for (size_t i = 0; i < V; ++i) {
      Cand c{int32_t(i), logits[i] * inv_t, 0.0f};
      if (cands.size() < k) {
        cands.push_back(c);
        std::push_heap(cands.begin(), cands.end(), better);  // front = worst kept
      } else if (better(c, cands.front())) {
        std::pop_heap(cands.begin(), cands.end(), better);
        cands.back() = c;
        std::push_heap(cands.begin(), cands.end(), better);
      }
    }
  } else {
    cands.resize(V);
    for (size_t i = 0; i < V; ++i) cands[i] = Cand{int32_t(i), logits[i] * inv_t, 0.0f};
    if (k < V) {
      std::nth_element(cands.begin(), cands.begin() + ptrdiff_t(k), cands.end(), better);
      cands.resize(k);
    }
  }
  double z = 0;  // softmax denominator over the candidate set
  for (Cand& c : cands) z += (c.w = std::exp(c.x - mx));

  // Top-p keeps the smallest best-first prefix whose mass reaches top_p. Rather than sorting, the
  // weights go into buckets by their leading float bits (monotonic in the weight, so a better token
  // is never in a lower bucket); whole buckets are kept from the top while the mass stays below
  // the target, and only the bucket holding the cut is sorted. O(size) for any nucleus size.
  size_t keep = cands.size();
  if (top_p < 1.0) {
    const double target = top_p * z;
    auto bucket = [](float w) { return std::bit_cast<uint32_t>(w) >> kBucketShift; };
    sc.bucket_mass.assign(kBuckets, 0.0);
    for (const Cand& c : cands) sc.bucket_mass[bucket(c.w)] += c.w;
    double acc = 0;
    uint32_t cut = kBuckets - 1;
    for (; cut > 0; --cut) {
      if (acc + sc.bucket_mass[cut] >= target) break;
      acc += sc.bucket_mass[cut];
    }
    auto above = std::partition(cands.begin(), cands.end(),
                                [&](const Cand& c) { return bucket(c.w) > cut; });
    auto in_cut =
        std::partition(above, cands.end(), [&](const Cand& c) { return bucket(c.w) == cut; });
    std::sort(above, in_cut, better);
    keep = size_t(in_cut - cands.begin());
    for (auto it = above; it != in_cut; ++it) {
      acc += it->w;
      if (acc >= target) {
        keep = size_t(it - cands.begin()) + 1;
        break;
      }
    }
  }

  // Min-p: weights are relative to the overall maximum (w = 1), which is always kept. The kept
  // prefix is compacted in place (order preserved), so the support is one contiguous span.
  double total = 0;
  size_t n = 0;
  for (size_t i = 0; i < keep; ++i)
    if (cands[i].w >= min_p) {
      total += cands[i].w;
      cands[n++] = cands[i];
    }
  cands.resize(n);
  return SampleDistribution{cands, total};
}

}  // namespace

double SampleDistribution::probability(int32_t id) const {
  for (const SampleScratch::Cand& c : support)
    if (c.id == id) return double(c.w) / total;
  return 0.0;
}

SampleDistribution sample_distribution(const SampleRow& row, std::span<const float> logits,
                                       SampleScratch& sc) {
  std::span<const float> l = logits;
  if (row.has_penalties() && row.num_penalties > 0) {
    sc.work.assign(logits.begin(), logits.end());
    apply_penalties(row, sc.work);
    l = sc.work;
  }
  if (!row.greedy()) return truncated_distribution(row, l, sc);
  sc.cands.assign(1, SampleScratch::Cand{argmax(l), 0.0f, 1.0f});
  return SampleDistribution{sc.cands, 1.0};
}

int32_t draw_from(const SampleDistribution& d, double uniform, int32_t excluded) {
  MD_CHECK(!d.support.empty(), "sampler: empty distribution");
  double total = d.total;
  if (excluded >= 0) {
    // The residual's mass summed afresh (not total - w): exact when the excluded token held
    // almost all of it.
    total = 0;
    for (const SampleScratch::Cand& c : d.support)
      if (c.id != excluded) total += c.w;
    if (!(total > 0)) return excluded;
  }
  double u = uniform * total;
  int32_t last = -1;
  for (const SampleScratch::Cand& c : d.support) {
    if (c.id == excluded) continue;
    last = c.id;
    u -= c.w;
    if (u < 0) return last;
  }
  return last;  // rounding left u a hair above zero
}

void apply_penalties(const SampleRow& row, std::span<float> logits) {
  if (!row.has_penalties()) return;
  const float rep = row.repetition_penalty;
  for (uint32_t i = 0; i < row.num_penalties; ++i) {
    const PenaltyCount& p = row.penalties[i];
    MD_CHECK(p.id >= 0 && size_t(p.id) < logits.size(),
             "sampler: penalty id {} outside the vocabulary of {}", p.id, logits.size());
    float& l = logits[size_t(p.id)];
    if (rep != 1.0f) l = l > 0.0f ? l / rep : l * rep;
    if (p.output_count > 0)
      l -= row.frequency_penalty * float(p.output_count) + row.presence_penalty;
  }
}

int32_t sample_row(const SampleRow& row, std::span<const float> logits, SampleScratch& sc) {
  return draw_from(sample_distribution(row, logits, sc), row.uniform);
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (const auto& s : stops_) MD_CHECK(!s.empty(), "stop strings must not be empty");
}

StopMatcher::Result StopMatcher::feed(std::string_view chunk) {
  if (stopped_) return {{}, true};
  pending_.append(chunk);

  // The earliest complete stop string wins; held-back text is still in pending_, so stops that
  // straddle chunk boundaries are found here too.
  size_t hit = std::string::npos;
  for (size_t i = 0; i < stops_.size(); ++i) {
    const size_t at = pending_.find(stops_[i]);
    if (at < hit) {
      hit = at;
      matched_ = int(i);
    }
  }
  if (hit != std::string::npos) {
    Result r{pending_.substr(0, hit), true};
    pending_.clear();
    stopped_ = true;
    return r;
  }

  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const auto& s : stops_) {
    for (size_t len = std::min(s.size() - 1, pending_.size()); len > hold; --len) {
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  Result r{pending_.substr(0, pending_.size() - hold), false};
  pending_.erase(0, pending_.size() - hold);
  return r;
}

const std::string& StopMatcher::matched() const {
  static const std::string none;
  return matched_ < 0 ? none : stops_[size_t(matched_)];
}

std::string StopMatcher::flush() {
  std::string out;
  if (!stopped_) out.swap(pending_);
  return out;
}

}  // namespace md
