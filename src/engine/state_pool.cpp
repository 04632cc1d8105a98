// The state pool (state_pool.h): slots and latent-cache pages in three flat allocations, free
// lists for both, and the sequence handle's accessors.
#include "megadecode/engine/state_pool.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"

namespace md {

namespace {

// Zeroed memory of n bytes: calloc, which for large sizes maps fresh zero pages that the OS
// commits as they are written (so a reserved but idle budget is not resident).
void* zeroed(size_t n, const char* what) {
  void* p = std::calloc(std::max<size_t>(n, 1), 1);
  MD_CHECK(p != nullptr, "state pool: cannot allocate {} for {}", human_bytes(double(n)), what);
  return p;
}

}  // namespace

void StatePool::FreeDeleter::operator()(void* p) const {
  std::free(p);
}

namespace {
// Host memory: calloc (see zeroed).
class HostMemory final : public PoolMemory {
 public:
  void* alloc_zeroed(size_t bytes) override { return zeroed(bytes, "the state pool"); }
  void free(void* p) override { std::free(p); }
  void zero(void* p, size_t bytes) override { std::memset(p, 0, bytes); }
  void copy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  bool host_accessible() const override { return true; }
};
HostMemory g_host_memory;
}  // namespace

StatePool::StatePool(const ModelConfig& cfg, bool cache_bf16, const PoolOptions& opt,
                     PoolMemory* memory)
    : mem_(memory ? memory : &g_host_memory), cfg_(cfg), opt_(opt), bf16_(cache_bf16) {
  MD_CHECK(opt_.max_sequences >= 1 && opt_.max_sequences <= 65536,
           "state pool: --max-sequences {} is outside 1..65536", opt_.max_sequences);
  MD_CHECK(opt_.page_rows >= cpu::kMlaBlockRows && opt_.page_rows % cpu::kMlaBlockRows == 0 &&
               opt_.page_rows <= 4096,
           "state pool: a page of {} rows is not a multiple of {} in {}..4096", opt_.page_rows,
           cpu::kMlaBlockRows, cpu::kMlaBlockRows);
  MD_CHECK(opt_.commit_rows >= 0 && opt_.commit_rows <= 64,
           "state pool: a row log of {} rows is outside 0..64", opt_.commit_rows);
  if (opt_.cache_tokens == 0)
    opt_.cache_tokens = int64_t(opt_.max_sequences) * kDefaultTokensPerSequence;
  MD_CHECK(opt_.cache_tokens >= 1 && opt_.cache_tokens <= (int64_t(1) << 31),
           "state pool: --cache-tokens {} is outside 1..2^31", opt_.cache_tokens);
  const int L = cfg_.num_layers;
  int nmla = 0;
  int& nkda = nkda_;
  kda_index_.assign(size_t(L), -1);
  mla_index_.assign(size_t(L), -1);
  for (int l = 0; l < L; ++l) {
    if (cfg_.attn_kind[size_t(l)] == AttnKind::KDA)
      kda_index_[size_t(l)] = nkda++;
    else
      mla_index_[size_t(l)] = nmla++;
  }
  const size_t C = size_t(cfg_.kda_dim());
  state_floats_ =
      size_t(cfg_.kda_num_heads) * size_t(cfg_.kda_head_dim) * size_t(cfg_.kda_head_dim);
  conv_floats_ = nkda > 0 ? size_t(3) * size_t(cfg_.kda_conv_size - 1) * C : 0;
  log_floats_ = opt_.commit_rows > 0
                    ? state_floats_ + conv_floats_ +
                          size_t(opt_.commit_rows) * size_t(kda_row_log_floats(cfg_))
                    : 0;
  // Slot: [kda layers][state], [kda layers][conv], [kda layers][row log], rounded to 64 bytes.
  slot_floats_ = size_t(nkda) * (state_floats_ + conv_floats_ + log_floats_);
  slot_floats_ = (slot_floats_ + 15) / 16 * 16;
  // Page: [mla layers][page_rows][width], each layer's part a multiple of 64 bytes.
  row_bytes_ = size_t(cfg_.mla_cache_width()) * (bf16_ ? 2 : 4);
  layer_page_bytes_ = (size_t(opt_.page_rows) * row_bytes_ + 63) / 64 * 64;
  page_bytes_ = size_t(nmla) * layer_page_bytes_;
  total_pages_ = nmla > 0 ? pages_for(opt_.cache_tokens) : 0;

  const size_t S = size_t(opt_.max_sequences);
  slots_ = static_cast<float*>(mem_->alloc_zeroed(S * slot_floats_ * sizeof(float)));
  pages_ = static_cast<uint8_t*>(mem_->alloc_zeroed(size_t(total_pages_) * page_bytes_));
  tables_.reset(
      static_cast<int32_t*>(zeroed(S * size_t(total_pages_) * sizeof(int32_t), "page tables")));
  free_slots_.reserve(S);
  for (int i = int(S) - 1; i >= 0; --i) free_slots_.push_back(i);  // slot 0 first
  free_pages_.reserve(size_t(total_pages_));
  for (int64_t p = total_pages_ - 1; p >= 0; --p) free_pages_.push_back(int32_t(p));
}

StatePool::~StatePool() {
  mem_->free(slots_);
  mem_->free(pages_);
}

size_t StatePool::bytes() const {
  return size_t(opt_.max_sequences) * (slot_bytes() + size_t(total_pages_) * sizeof(int32_t)) +
         size_t(total_pages_) * page_bytes_;
}

int StatePool::sequences_in_use() const {
  std::lock_guard<std::mutex> g(mu_);
  return opt_.max_sequences - int(free_slots_.size());
}

std::vector<int> StatePool::slots_in_use() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<char> taken(size_t(opt_.max_sequences), 1);
  for (int s : free_slots_) taken[size_t(s)] = 0;
  std::vector<int> out;
  for (int s = 0; s < opt_.max_sequences; ++s)
    if (taken[size_t(s)]) out.push_back(s);
  return out;
}

