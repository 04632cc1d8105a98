// Byte-level BPE encode/decode over tiktoken ranks, special-token handling, and model-dir loading.
#include "megadecode/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "internal.h"
#include "megadecode/base/error.h"

namespace md {
namespace {

using nlohmann::json;
constexpr int32_t kNoRank = std::numeric_limits<int32_t>::max();

inline uint64_t mix(uint64_t a, uint64_t b) {
  unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(r) ^ static_cast<uint64_t>(r >> 64);
}

// A fast hash of short byte strings (most BPE lookups are 2..16 bytes).
inline uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    h = mix(h ^ v, 0xA0761D6478BD642Full);
    p += 8;
    n -= 8;
  }
  if (n) {
    uint64_t v = 0;
    std::memcpy(&v, p, n);
    h = mix(h ^ v, 0xE7037ED1A0B428DBull);
  }
  return mix(h, 0x8EBC6AF09C88C6E3ull);
}

// Open-addressing map from token bytes (stored once in the tokenizer's arena) to rank. BPE does
// one lookup per candidate pair, so this is the encoder's hottest structure. Keys of up to 8 bytes
// (nearly all BPE candidates) are kept inline in the slot, so those probes never touch the arena.
class RankTable {
 public:
  void build(const std::string* arena, const std::vector<uint32_t>& off,
             const std::vector<uint32_t>& len, int32_t num_ranks) {
    arena_ = arena;
    size_t cap = 16;
    while (cap < static_cast<size_t>(num_ranks) * 2) cap <<= 1;
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    for (int32_t r = 0; r < num_ranks; ++r) {
      const char* p = arena->data() + off[r];
      uint64_t h = hash_bytes(p, len[r]);
      size_t i = h & mask_;
      while (slots_[i].rank >= 0) i = (i + 1) & mask_;
      slots_[i] = Slot{inline_key(p, len[r]), static_cast<uint32_t>(h >> 32), off[r], len[r], r};
    }
  }
  int32_t find(const char* p, size_t n) const {
    uint64_t h = hash_bytes(p, n);
    uint32_t tag = static_cast<uint32_t>(h >> 32);
    uint64_t key = inline_key(p, n);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.rank < 0) return kNoRank;
      if (s.tag != tag || s.len != n) continue;
      if (n <= 8 ? s.key == key : std::memcmp(arena_->data() + s.off, p, n) == 0) return s.rank;
    }
  }

 private:
  static uint64_t inline_key(const char* p, size_t n) {
    uint64_t k = 0;
    std::memcpy(&k, p, n < 8 ? n : 8);
    return k;
  }
  struct Slot {
    uint64_t key = 0;
    uint32_t tag = 0, off = 0, len = 0;
    int32_t rank = -1;
  };
  const std::string* arena_ = nullptr;
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("{}: cannot open (missing or unreadable)", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) fail("{}: read error", path);
  return ss.str();
}

int base64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Strict standard base64 (with padding); false on any malformed input.
bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  if (in.empty() || in.size() % 4 != 0) return false;
  for (size_t i = 0; i < in.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      unsigned char c = static_cast<unsigned char>(in[i + k]);
      if (c == '=' && i + 4 == in.size() && k >= 2) {
        v[k] = 0;
        ++pad;
      } else if (pad > 0 || (v[k] = base64_value(c)) < 0) {
        return false;
      }
    }
    uint32_t w = (v[0] << 18) | (v[1] << 12) | (v[2] << 6) | v[3];
    out.push_back(static_cast<char>(w >> 16));
    if (pad < 2) out.push_back(static_cast<char>((w >> 8) & 0xFF));
    if (pad < 1) out.push_back(static_cast<char>(w & 0xFF));
  }
  return true;
}

std::atomic<uint64_t> g_next_tokenizer_serial{1};

struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return hash_bytes(s.data(), s.size()); }
};
using StrMap = std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>>;

}  // namespace

