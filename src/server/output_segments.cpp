#include "megadecode/server/output_segments.h"

#include <utility>

namespace md::server {

OutputSegments::OutputSegments(Sink& sink, bool tools, TemplateKind format, std::string id_prefix)
    : sink_(sink) {
  if (tools) tools_.emplace(format, std::move(id_prefix));
}

void OutputSegments::start(Kind kind, const ToolCallPiece* call) {
  if (open_ != Kind::kNone) sink_.end(open_, false);
  open_ = kind;
  text_.clear();
  if (kind == Kind::kCall) ++calls_;
  sink_.begin(kind, call);
}

void OutputSegments::piece(Kind kind, const std::string& text, std::vector<TokenLogprob> lps) {
  if (text.empty()) return;
  if (open_ != kind) start(kind, nullptr);
  text_ += text;
  sink_.delta(kind, text, std::move(lps));
}

// Answer text through the tool-call parser: content, then the calls' pieces (a call's first
// piece starts its segment).
void OutputSegments::content(ToolCallDelta d) {
  if (!d.content.empty()) piece(Kind::kText, d.content, std::exchange(pending_lps_, {}));
  for (const ToolCallPiece& p : d.pieces) {
    if (p.first) start(Kind::kCall, &p);
    if (open_ != Kind::kCall || p.arguments.empty()) continue;
    text_ += p.arguments;
    sink_.delta(Kind::kCall, p.arguments, {});
  }
  if (!d.pieces.empty()) pending_lps_.clear();  // the calls' tokens: not answer text
}

void OutputSegments::add(ChoiceEvent& e) {
  for (TokenLogprob& l : e.logprobs) pending_lps_.push_back(std::move(l));
  if (!e.reasoning.empty()) {
    piece(Kind::kReasoning, e.reasoning, {});
    if (e.text.empty()) reasoning_tokens_ += int64_t(e.tokens.size());
    pending_lps_.clear();  // the think channel's tokens: not answer text
  }
  if (tools_) {
    content(tools_->feed(e.text));
  } else {
    ToolCallDelta d;
    d.content = std::move(e.text);
    content(std::move(d));
  }
  if (!e.error.empty()) error_ = e.error;
  if (e.finish_reason) {
    finish_reason_ = *e.finish_reason;
    stop_string_ = e.stop_string;
  }
  if (e.finish_reason || !e.error.empty()) {
    prompt_tokens_ = e.prompt_tokens;
    completion_tokens_ = e.completion_tokens;
    cached_tokens_ = e.cached_tokens;
    if (tools_) content(tools_->finish());
  }
}

void OutputSegments::finish() {
  if (finished_) return;
  finished_ = true;
  if (open_ != Kind::kNone) sink_.end(open_, finish_reason_ == "length");
  open_ = Kind::kNone;
}

}  // namespace md::server
