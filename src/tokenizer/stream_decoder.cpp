// Streaming detokenisation: emit only complete UTF-8 characters as tokens arrive.
#include <string>

#include "internal.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace md {

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(&tokenizer), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  std::string_view bytes = tokenizer_->token_bytes(id);  // validates the id
  if (!tokenizer_->is_special(id)) {
    pending_.append(bytes);
    return drain(false);
  }
  if (skip_special_ && tokenizer_->skipped_when_decoding(id)) return {};
  // A character cannot continue across a special token: settle what is held back first.
  std::string out = drain(true);
  out.append(bytes);
  return out;
}

std::string StreamDecoder::flush() { return drain(true); }

std::string StreamDecoder::drain(bool final) {
  static constexpr char kReplacement[] = "\xEF\xBF\xBD";
  const auto* s = reinterpret_cast<const unsigned char*>(pending_.data());
  const size_t n = pending_.size();
  std::string out;
  out.reserve(n);
  size_t i = 0, emitted = 0;  // pending_[emitted, i) is valid and not yet copied
  while (i < n) {
    int step = tokenizer_detail::utf8_step(s, n, i);
    if (step > 0) {
      i += static_cast<size_t>(step);
      continue;
    }
    size_t bad = static_cast<size_t>(-step);
    // A valid lead byte whose sequence only ran out of input may still complete with the next
    // token: hold it back (unless this is the end of the stream).
    bool truncated = s[i] >= 0xC2 && s[i] <= 0xF4 && i + bad == n;
    if (truncated && !final) break;
    out.append(pending_, emitted, i - emitted);
    out.append(kReplacement, 3);
    i += bad;
    emitted = i;
  }
  out.append(pending_, emitted, i - emitted);
  pending_.erase(0, i);
  return out;
}

}  // namespace md