std::string tokenizer_detail::base64_encode(std::string_view bytes) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    uint32_t w = (static_cast<unsigned char>(bytes[i]) << 16) |
                 (static_cast<unsigned char>(bytes[i + 1]) << 8) |
                 static_cast<unsigned char>(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(kAlphabet[(w >> s) & 63]);
  }
  size_t rest = bytes.size() - i;
  if (rest) {
    uint32_t w = static_cast<unsigned char>(bytes[i]) << 16;
    if (rest == 2) w |= static_cast<unsigned char>(bytes[i + 1]) << 8;
    out.push_back(kAlphabet[(w >> 18) & 63]);
    out.push_back(kAlphabet[(w >> 12) & 63]);
    out.push_back(rest == 2 ? kAlphabet[(w >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

struct Tokenizer::Impl {
  int32_t num_ranks = 0;
  int32_t vocab = 0;
  std::string arena;              // bytes of every id (ranks, then special contents)
  std::vector<uint32_t> off, len;  // per id
  std::vector<uint8_t> skip;       // per id: dropped by skip_special decoding
  RankTable ranks;
  StrMap special_by_content;
  // Special-token search: which bytes can start one, and the lengths to try (longest first).
  std::array<bool, 256> special_first{};
  std::array<std::vector<uint32_t>, 256> special_lengths;
  std::optional<int32_t> bos, eos;
  std::string chat_template;
  uint64_t serial = 0;  // identifies this vocabulary to the per-thread piece cache

  std::string_view bytes_of(int32_t id) const { return {arena.data() + off[id], len[id]}; }
  int32_t rank_of(const char* p, size_t n) const { return ranks.find(p, n); }

  void encode_ordinary(std::string_view text, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void bpe_small(std::string_view piece, std::vector<int32_t>& out) const;
  void bpe_large(std::string_view piece, std::vector<int32_t>& out) const;
};

namespace {

// Pieces that are not single tokens go through BPE once per thread and vocabulary; text repeats
// words often enough that this saves most merge work. Per-thread, so encode needs no lock.
struct PieceCache {
  uint64_t serial = 0;
  std::unordered_map<std::string, std::vector<int32_t>, StrHash, std::equal_to<>> map;
};
constexpr size_t kCacheMaxPiece = 64;
constexpr size_t kCacheMaxEntries = 1 << 15;
// Above this many bytes a piece is merged with a heap (O(n log n)) instead of rescanning all pairs
// for the minimum after every merge (O(n^2)); both give the same merges.
constexpr size_t kSmallPiece = 64;

}  // namespace

void Tokenizer::Impl::bpe_small(std::string_view piece, std::vector<int32_t>& out) const {
  // The reference algorithm: keep part boundaries and, per boundary, the rank of merging that part
  // with the next; repeatedly merge the lowest rank (leftmost on ties) until none is mergeable.
  struct Part {
    uint32_t start;
    int32_t rank;
  };
  const size_t n = piece.size();
  const char* p = piece.data();
  Part parts[kSmallPiece + 1];
  size_t m = n + 1;  // parts plus the end sentinel
  for (size_t i = 0; i <= n; ++i) {
    parts[i] = Part{static_cast<uint32_t>(i), i + 2 <= n ? rank_of(p + i, 2) : kNoRank};
  }
  auto pair_rank = [&](size_t i) {  // rank of parts i and i+1 joined; needs parts[i + 2]
    if (i + 2 >= m) return kNoRank;
    return rank_of(p + parts[i].start, parts[i + 2].start - parts[i].start);
  };
  while (m > 2) {
    size_t best = 0;
    int32_t best_rank = kNoRank;
    for (size_t i = 0; i + 1 < m; ++i) {
      if (parts[i].rank < best_rank) {
        best_rank = parts[i].rank;
        best = i;
      }
    }
    if (best_rank == kNoRank) break;
    std::memmove(&parts[best + 1], &parts[best + 2], (m - best - 2) * sizeof(Part));
    --m;
    parts[best].rank = pair_rank(best);
    if (best > 0) parts[best - 1].rank = pair_rank(best - 1);
  }
  for (size_t i = 0; i + 1 < m; ++i) {
    out.push_back(rank_of(p + parts[i].start, parts[i + 1].start - parts[i].start));
  }
}

void Tokenizer::Impl::bpe_large(std::string_view piece, std::vector<int32_t>& out) const {
  // Nodes are the initial byte positions; a live node's start never moves, so (rank, start) in a
  // min-heap reproduces the reference's "lowest rank, leftmost" order. Entries made stale by a
  // neighbour's merge are recognised by the right neighbour and its end they recorded.
  const uint32_t n = static_cast<uint32_t>(piece.size());
  const char* p = piece.data();
  struct Entry {
    int32_t rank;
    uint32_t left, right, end;
    bool operator>(const Entry& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  // Scratch reused across calls on this thread: long pieces are common in CJK text.
  thread_local std::vector<uint32_t> next, prev;
  thread_local std::vector<uint8_t> alive;
  thread_local std::vector<Entry> heap;
  next.resize(n + 1);
  prev.resize(n + 1);
  alive.assign(n + 1, 1);
  heap.clear();
  for (uint32_t i = 0; i <= n; ++i) {
    next[i] = i + 1;
    prev[i] = i == 0 ? 0 : i - 1;
  }
  const auto later = std::greater<Entry>();
  auto push_pair = [&](uint32_t left) {
    uint32_t right = next[left];
    if (right >= n) return;
    uint32_t end = next[right];
    int32_t r = rank_of(p + left, end - left);
    if (r == kNoRank) return;
    heap.push_back(Entry{r, left, right, end});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (uint32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    Entry e = heap.back();
    heap.pop_back();
    if (!alive[e.left] || !alive[e.right] || next[e.left] != e.right || next[e.right] != e.end) {
      continue;
    }
    alive[e.right] = 0;
    next[e.left] = e.end;
    prev[e.end] = e.left;
    push_pair(e.left);
    if (e.left > 0) push_pair(prev[e.left]);
  }
  for (uint32_t i = 0; i < n; i = next[i]) out.push_back(rank_of(p + i, next[i] - i));
}

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  int32_t whole = rank_of(piece.data(), piece.size());
  if (whole != kNoRank) {
    out.push_back(whole);
    return;
  }
  auto bpe = [this](std::string_view s, std::vector<int32_t>& ids) {
    if (s.size() <= kSmallPiece) {
      bpe_small(s, ids);
    } else {
      bpe_large(s, ids);
    }
  };
  if (piece.size() > kCacheMaxPiece) {
    bpe(piece, out);
    return;
  }
  thread_local PieceCache cache;
  if (cache.serial != serial || cache.map.size() >= kCacheMaxEntries) {
    cache.map.clear();
    cache.serial = serial;
  }
  auto it = cache.map.find(piece);
  if (it == cache.map.end()) {
    std::vector<int32_t> ids;
    bpe(piece, ids);
    it = cache.map.emplace(std::string(piece), std::move(ids)).first;
  }
  out.insert(out.end(), it->second.begin(), it->second.end());
}

void Tokenizer::Impl::encode_ordinary(std::string_view text, std::vector<int32_t>& out) const {
  for (std::string_view piece : split_pieces(text)) encode_piece(piece, out);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  const Impl& im = *impl_;
  std::vector<int32_t> out;
  if (text.empty()) return out;
  std::string sanitized;
  if (!is_valid_utf8(text)) {
    sanitized = sanitize_utf8(text);
    text = sanitized;
  }
  out.reserve(text.size() / 3 + 4);
  if (!allow_special || im.special_by_content.empty()) {
    im.encode_ordinary(text, out);
    return out;
  }
  // Ordinary text between special tokens is pre-tokenised on its own, as tiktoken does: a regex
  // piece never spans a special token. At one position the longest special token wins.
  size_t seg = 0, pos = 0;
  const size_t n = text.size();
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  while (pos < n) {
    if (!im.special_first[s[pos]]) {
      ++pos;
      continue;
    }
    int32_t id = -1;
    size_t match_len = 0;
    for (uint32_t L : im.special_lengths[s[pos]]) {
      if (pos + L > n) continue;
      auto it = im.special_by_content.find(text.substr(pos, L));
      if (it != im.special_by_content.end()) {
        id = it->second;
        match_len = L;
        break;
      }
    }
    if (id < 0) {
      ++pos;
      continue;
    }
    im.encode_ordinary(text.substr(seg, pos - seg), out);
    out.push_back(id);
    pos += match_len;
    seg = pos;
  }
  im.encode_ordinary(text.substr(seg), out);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  const Impl& im = *impl_;
  size_t total = 0;
  for (int32_t id : ids) {
    if (id < 0 || id >= im.vocab) {
      fail("tokenizer: cannot decode id {}: outside the vocabulary [0, {})", id, im.vocab);
    }
    total += im.len[id];
  }
  std::string out;
  out.reserve(total);
  for (int32_t id : ids) {
    if (skip_special && im.skip[id]) continue;
    out.append(im.bytes_of(id));
  }
  return out;
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= impl_->vocab) {
    fail("tokenizer: no token with id {}: outside the vocabulary [0, {})", id, impl_->vocab);
  }
  return impl_->bytes_of(id);
}

bool Tokenizer::is_special(int32_t id) const { return id >= impl_->num_ranks && id < impl_->vocab; }
bool Tokenizer::skipped_when_decoding(int32_t id) const {
  return id >= 0 && id < impl_->vocab && impl_->skip[id];
}
std::optional<int32_t> Tokenizer::special_id(std::string_view content) const {
  auto it = impl_->special_by_content.find(content);
  if (it == impl_->special_by_content.end()) return std::nullopt;
  return it->second;
}
int32_t Tokenizer::vocab_size() const { return impl_->vocab; }
int32_t Tokenizer::num_ranks() const { return impl_->num_ranks; }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }

Tokenizer Tokenizer::build(std::vector<std::string> ranks, std::vector<SpecialToken> specials,
                           int64_t vocab_size, const std::string& ranks_src,
                           const std::string& specials_src) {
  if (ranks.empty()) fail("{}: no BPE ranks", ranks_src);
  if (ranks.size() >= static_cast<size_t>(std::numeric_limits<int32_t>::max() / 2)) {
    fail("{}: too many ranks ({})", ranks_src, ranks.size());
  }
  auto im = std::make_shared<Impl>();
  im->num_ranks = static_cast<int32_t>(ranks.size());
  int64_t max_special = -1;
  for (const SpecialToken& t : specials) max_special = std::max<int64_t>(max_special, t.id);
  if (vocab_size <= 0) {
    vocab_size = std::max<int64_t>(im->num_ranks + int64_t{kKimiNumSpecialTokens}, max_special + 1);
  }
  if (vocab_size < im->num_ranks) {
    fail("{}: vocabulary size {} is smaller than the {} BPE ranks", specials_src, vocab_size,
         im->num_ranks);
  }
  // Every id past the ranks gets a name string, so a corrupt id or vocabulary size must not be
  // able to ask for a billion of them. Released vocabularies have a few hundred.
  constexpr int64_t kMaxSpecialIds = int64_t{1} << 16;
  if (vocab_size - im->num_ranks > kMaxSpecialIds) {
    fail("{}: vocabulary size {} leaves {} ids past the {} BPE ranks for special tokens; at most "
         "{} are supported",
         specials_src, vocab_size, vocab_size - im->num_ranks, im->num_ranks, kMaxSpecialIds);
  }
  im->vocab = static_cast<int32_t>(vocab_size);

  // Every id's bytes go into one arena; names of specials, given or reserved, follow the ranks.
  std::vector<std::string> names(static_cast<size_t>(im->vocab - im->num_ranks));
  std::vector<uint8_t> named(names.size(), 0);
  im->skip.assign(static_cast<size_t>(im->vocab), 0);
  for (const SpecialToken& t : specials) {
    if (t.id < im->num_ranks || t.id >= im->vocab) {
      fail("{}: special token id {} ('{}') is outside the special range [{}, {})", specials_src,
           t.id, t.content, im->num_ranks, im->vocab);
    }
    if (t.content.empty()) fail("{}: special token id {} has empty content", specials_src, t.id);
    if (!is_valid_utf8(t.content)) {
      fail("{}: special token id {} is not valid UTF-8", specials_src, t.id);
    }
    size_t k = static_cast<size_t>(t.id - im->num_ranks);
    if (named[k]) fail("{}: special token id {} is defined twice", specials_src, t.id);
    named[k] = 1;
    names[k] = t.content;
    im->skip[t.id] = t.special ? 1 : 0;
  }
  for (size_t k = 0; k < names.size(); ++k) {
    if (named[k]) continue;
    int64_t id = im->num_ranks + static_cast<int64_t>(k);
    names[k] = "<|reserved_token_" + std::to_string(id) + "|>";
    im->skip[id] = 1;
  }

  size_t total = 0;
  for (const auto& r : ranks) total += r.size();
  for (const auto& s : names) total += s.size();
  if (total >= std::numeric_limits<uint32_t>::max()) fail("{}: token bytes too large", ranks_src);
  im->arena.reserve(total);
  im->off.reserve(im->vocab);
  im->len.reserve(im->vocab);
  for (int32_t r = 0; r < im->num_ranks; ++r) {
    if (ranks[r].empty()) fail("{}: rank {} has no bytes", ranks_src, r);
    im->off.push_back(static_cast<uint32_t>(im->arena.size()));
    im->len.push_back(static_cast<uint32_t>(ranks[r].size()));
    im->arena += ranks[r];
  }
  for (const auto& s : names) {
    im->off.push_back(static_cast<uint32_t>(im->arena.size()));
    im->len.push_back(static_cast<uint32_t>(s.size()));
    im->arena += s;
  }
  im->ranks.build(&im->arena, im->off, im->len, im->num_ranks);
  // Duplicate token bytes would make the rank of a byte string ambiguous.
  for (int32_t r = 0; r < im->num_ranks; ++r) {
    int32_t found = im->rank_of(ranks[r].data(), ranks[r].size());
    if (found != r) fail("{}: rank {} repeats the bytes of rank {}", ranks_src, r, found);
  }
  // BPE starts from single bytes, so every byte must have a rank or encode could not proceed.
  for (int b = 0; b < 256; ++b) {
    char c = static_cast<char>(b);
    if (im->rank_of(&c, 1) == kNoRank) fail("{}: byte 0x{:02x} has no rank", ranks_src, b);
  }

  for (size_t k = 0; k < names.size(); ++k) {
    int32_t id = im->num_ranks + static_cast<int32_t>(k);
    if (!im->special_by_content.emplace(names[k], id).second) {
      fail("{}: special token '{}' appears twice", specials_src, names[k]);
    }
    unsigned char first = static_cast<unsigned char>(names[k][0]);
    im->special_first[first] = true;
    auto& lens = im->special_lengths[first];
    uint32_t L = static_cast<uint32_t>(names[k].size());
    if (std::find(lens.begin(), lens.end(), L) == lens.end()) lens.push_back(L);
  }
  for (auto& lens : im->special_lengths) std::sort(lens.rbegin(), lens.rend());
  im->serial = g_next_tokenizer_serial.fetch_add(1);
  return Tokenizer(std::move(im));
}

Tokenizer Tokenizer::from_parts(std::vector<std::string> ranks, std::vector<SpecialToken> specials,
                                int64_t vocab_size) {
  return build(std::move(ranks), std::move(specials), vocab_size, "tokenizer ranks",
               "tokenizer specials");
}

namespace {

std::vector<std::string> parse_tiktoken_model(std::string_view text, const std::string& path) {
  std::vector<std::string> ranks;
  std::vector<uint8_t> seen;
  std::string bytes;
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;  // tiktoken's loader skips blank lines too
    size_t sp = line.find(' ');
    if (sp == std::string_view::npos) {
      fail("{}:{}: expected '<base64 token> <rank>', found no rank", path, line_no);
    }
    std::string_view b64 = line.substr(0, sp), rank_text = line.substr(sp + 1);
    if (!base64_decode(b64, bytes)) {
      fail("{}:{}: bad base64 token '{}'", path, line_no, std::string(b64.substr(0, 64)));
    }
    auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
    if (rank_text.empty() || rank_text.size() > 9 ||
        !std::all_of(rank_text.begin(), rank_text.end(), is_digit)) {
      fail("{}:{}: bad rank '{}'", path, line_no, std::string(rank_text.substr(0, 32)));
    }
    size_t rank = std::stoul(std::string(rank_text));
    // Real vocabularies stay far below this; the bound keeps a corrupt rank from allocating GBs.
    if (rank >= (size_t{1} << 26)) fail("{}:{}: rank {} is implausibly large", path, line_no, rank);
    if (rank >= ranks.size()) {
      ranks.resize(rank + 1);
      seen.resize(rank + 1, 0);
    }
    if (seen[rank]) fail("{}:{}: duplicate rank {}", path, line_no, rank);
    seen[rank] = 1;
    ranks[rank] = bytes;
  }
  if (ranks.empty()) fail("{}: no ranks (empty file)", path);
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (!seen[r]) fail("{}: ranks are not contiguous: rank {} is missing", path, r);
  }
  return ranks;
}

json parse_json_text(std::string_view text, const std::string& path) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
}

// tokenizer_config.json names a token either as a string or as an AddedToken object.
std::optional<std::string> token_name(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return std::nullopt;
}

}  // namespace

Tokenizer Tokenizer::from_texts(std::string_view tiktoken_model,
                                std::string_view tokenizer_config, int64_t vocab_size,
                                const std::string& ranks_path, const std::string& config_path) {
  std::vector<std::string> ranks = parse_tiktoken_model(tiktoken_model, ranks_path);
  json cfg = parse_json_text(tokenizer_config, config_path);
  if (!cfg.is_object()) fail("{}: expected a JSON object", config_path);

  std::vector<SpecialToken> specials;
  if (auto it = cfg.find("added_tokens_decoder"); it != cfg.end()) {
    if (!it->is_object()) fail("{}: added_tokens_decoder must be an object", config_path);
    for (const auto& [key, value] : it->items()) {
      SpecialToken t;
      size_t used = 0;
      try {
        long long id = std::stoll(key, &used);
        if (used != key.size() || id < 0 || id > std::numeric_limits<int32_t>::max()) used = 0;
        t.id = static_cast<int32_t>(id);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0) fail("{}: added_tokens_decoder key '{}' is not a token id", config_path, key);
      if (!value.is_object() || !value.contains("content") || !value["content"].is_string()) {
        fail("{}: added_tokens_decoder[{}] has no string 'content'", config_path, key);
      }
      t.content = value["content"].get<std::string>();
      if (value.contains("special")) {
        if (!value["special"].is_boolean()) {
          fail("{}: added_tokens_decoder[{}].special must be true or false", config_path, key);
        }
        t.special = value["special"].get<bool>();
      }
      specials.push_back(std::move(t));
    }
  }

  Tokenizer tok = build(std::move(ranks), std::move(specials), vocab_size, ranks_path,
                        config_path);
  auto im = std::const_pointer_cast<Impl>(tok.impl_);
  auto resolve = [&](const char* key) -> std::optional<int32_t> {
    auto name = token_name(cfg, key);
    if (!name) return std::nullopt;
    auto id = tok.special_id(*name);
    if (!id) fail("{}: {} '{}' is not a special token", config_path, key, *name);
    return id;
  };
  im->bos = resolve("bos_token");
  im->eos = resolve("eos_token");
  if (auto it = cfg.find("chat_template"); it != cfg.end() && it->is_string()) {
    im->chat_template = it->get<std::string>();
  }
  return tok;
}

Tokenizer Tokenizer::load(const std::string& model_dir, int64_t vocab_size) {
  namespace fs = std::filesystem;
  const std::string ranks_path = (fs::path(model_dir) / "tiktoken.model").string();
  const std::string config_path = (fs::path(model_dir) / "tokenizer_config.json").string();
  const std::string ranks_text = read_file(ranks_path);
  const std::string config_text = read_file(config_path);
  if (vocab_size <= 0) {
    const fs::path model_config = fs::path(model_dir) / "config.json";
    if (fs::exists(model_config)) {
      json mc = parse_json_text(read_file(model_config.string()), model_config.string());
      const json* src = &mc;
      if (mc.is_object() && !mc.contains("vocab_size") && mc.contains("text_config")) {
        src = &mc["text_config"];
      }
      if (src->is_object() && src->contains("vocab_size")) {
        const json& v = (*src)["vocab_size"];
        if (!v.is_number_integer() || v.get<int64_t>() <= 0) {
          fail("{}: vocab_size must be a positive integer", model_config.string());
        }
        vocab_size = v.get<int64_t>();
      }
    }
  }

  return from_texts(ranks_text, config_text, vocab_size, ranks_path, config_path);
}

}  // namespace md
