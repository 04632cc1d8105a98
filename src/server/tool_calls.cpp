// Tool-call sections of generated chat text: a streaming parser for the Kimi Linear / K2 markup
// and Kimi K3's XTML (the rule and the formats are in tool_calls.h; docs/server.md has them too).
#include "megadecode/server/tool_calls.h"

#include <algorithm>
#include <cctype>

namespace md::server {

using nlohmann::json;

namespace {

// What a parse of the text at hand says: a complete item of `length` bytes, text that may still
// become one (wait for more), or text that cannot (the markup is broken).
enum class Status { kNeedMore, kBroken, kDone };

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

// `s[pos..]` against the literal `lit`: kDone when it starts with it, kNeedMore when it is a
// proper prefix of it (the rest is still to come), kBroken otherwise.
Status expect(std::string_view s, size_t pos, std::string_view lit) {
  const std::string_view rest = s.substr(std::min(pos, s.size()));
  if (rest.size() >= lit.size()) return rest.substr(0, lit.size()) == lit ? Status::kDone : Status::kBroken;
  return lit.substr(0, rest.size()) == rest ? Status::kNeedMore : Status::kBroken;
}

// The length of the longest suffix of `s` that is a proper prefix of `marker`: text that may be
// the start of the marker and so is held back.
size_t partial_marker(std::string_view s, std::string_view marker) {
  for (size_t k = std::min(s.size(), marker.size() - 1); k > 0; --k)
    if (s.substr(s.size() - k) == marker.substr(0, k)) return k;
  return 0;
}

// ---- Kimi Linear / K2 --------------------------------------------------------------------------

constexpr std::string_view kKimiBegin = "<|tool_calls_section_begin|>";
constexpr std::string_view kKimiEnd = "<|tool_calls_section_end|>";
constexpr std::string_view kKimiCall = "<|tool_call_begin|>";
constexpr std::string_view kKimiArgs = "<|tool_call_argument_begin|>";
constexpr std::string_view kKimiCallEnd = "<|tool_call_end|>";

bool has_kimi_marker(std::string_view s) {
  for (std::string_view m : {kKimiBegin, kKimiEnd, kKimiCall, kKimiArgs, kKimiCallEnd})
    if (s.find(m) != std::string_view::npos) return true;
  return false;
}

// <|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>: the template writes
// ID and ARGS verbatim, so they come back verbatim (the name is ID's "functions.NAME:N" part).
Status parse_kimi_call(std::string_view s, ParsedToolCall& out, size_t& length) {
  if (const Status st = expect(s, 0, kKimiCall); st != Status::kDone) return st;
  const size_t id_at = kKimiCall.size();
  const size_t a = s.find(kKimiArgs, id_at);
  if (a == std::string_view::npos)
    return has_kimi_marker(s.substr(id_at)) ? Status::kBroken : Status::kNeedMore;
  const std::string_view id = s.substr(id_at, a - id_at);
  if (has_kimi_marker(id)) return Status::kBroken;
  const size_t args_at = a + kKimiArgs.size();
  const size_t e = s.find(kKimiCallEnd, args_at);
  if (e == std::string_view::npos)
    return has_kimi_marker(s.substr(args_at)) ? Status::kBroken : Status::kNeedMore;
  const std::string_view args = s.substr(args_at, e - args_at);
  if (has_kimi_marker(args)) return Status::kBroken;
  std::string_view name = id;
  while (!name.empty() && is_space(name.front())) name.remove_prefix(1);
  while (!name.empty() && is_space(name.back())) name.remove_suffix(1);
  if (name.substr(0, 10) == "functions.") name.remove_prefix(10);
  if (const size_t colon = name.rfind(':'); colon != std::string_view::npos)
    name = name.substr(0, colon);
  if (name.empty()) return Status::kBroken;
  out.id = std::string(id);
  out.name = std::string(name);
  out.arguments = std::string(args);
  length = e + kKimiCallEnd.size();
  return Status::kDone;
}

// ---- Kimi K3 XTML ------------------------------------------------------------------------------

constexpr std::string_view kOpen = "<|open|>";
constexpr std::string_view kClose = "<|close|>";
constexpr std::string_view kSep = "<|sep|>";
constexpr std::string_view kK3Begin = "<|open|>tools<|sep|>";
constexpr std::string_view kK3End = "<|close|>tools<|sep|>";

using Attrs = std::vector<std::pair<std::string, std::string>>;

// The template's attribute escaping (escape_attr: & -> &amp;, " -> &quot;) undone. An '&' that
// starts neither stays as it is (the escaper never writes one, but a model may).
std::string unescape_attr(std::string_view v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] == '&' && v.substr(i, 5) == "&amp;") {
      out.push_back('&');
      i += 4;
    } else if (v[i] == '&' && v.substr(i, 6) == "&quot;") {
      out.push_back('"');
      i += 5;
    } else {
      out.push_back(v[i]);
    }
  }
  return out;
}