int64_t StatePool::free_pages() const {
  std::lock_guard<std::mutex> g(mu_);
  return int64_t(free_pages_.size());
}

bool StatePool::compatible(const StatePool& o) const {
  return bf16_ == o.bf16_ && kda_index_ == o.kda_index_ && state_floats_ == o.state_floats_ &&
         conv_floats_ == o.conv_floats_ && row_bytes_ == o.row_bytes_;
}

SequenceState StatePool::acquire() {
  int slot;
  {
    std::lock_guard<std::mutex> g(mu_);
    MD_CHECK(!free_slots_.empty(),
             "state pool is full: all {} sequence slots are in use (--max-sequences {}, {} a "
             "slot)",
             opt_.max_sequences, opt_.max_sequences, human_bytes(double(slot_bytes())));
    slot = free_slots_.back();
    free_slots_.pop_back();
  }
  // A fresh sequence starts from zero KDA state and conv cache (the row log is written before
  // it is read).
  const size_t nkda = size_t(nkda_);
  mem_->zero(slot_data(slot), nkda * (state_floats_ + conv_floats_) * sizeof(float));
  SequenceState s;
  s.pool_ = this;
  s.slot_ = slot;
  return s;
}

void StatePool::grow(SequenceState& s, int64_t tokens) {
  const int64_t need = pages_for(tokens);
  if (need <= s.npages_) return;
  std::lock_guard<std::mutex> g(mu_);
  const int64_t more = need - s.npages_;
  MD_CHECK(more <= int64_t(free_pages_.size()),
           "state pool is out of latent-cache pages: a sequence of {} tokens needs {} more pages "
           "of {} tokens, {} of {} are free (--cache-tokens {}: {} of cache for all sequences)",
           tokens, more, opt_.page_rows, free_pages_.size(), total_pages_, opt_.cache_tokens,
           human_bytes(double(total_pages_) * double(page_bytes_)));
  int32_t* t = table(s.slot_);
  for (int64_t i = 0; i < more; ++i) {
    t[s.npages_++] = free_pages_.back();
    free_pages_.pop_back();
  }
}

void StatePool::shrink(SequenceState& s, int64_t tokens) {
  const int64_t keep = pages_for(std::max<int64_t>(tokens, 0));
  std::lock_guard<std::mutex> g(mu_);
  const int32_t* t = table(s.slot_);
  while (s.npages_ > keep) free_pages_.push_back(t[--s.npages_]);
}

void StatePool::free_slot(int slot, int npages) noexcept {
  std::lock_guard<std::mutex> g(mu_);
  const int32_t* t = table(slot);
  for (int i = npages - 1; i >= 0; --i) free_pages_.push_back(t[i]);
  free_slots_.push_back(slot);
}

// ---------------------------------------------------------------------------------------------

SequenceState::~SequenceState() {
  release();
}

SequenceState::SequenceState(SequenceState&& o) noexcept
    : pos(o.pos), rowlog(o.rowlog), pool_(o.pool_), slot_(o.slot_), npages_(o.npages_) {
  o.pool_ = nullptr;
  o.slot_ = -1;
  o.npages_ = 0;
  o.pos = 0;
  o.rowlog = {};
}

SequenceState& SequenceState::operator=(SequenceState&& o) noexcept {
  if (this != &o) {
    release();
    pos = o.pos;
    rowlog = o.rowlog;
    pool_ = o.pool_;
    slot_ = o.slot_;
    npages_ = o.npages_;
    o.pool_ = nullptr;
    o.slot_ = -1;
    o.npages_ = 0;
    o.pos = 0;
    o.rowlog = {};
  }
  return *this;
}

