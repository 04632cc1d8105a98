// tool_choice and response_format as constraint programs (server/chat_constraints.h). The markup is the templates'
// (src/tokenizer/chat_template.cpp, chat_template_k3.cpp), element for element, so that
// split_tool_calls parses what the constraint lets through.
#include "megadecode/server/chat_constraints.h"

#include <fmt/format.h>

#include <algorithm>

#include "megadecode/base/error.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace md::server {

namespace {

using Kind = ConstraintElement::Kind;

class Builder {
 public:
  explicit Builder(const Tokenizer& tok) : tok_(tok) {}
  int32_t id(std::string_view marker) const {
    const std::optional<int32_t> v = tok_.special_id(marker);
    MD_CHECK(v.has_value(), "tool_choice: the tokenizer has no {} token to write tool calls with",
             marker);
    return *v;
  }
  int size() const { return int(el_.size()); }
  Builder& special(std::string_view marker) {
    ConstraintElement e;
    e.kind = Kind::kSpecial;
    e.special = id(marker);
    return push(std::move(e));
  }
  Builder& text(std::string t) {
    ConstraintElement e;
    e.kind = Kind::kText;
    e.text = std::move(t);
    return push(std::move(e));
  }
  Builder& names(std::vector<std::string> n) {
    ConstraintElement e;
    e.kind = Kind::kName;
    e.names = std::move(n);
    return push(std::move(e));
  }
  Builder& kind(Kind k) {
    ConstraintElement e;
    e.kind = k;
    return push(std::move(e));
  }
  // One JSON object, following `schema` when there is one.
  Builder& json(std::shared_ptr<const JsonSchema> schema) {
    ConstraintElement e;
    e.kind = Kind::kJson;
    e.schema = std::move(schema);
    return push(std::move(e));
  }
  Builder& branch(std::vector<std::pair<int32_t, int>> b) {
    ConstraintElement e;
    e.kind = Kind::kBranch;
    e.branches = std::move(b);
    return push(std::move(e));
  }
  Builder& push(ConstraintElement e) {
    el_.push_back(std::move(e));
    return *this;
  }
  std::shared_ptr<const ConstraintProgram> done() {
    return std::make_shared<const ConstraintProgram>(std::move(el_));
  }