// ` key="value"` pairs, as Writer::open writes them (one space before each; more are accepted).
bool parse_attrs(std::string_view s, Attrs& out) {
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != ' ') return false;
    while (i < s.size() && s[i] == ' ') ++i;
    if (i == s.size()) break;
    const size_t k = i;
    while (i < s.size() && (std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == '_' ||
                            s[i] == '-'))
      ++i;
    if (i == k || s.substr(i, 2) != "=\"") return false;
    const std::string key(s.substr(k, i - k));
    i += 2;
    const size_t q = s.find('"', i);
    if (q == std::string_view::npos) return false;
    for (const auto& [have, v] : out)
      if (have == key) return false;  // the renderer never repeats one
    out.emplace_back(key, unescape_attr(s.substr(i, q - i)));
    i = q + 1;
  }
  return true;
}

// Exactly the attributes `names`, each once, in any order; their values in that order.
bool take_attrs(const Attrs& attrs, std::initializer_list<std::string_view> names,
                std::vector<std::string>& values) {
  if (attrs.size() != names.size()) return false;
  values.clear();
  for (std::string_view n : names) {
    const auto it = std::find_if(attrs.begin(), attrs.end(), [&](const auto& a) { return a.first == n; });
    if (it == attrs.end()) return false;
    values.push_back(it->second);
  }
  return true;
}

struct Tag {
  bool open = false;
  std::string name;
  Attrs attrs;
  size_t end = 0;  // just past its <|sep|>
};

// <|open|>NAME ATTRS<|sep|> or <|close|>NAME<|sep|> at `pos`, as XtmlChannels shows them.
Status read_tag(std::string_view s, size_t pos, Tag& t) {
  const Status o = expect(s, pos, kOpen), c = expect(s, pos, kClose);
  if (o == Status::kNeedMore || c == Status::kNeedMore) return Status::kNeedMore;
  if (o == Status::kBroken && c == Status::kBroken) return Status::kBroken;
  t.open = o == Status::kDone;
  const size_t text_at = pos + (t.open ? kOpen : kClose).size();
  const size_t sep = s.find(kSep, text_at);
  const std::string_view text =
      s.substr(text_at, sep == std::string_view::npos ? std::string_view::npos : sep - text_at);
  // A tag's text never holds markup; a partial <|sep|> at the end may still complete.
  const size_t markup = text.find("<|");
  if (sep == std::string_view::npos)
    return markup == std::string_view::npos || markup + partial_marker(text, kSep) == text.size()
               ? Status::kNeedMore
               : Status::kBroken;
  if (markup != std::string_view::npos) return Status::kBroken;
  const size_t space = text.find(' ');
  t.name = std::string(text.substr(0, space));
  t.attrs.clear();
  if (space != std::string_view::npos && !parse_attrs(text.substr(space), t.attrs))
    return Status::kBroken;
  if (!t.open && !t.attrs.empty()) return Status::kBroken;
  t.end = sep + kSep.size();
  return Status::kDone;
}

// <|close|>NAME<|sep|> at `pos`.
Status expect_close(std::string_view s, size_t pos, std::string_view name, size_t& end) {
  Tag t;
  const Status st = read_tag(s, pos, t);
  if (st != Status::kDone) return st;
  if (t.open || t.name != name) return Status::kBroken;
  end = t.end;
  return Status::kDone;
}

size_t skip_space(std::string_view s, size_t pos) {
  while (pos < s.size() && is_space(s[pos])) ++pos;
  return pos;
}

// An <argument>'s text as the JSON value of its type: a string as it is, the others as the JSON
// text the renderer wrote (python_json_dumps), of the declared type. Nesting is bounded as the
// renderer bounds it.
bool argument_value(std::string_view type, std::string_view text, nlohmann::ordered_json& out) {
  if (type == "string") {
    out = std::string(text);
    return true;
  }
  constexpr int kMaxDepth = 512;
  bool too_deep = false;
  const auto check_depth = [&](int depth, nlohmann::ordered_json::parse_event_t,
                               nlohmann::ordered_json&) {
    too_deep = too_deep || depth > kMaxDepth;
    return !too_deep;
  };
  try {
    out = nlohmann::ordered_json::parse(text.begin(), text.end(), check_depth);
  } catch (const json::exception&) {  // not JSON, or a number beyond the double range
    return false;
  }
  if (too_deep) return false;
  switch (out.type()) {
    case json::value_t::boolean:
      return type == "boolean";
    case json::value_t::null:
      return type == "null";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float:
      return type == "number";
    case json::value_t::object:
      return type == "object";
    case json::value_t::array:
      return type == "array";
    default:  // a string needs type="string"; binary and discarded never come from text
      return false;
  }
}

