// tool_choice, response_format and structured outputs as constraint programs
// (server/chat_constraints.h). The markup is the templates'
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
  // One JSON object following the schema of the name the last names() element matched (none
  // given: any object).
  Builder& json_by_name(std::vector<std::shared_ptr<const JsonSchema>> schemas) {
    ConstraintElement e;
    e.kind = Kind::kJson;
    if (std::any_of(schemas.begin(), schemas.end(), [](const auto& s) { return s != nullptr; }))
      e.schema_by_name = std::move(schemas);
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
// The declared functions' names (as written) with their arguments' schemas, sorted by name.
using NamedSchemas = std::vector<std::pair<std::string, std::shared_ptr<const JsonSchema>>>;

std::vector<std::string> names_of(const NamedSchemas& f) {
  std::vector<std::string> n;
  for (const auto& [name, schema] : f) n.push_back(name);
  return n;
}
std::vector<std::shared_ptr<const JsonSchema>> schemas_of(const NamedSchemas& f) {
  std::vector<std::shared_ptr<const JsonSchema>> s;
  for (const auto& [name, schema] : f) s.push_back(schema);
  return s;
}

std::shared_ptr<const ConstraintProgram> kimi_program(const ToolChoice& choice,
                                                      const NamedSchemas& functions,
                                                      const Tokenizer& tok,
                                                      const std::vector<int32_t>& stop_ids) {
  Builder b(tok);
  if (choice.mode == ToolChoice::Mode::kNone) {
    ConstraintElement free;
    free.kind = Kind::kFree;
    free.forbidden = {{special_symbol(b.id("<|tool_calls_section_begin|>"))},
                      {special_symbol(b.id("<|tool_call_begin|>"))}};
    return b.push(std::move(free)).done();
  }
  for (const auto& [n, schema] : functions)
    MD_CHECK(n.find(':') == std::string::npos,
             "tool_choice: the function name '{}' holds ':', which ends a name in Kimi's call ids",
             n);
  b.special("<|tool_calls_section_begin|>").special("<|tool_call_begin|>");
  const int call = b.size();  // the element after <|tool_call_begin|>
  b.text("functions.").names(names_of(functions)).text(":").kind(Kind::kDigits);
  b.special("<|tool_call_argument_begin|>").json_by_name(schemas_of(functions));
  b.special("<|tool_call_end|>");
  if (choice.mode == ToolChoice::Mode::kNamed || !choice.parallel) {  // one call
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
                                                    NamedSchemas functions, const Tokenizer& tok) {
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
  for (auto& [n, schema] : functions) n = k3_escape_attr(n);
  std::sort(functions.begin(), functions.end());
  b.special("<|open|>").text("tools").special("<|sep|>").special("<|open|>");
  const int call = b.size();  // the element after a call's <|open|>
  b.text("call tool=\"").names(names_of(functions)).text("\" index=\"").kind(Kind::kDigits);
  b.text("\"").special("<|sep|>");
  b.special("<|open|>").text("json type=\"object\"").special("<|sep|>");
  b.json_by_name(schemas_of(functions));
  b.special("<|close|>").text("json").special("<|sep|>");
  b.special("<|close|>").text("call").special("<|sep|>");
  if (choice.mode == ToolChoice::Mode::kNamed || !choice.parallel) {  // one call
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
    std::vector<std::shared_ptr<const JsonSchema>> args) {
  if (choice.mode == ToolChoice::Mode::kAuto) return nullptr;
  MD_CHECK(args.empty() || args.size() == names.size(),
           "tool_choice: {} argument schemas for {} functions", args.size(), names.size());
  args.resize(names.size());
  NamedSchemas functions;
  for (size_t i = 0; i < names.size(); ++i)
    if (choice.mode != ToolChoice::Mode::kNamed || names[i] == choice.name)
      functions.emplace_back(names[i], args[i]);
  if (choice.mode == ToolChoice::Mode::kNamed && functions.empty())
    functions.emplace_back(choice.name, nullptr);
  std::stable_sort(functions.begin(), functions.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  functions.erase(std::unique(functions.begin(), functions.end(),
                              [](const auto& a, const auto& b) { return a.first == b.first; }),
                  functions.end());
  if (choice.mode != ToolChoice::Mode::kNone)
    MD_CHECK(!functions.empty() && !functions.front().first.empty(),
             "tool_choice: no function to call");
  return format == TemplateKind::kKimiK3 ? k3_program(choice, std::move(functions), tok)
                                         : kimi_program(choice, functions, tok, stop_ids);
}

std::shared_ptr<const ConstraintProgram> structured_output_program(
    TemplateKind format, bool thinking, const Tokenizer& tok, const std::vector<int32_t>& stop_ids,
    ConstraintElement body) {
  Builder b(tok);
  if (format != TemplateKind::kKimiK3) {
    b.push(std::move(body));
    ConstraintElement stop;
    stop.kind = Kind::kStop;
    stop.stop_ids = stop_ids;
    return b.push(std::move(stop)).done();
  }
  if (thinking) {  // think freely; the answer starts where the response channel opens
    ConstraintElement free;
    free.kind = Kind::kFree;
    free.trigger = {special_symbol(b.id("<|open|>"))};
    append_text_symbols(free.trigger, "response");
    free.trigger.push_back(special_symbol(b.id("<|sep|>")));
    b.push(std::move(free));
  }
  b.push(std::move(body)).special("<|close|>").text("response").special("<|sep|>");
  return b.done();
}

std::shared_ptr<const ConstraintProgram> json_object_program(
    TemplateKind format, bool thinking, const Tokenizer& tok, const std::vector<int32_t>& stop_ids,
    std::shared_ptr<const JsonSchema> schema) {
  ConstraintElement body;
  body.kind = Kind::kJson;
  body.schema = std::move(schema);
  return structured_output_program(format, thinking, tok, stop_ids, std::move(body));
}

}  // namespace md::server
