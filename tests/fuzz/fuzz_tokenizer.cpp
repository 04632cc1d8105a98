// libFuzzer harness for the tokenizer files (Tokenizer::from_texts: tiktoken.model and
// tokenizer_config.json) and, when they load, for encoding and decoding with the result.
// Input layout: <tiktoken.model text> NUL <tokenizer_config.json text> NUL <sample bytes>; a
// missing config is "{}". Loading may fail only with md::Error. A loaded tokenizer must round-trip
// the sample (decode(encode(s)) == sanitize_utf8(s)) and StreamDecoder must agree with decode on
// ids taken from the sample's bytes; anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace {

void check(bool ok) {
  if (!ok) abort();
}

// Splits off the text up to the next NUL (or the rest, when there is none).
std::string_view take_part(std::string_view& in) {
  const size_t nul = in.find('\0');
  std::string_view part = in.substr(0, nul);
  in = nul == std::string_view::npos ? std::string_view() : in.substr(nul + 1);
  return part;
}

std::string stream_decode(const md::Tokenizer& tok, const std::vector<int32_t>& ids, bool skip) {
  md::StreamDecoder dec(tok, skip);
  std::string out;
  for (int32_t id : ids) out += dec.push(id);
  out += dec.flush();
  return out;
}

void exercise(const md::Tokenizer& tok, std::string_view sample) {
  const int32_t vocab = tok.vocab_size();
  check(tok.num_ranks() > 0 && vocab >= tok.num_ranks());
  for (std::optional<int32_t> id : {tok.bos_id(), tok.eos_id()})
    check(!id || (*id >= tok.num_ranks() && *id < vocab));

  const std::string clean = md::sanitize_utf8(sample);
  check(md::is_valid_utf8(clean));
  for (bool allow_special : {true, false}) {
    const std::vector<int32_t> ids = tok.encode(sample, allow_special);
    for (int32_t id : ids) check(id >= 0 && id < vocab);
    check(tok.decode(ids) == clean);
    check(stream_decode(tok, ids, false) == clean);
  }

  // Ids straight from the sample (two bytes each) reach byte sequences encode never produces:
  // split characters, invalid UTF-8, reserved and skipped specials.
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < sample.size() && ids.size() < 512; i += 2) {
    const auto hi = static_cast<unsigned char>(sample[i]);
    const auto lo = static_cast<unsigned char>(sample[i + 1]);
    ids.push_back(static_cast<int32_t>((hi << 8 | lo) % static_cast<unsigned>(vocab)));
  }
  for (bool skip : {false, true}) {
    check(stream_decode(tok, ids, skip) == md::sanitize_utf8(tok.decode(ids, skip)));
  }
  for (int32_t id : ids) {
    const std::string_view bytes = tok.token_bytes(id);
    check(!bytes.empty());
    if (tok.is_special(id)) check(tok.special_id(bytes) == id);
  }
  // Out-of-range ids are md::Error, never a read outside the tables.
  for (int32_t bad : {-1, vocab}) {
    try {
      (void)tok.decode({bad});
      abort();
    } catch (const md::Error&) {
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::string_view ranks = take_part(in);
  std::string_view config = take_part(in);
  if (config.empty()) config = "{}";
  const std::string_view sample = in;
  std::optional<md::Tokenizer> tok;
  try {
    tok = md::Tokenizer::from_texts(ranks, config);
  } catch (const md::Error&) {
    return 0;
  }
  exercise(*tok, sample);
  return 0;
}
