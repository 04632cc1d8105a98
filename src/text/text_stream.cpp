#include "megadecode/text/text_stream.h"

namespace md {

TokenTextStream::TokenTextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                                 std::span<const int32_t> prompt)
    : dec_(tokenizer, /*skip_special=*/true), stops_(std::move(stop_strings)), xtml_(tokenizer) {
  std::string ignored;
  for (int32_t id : prompt) xtml_.feed(id, ignored);
}

void TokenTextStream::route(XtmlChannels::Channel channel, const std::string& piece,
                            TextDelta& out) {
  if (piece.empty()) return;
  if (channel == XtmlChannels::Channel::kThink) {
    out.reasoning += piece;  // stop strings apply to the answer only
    return;
  }
  StopMatcher::Result r = stops_.feed(piece);
  out.text += r.text;
  out.stopped = out.stopped || r.stopped;
}

TextDelta TokenTextStream::push(int32_t id) {
  TextDelta d;
  std::string shown;
  const XtmlChannels::Channel before = xtml_.channel();
  if (xtml_.feed(id, shown)) {
    // Markup: what the decoder held back (part of a character) belongs to the channel before it.
    route(before, dec_.flush(), d);
    if (!d.stopped) route(xtml_.channel(), shown, d);
  } else {
    route(xtml_.channel(), dec_.push(id), d);
  }
  return d;
}

TextDelta TokenTextStream::finish() {
  TextDelta d;
  route(xtml_.channel(), dec_.flush(), d);
  if (!stops_.stopped()) d.text += stops_.flush();
  return d;
}

}  // namespace md