 private:
  const Tokenizer& tok_;
  std::vector<ConstraintElement> el_;
};

// <|tool_calls_section_begin|> (<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>
// JSON <|tool_call_end|>)+ <|tool_calls_section_end|>, then a stop id.
std::shared_ptr<const ConstraintProgram> kimi_program(const ToolChoice& choice,
                                                      std::vector<std::string> names,
                                                      const Tokenizer& tok,
                                                      const std::vector<int32_t>& stop_ids,
                                                      std::shared_ptr<const JsonSchema> args) {
  Builder b(tok);
  if (choice.mode == ToolChoice::Mode::kNone) {
    ConstraintElement free;
    free.kind = Kind::kFree;
    free.forbidden = {{special_symbol(b.id("<|tool_calls_section_begin|>"))},
                      {special_symbol(b.id("<|tool_call_begin|>"))}};
    return b.push(std::move(free)).done();
  }
  for (const std::string& n : names)
    MD_CHECK(n.find(':') == std::string::npos,
             "tool_choice: the function name '{}' holds ':', which ends a name in Kimi's call ids",
             n);
  b.special("<|tool_calls_section_begin|>").special("<|tool_call_begin|>");
  const int call = b.size();  // the element after <|tool_call_begin|>
  b.text("functions.").names(std::move(names)).text(":").kind(Kind::kDigits);
  b.special("<|tool_call_argument_begin|>").json(std::move(args)).special("<|tool_call_end|>");
  if (choice.mode == ToolChoice::Mode::kNamed) {
    b.special("<|tool_calls_section_end|>");
  } else {
    const int end = b.size() + 1;
    b.branch({{b.id("<|tool_call_begin|>"), call}, {b.id("<|tool_calls_section_end|>"), end}});
  }
  ConstraintElement stop;
  stop.kind = Kind::kStop;
  stop.stop_ids = stop_ids;
  return b.push(std::move(stop)).done();
}

// After <|close|>response<|sep|>: <|open|>tools<|sep|> (<|open|>call tool="NAME" index="N"<|sep|>
// <|open|>json type="object"<|sep|>JSON<|close|>json<|sep|><|close|>call<|sep|>)+
// <|close|>tools<|sep|>; the message's end is the model's.
std::shared_ptr<const ConstraintProgram> k3_program(const ToolChoice& choice,
                                                    std::vector<std::string> names,
                                                    const Tokenizer& tok,
                                                    std::shared_ptr<const JsonSchema> args) {
  Builder b(tok);
  const int32_t open = b.id("<|open|>"), close = b.id("<|close|>"), sep = b.id("<|sep|>");
  ConstraintElement free;
  free.kind = Kind::kFree;
  if (choice.mode == ToolChoice::Mode::kNone) {
    std::vector<ConstraintSymbol> p = {special_symbol(open)};
    append_text_symbols(p, "tools");
    free.forbidden = {std::move(p)};
    return b.push(std::move(free)).done();
  }
  free.trigger = {special_symbol(close)};
  append_text_symbols(free.trigger, "response");
  free.trigger.push_back(special_symbol(sep));
  b.push(std::move(free));
  for (std::string& n : names) n = k3_escape_attr(n);
  std::sort(names.begin(), names.end());
  b.special("<|open|>").text("tools").special("<|sep|>").special("<|open|>");
  const int call = b.size();  // the element after a call's <|open|>
  b.text("call tool=\"").names(std::move(names)).text("\" index=\"").kind(Kind::kDigits);
  b.text("\"").special("<|sep|>");
  b.special("<|open|>").text("json type=\"object\"").special("<|sep|>").json(std::move(args));
  b.special("<|close|>").text("json").special("<|sep|>");
  b.special("<|close|>").text("call").special("<|sep|>");
  if (choice.mode == ToolChoice::Mode::kNamed) {
    b.special("<|close|>");
  } else {
    const int end = b.size() + 1;
    b.branch({{open, call}, {close, end}});
  }
  b.text("tools").special("<|sep|>");
  return b.done();
}

}  // namespace

std::shared_ptr<const ConstraintProgram> tool_choice_program(
    TemplateKind format, const ToolChoice& choice, std::vector<std::string> names,
    const Tokenizer& tok, const std::vector<int32_t>& stop_ids,
    std::shared_ptr<const JsonSchema> args) {
  if (choice.mode == ToolChoice::Mode::kAuto) return nullptr;
  if (choice.mode == ToolChoice::Mode::kNamed) names = {choice.name};
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  if (choice.mode != ToolChoice::Mode::kNone)
    MD_CHECK(!names.empty() && !names.front().empty(), "tool_choice: no function to call");
  if (names.size() != 1) args = nullptr;  // the schema is the one function's
  return format == TemplateKind::kKimiK3
             ? k3_program(choice, std::move(names), tok, std::move(args))
             : kimi_program(choice, std::move(names), tok, stop_ids, std::move(args));
}

std::shared_ptr<const ConstraintProgram> json_object_program(
    TemplateKind format, bool thinking, const Tokenizer& tok, const std::vector<int32_t>& stop_ids,
    std::shared_ptr<const JsonSchema> schema) {
  Builder b(tok);
  if (format != TemplateKind::kKimiK3) {
    b.json(schema);
    ConstraintElement stop;
    stop.kind = Kind::kStop;
    stop.stop_ids = stop_ids;
    return b.push(std::move(stop)).done();
  }
  if (thinking) {  // think freely; the JSON starts where the response channel opens
    ConstraintElement free;
    free.kind = Kind::kFree;
    free.trigger = {special_symbol(b.id("<|open|>"))};
    append_text_symbols(free.trigger, "response");
    free.trigger.push_back(special_symbol(b.id("<|sep|>")));
    b.push(std::move(free));
  }
  b.json(std::move(schema)).special("<|close|>").text("response").special("<|sep|>");
  return b.done();
}

}  // namespace md::server