// <|open|>call tool="NAME" index="N"<|sep|> (typed arguments | one json block)
// <|close|>call<|sep|>
Status parse_k3_call(std::string_view s, ParsedToolCall& out, size_t& length) {
  Tag tag;
  if (const Status st = read_tag(s, 0, tag); st != Status::kDone) return st;
  std::vector<std::string> v;
  if (!tag.open || tag.name != "call" || !take_attrs(tag.attrs, {"tool", "index"}, v))
    return Status::kBroken;
  if (v[0].empty() || v[1].empty() ||
      !std::all_of(v[1].begin(), v[1].end(), [](char c) { return c >= '0' && c <= '9'; }))
    return Status::kBroken;
  out.name = v[0];
  nlohmann::ordered_json args = nlohmann::ordered_json::object();
  std::optional<std::string> raw;  // a json block's text
  size_t pos = tag.end;
  for (;;) {
    pos = skip_space(s, pos);
    Tag item;
    if (const Status st = read_tag(s, pos, item); st != Status::kDone) return st;
    if (!item.open) {
      if (item.name != "call") return Status::kBroken;
      length = item.end;
      break;
    }
    // Typed arguments or a single raw json block, never both (render_assistant writes one kind).
    const bool argument = item.name == "argument";
    if (raw || (!argument && item.name != "json") || (!argument && !args.empty()))
      return Status::kBroken;
    if (argument ? !take_attrs(item.attrs, {"key", "type"}, v) : !take_attrs(item.attrs, {"type"}, v))
      return Status::kBroken;
    // The value is message text up to the next <|close|>, which must close this item.
    const size_t value_at = item.end;
    const size_t close = s.find(kClose, value_at);
    if (close == std::string_view::npos) return Status::kNeedMore;
    size_t end = 0;
    if (const Status st = expect_close(s, close, item.name, end); st != Status::kDone) return st;
    const std::string_view text = s.substr(value_at, close - value_at);
    if (argument) {
      nlohmann::ordered_json value;
      if (args.contains(v[0]) || !argument_value(v[1], text, value)) return Status::kBroken;
      args[v[0]] = std::move(value);
    } else {
      if (v[0] != "object") return Status::kBroken;
      raw = std::string(text);
    }
    pos = end;
  }
  out.arguments = raw ? *raw : python_json_dumps(args);
  return Status::kDone;
}

}  // namespace

json tool_call_json(const ParsedToolCall& call, std::optional<size_t> index) {
  json j = json::object();
  if (index) j["index"] = *index;
  j["id"] = call.id;
  j["type"] = "function";
  j["function"] = {{"name", call.name}, {"arguments", call.arguments}};
  return j;
}

ToolCallStream::ToolCallStream(TemplateKind format, std::string id_prefix)
    : format_(format), id_prefix_(std::move(id_prefix)) {}

ToolCallDelta ToolCallStream::feed(std::string_view text) {
  ToolCallDelta out;
  buf_.append(text);
  run(out, false);
  return out;
}

ToolCallDelta ToolCallStream::finish() {
  ToolCallDelta out;
  run(out, true);
  return out;
}

void ToolCallStream::run(ToolCallDelta& out, bool at_end) {
  const bool k3 = format_ == TemplateKind::kKimiK3;
  const std::string_view begin = k3 ? kK3Begin : kKimiBegin, end = k3 ? kK3End : kKimiEnd;
  for (;;) {
    if (mode_ == Mode::kBroken) {
      out.content += buf_;
      buf_.clear();
      return;
    }
    if (mode_ == Mode::kContent) {
      const size_t b = buf_.find(begin);
      if (b != std::string::npos) {
        out.content.append(buf_, 0, b);
        buf_.erase(0, b);
        pos_ = begin.size();
        mode_ = Mode::kSection;
        continue;
      }
      const size_t keep = at_end ? 0 : partial_marker(buf_, begin);
      out.content.append(buf_, 0, buf_.size() - keep);
      buf_.erase(0, buf_.size() - keep);
      return;
    }
    // In a section: the end marker, the next call, or more text to wait for.
    const std::string_view s = std::string_view(buf_).substr(skip_space(buf_, pos_));
    const size_t skipped = buf_.size() - s.size();
    Status st = s.empty() ? Status::kNeedMore : expect(s, 0, end);
    if (st == Status::kDone) {
      buf_.erase(0, skipped + end.size());
      pos_ = 0;
      mode_ = Mode::kContent;
      continue;
    }
    if (st == Status::kBroken) {
      ParsedToolCall call;
      size_t length = 0;
      st = k3 ? parse_k3_call(s, call, length) : parse_kimi_call(s, call, length);
      if (st == Status::kDone) {
        if (k3) call.id = id_prefix_ + std::to_string(calls_);  // K3 carries no ids
        out.calls.push_back(std::move(call));
        ++calls_;
        buf_.erase(0, skipped + length);
        pos_ = 0;
        continue;
      }
    }
    if (st == Status::kBroken || at_end) {
      mode_ = Mode::kBroken;
      continue;
    }
    return;  // kNeedMore
  }
}

ToolCallSplit split_tool_calls(TemplateKind format, std::string_view text,
                               const std::string& id_prefix) {
  ToolCallStream s(format, id_prefix);
  ToolCallDelta a = s.feed(text), b = s.finish();
  ToolCallSplit out;
  out.content = std::move(a.content) + b.content;
  out.calls = std::move(a.calls);
  for (auto& c : b.calls) out.calls.push_back(std::move(c));
  return out;
}

}  // namespace md::server
