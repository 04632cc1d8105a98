// Generated ids -> text that is safe to show, one token at a time: complete UTF-8 only, nothing
// that could still be the start of a stop string, and for Kimi K3 output the think channel kept
// apart from the answer. Generator streams through it; the server keeps one per sequence.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "megadecode/engine/sampler.h"
#include "megadecode/text/generator.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace md {

struct TextDelta {
  std::string text;       // answer text released by this token (stop strings removed)
  std::string reasoning;  // Kimi K3 think-channel text released by this token
  bool stopped = false;   // a stop string completed: the generation ends at this token
};

class TokenTextStream {
 public:
  // `prompt`: the ids before the first generated one (the channel a Kimi K3 generation prompt
  // leaves open decides where the first text goes).
  TokenTextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                  std::span<const int32_t> prompt);
  // One generated id that is not a stop token. After a stop string, nothing more is released.
  TextDelta push(int32_t id);
  // The generation ended without a stop string completing (or after one): releases what was
  // held back (an incomplete character, text that could have begun a stop string).
  TextDelta finish();
  bool stopped() const { return stops_.stopped(); }
  const std::string& stop_string() const { return stops_.matched(); }  // empty: none completed

 private:
  void route(XtmlChannels::Channel channel, const std::string& piece, TextDelta& out);
  StreamDecoder dec_;
  StopMatcher stops_;
  XtmlChannels xtml_;
};

}  // namespace md