void SequenceState::release() noexcept {
  if (pool_) pool_->free_slot(slot_, npages_);
  pool_ = nullptr;
  slot_ = -1;
  npages_ = 0;
}

namespace {
int layer_index(const std::vector<int>& index, int layer, const char* kind) {
  MD_CHECK(layer >= 0 && size_t(layer) < index.size() && index[size_t(layer)] >= 0,
           "sequence state: layer {} is not a {} layer", layer, kind);
  return index[size_t(layer)];
}
}  // namespace

float* SequenceState::kda_state(int layer) const {
  MD_CHECK(pool_, "sequence state: empty (not made by a pool)");
  const int i = layer_index(pool_->kda_index_, layer, "KDA");
  return pool_->slot_data(slot_) + size_t(i) * pool_->state_floats_;
}

float* SequenceState::conv_cache(int layer) const {
  MD_CHECK(pool_, "sequence state: empty (not made by a pool)");
  const int i = layer_index(pool_->kda_index_, layer, "KDA");
  const size_t nkda = size_t(pool_->nkda_);
  return pool_->slot_data(slot_) + nkda * pool_->state_floats_ + size_t(i) * pool_->conv_floats_;
}

float* SequenceState::kda_state0(int layer) const {
  MD_CHECK(pool_ && pool_->log_floats_ > 0,
           "sequence state: the pool keeps no row log (commit rows 0)");
  const int i = layer_index(pool_->kda_index_, layer, "KDA");
  const size_t nkda = size_t(pool_->nkda_);
  return pool_->slot_data(slot_) + nkda * (pool_->state_floats_ + pool_->conv_floats_) +
         size_t(i) * pool_->log_floats_;
}

float* SequenceState::conv0(int layer) const {
  return kda_state0(layer) + pool_->state_floats_;
}

float* SequenceState::row_inputs(int layer) const {
  return conv0(layer) + pool_->conv_floats_;
}

cpu::LatentCache SequenceState::latent(int layer) const {
  MD_CHECK(pool_, "sequence state: empty (not made by a pool)");
  const int i = layer_index(pool_->mla_index_, layer, "MLA");
  cpu::LatentCache c;
  c.base = pool_->pages_ + size_t(i) * pool_->layer_page_bytes_;
  c.page_stride = int64_t(pool_->page_bytes_);
  c.pages = pool_->table(slot_);
  c.page_rows = pool_->opt_.page_rows;
  c.ld = pool_->cfg_.mla_cache_width();
  c.bf16 = pool_->bf16_;
  return c;
}

std::span<const int32_t> SequenceState::pages() const {
  if (!pool_) return {};
  return {pool_->table(slot_), size_t(npages_)};
}

int64_t SequenceState::capacity() const {
  return pool_ ? int64_t(npages_) * pool_->opt_.page_rows : 0;
}

void SequenceState::reserve(int64_t tokens) {
  MD_CHECK(pool_, "sequence state: empty (not made by a pool)");
  pool_->grow(*this, tokens);
}

void SequenceState::truncate(int64_t tokens) {
  if (pool_) pool_->shrink(*this, tokens);
}

void SequenceState::copy_from(const SequenceState& from) {
  MD_CHECK(pool_ && from.pool_, "sequence state: copy between empty states");
  if (&from == this) return;
  MD_CHECK(pool_->compatible(*from.pool_),
           "sequence state: copy between pools of different models or cache types");
  truncate(0);
  reserve(from.pos);
  const StatePool& P = *pool_;
  const size_t nkda = size_t(P.nkda_);
  // Through the memory that is not host memory, if either is not (a device's copy reaches both).
  PoolMemory& m = P.mem_->host_accessible() ? *from.pool_->mem_ : *P.mem_;
  m.copy(P.slot_data(slot_), from.pool_->slot_data(from.slot_),
         nkda * (P.state_floats_ + P.conv_floats_) * sizeof(float));
  // A page's rows of a layer are contiguous: one copy per run of rows inside a page of both
  // pools (whose page sizes may differ), not one per row (a device memory's copy is a transfer).
  const int64_t pd = P.opt_.page_rows, ps = from.pool_->opt_.page_rows;
  for (int l = 0; l < P.cfg_.num_layers; ++l) {
    if (P.mla_index_[size_t(l)] < 0) continue;
    const cpu::LatentCache dst = latent(l), src = from.latent(l);
    for (int64_t t = 0, n = 0; t < from.pos; t += n) {
      n = std::min({pd - t % pd, ps - t % ps, from.pos - t});
      m.copy(dst.row(t), src.row(t), size_t(n) * P.row_bytes_);
    }
  }
  pos = from.pos;
  rowlog = {};
}

size_t SequenceState::bytes() const {
  if (!pool_) return 0;
  return pool_->slot_bytes() + size_t(npages_) * pool_->page_bytes();
}

}  // namespace md
