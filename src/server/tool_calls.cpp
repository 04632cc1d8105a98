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

// <|tool_call_begin|>ID<|tool_call_argument_begin|>: a call's header. The template writes ID (and
// then ARGS) verbatim, so they come back verbatim (the name is ID's "functions.NAME:N" part).
Status parse_kimi_header(std::string_view s, ParsedToolCall& out, size_t& length) {
  if (const Status st = expect(s, 0, kKimiCall); st != Status::kDone) return st;
  const size_t id_at = kKimiCall.size();
  const size_t a = s.find(kKimiArgs, id_at);
  if (a == std::string_view::npos)
    return has_kimi_marker(s.substr(id_at)) ? Status::kBroken : Status::kNeedMore;
  const std::string_view id = s.substr(id_at, a - id_at);
  if (has_kimi_marker(id)) return Status::kBroken;
  std::string_view name = id;
  while (!name.empty() && is_space(name.front())) name.remove_prefix(1);
  while (!name.empty() && is_space(name.back())) name.remove_suffix(1);
  if (name.substr(0, 10) == "functions.") name.remove_prefix(10);
  if (const size_t colon = name.rfind(':'); colon != std::string_view::npos)
    name = name.substr(0, colon);
  if (name.empty()) return Status::kBroken;
  out.id = std::string(id);
  out.name = std::string(name);
  length = a + kKimiArgs.size();
  return Status::kDone;
}

// The first Kimi marker in `s` (npos: none) and its length.
size_t first_kimi_marker(std::string_view s, size_t& length) {
  size_t at = std::string_view::npos;
  for (std::string_view m : {kKimiBegin, kKimiEnd, kKimiCall, kKimiArgs, kKimiCallEnd}) {
    const size_t f = s.find(m);
    if (f < at) {
      at = f;
      length = m.size();
    }
  }
  return at;
}

// The longest suffix of `s` that may begin a Kimi marker.
size_t partial_kimi_marker(std::string_view s) {
  size_t keep = 0;
  for (std::string_view m : {kKimiBegin, kKimiEnd, kKimiCall, kKimiArgs, kKimiCallEnd})
    keep = std::max(keep, partial_marker(s, m));
  return keep;
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

// <|open|>call tool="NAME" index="N"<|sep|>: a call's header.
Status parse_k3_header(std::string_view s, ParsedToolCall& out, size_t& length) {
  Tag tag;
  if (const Status st = read_tag(s, 0, tag); st != Status::kDone) return st;
  std::vector<std::string> v;
  if (!tag.open || tag.name != "call" || !take_attrs(tag.attrs, {"tool", "index"}, v))
    return Status::kBroken;
  if (v[0].empty() || v[1].empty() ||
      !std::all_of(v[1].begin(), v[1].end(), [](char c) { return c >= '0' && c <= '9'; }))
    return Status::kBroken;
  out.name = v[0];
  length = tag.end;
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

json tool_call_piece_json(const ToolCallPiece& p) {
  json j = json::object();
  j["index"] = p.index;
  if (p.first) {
    j["id"] = p.id;
    j["type"] = "function";
    j["function"] = {{"name", p.name}, {"arguments", p.arguments}};
  } else {
    j["function"] = {{"arguments", p.arguments}};
  }
  return j;
}

void add_pieces(std::vector<ParsedToolCall>& calls, const std::vector<ToolCallPiece>& pieces) {
  for (const ToolCallPiece& p : pieces) {
    if (p.first) calls.push_back({p.id, p.name, ""});
    calls.back().arguments += p.arguments;
  }
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

// The current call's next piece of arguments (merged into the delta's last piece when that is
// the same call's).
void ToolCallStream::emit(ToolCallDelta& out, std::string_view args) {
  if (args.empty()) return;
  if (out.pieces.empty() || out.pieces.back().index != calls_ - 1)
    out.pieces.push_back({calls_ - 1, false, "", "", ""});
  out.pieces.back().arguments.append(args);
}

// The current call ends: K3's typed arguments are closed; the stream goes on in `next`.
void ToolCallStream::end_call(ToolCallDelta& out, Mode next) {
  if (format_ == TemplateKind::kKimiK3 && !raw_) emit(out, arguments_ > 0 ? "}" : "{}");
  mode_ = next;
  pos_ = 0;
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
    if (mode_ == Mode::kCall) {
      if (!(k3 ? run_k3_call(out, at_end) : run_kimi_call(out, at_end))) return;
      continue;
    }
    // In a section: the end marker, the next call's header, or more text to wait for.
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
      st = k3 ? parse_k3_header(s, call, length) : parse_kimi_header(s, call, length);
      if (st == Status::kDone) {
        if (k3) call.id = id_prefix_ + std::to_string(calls_);  // K3 carries no ids
        out.pieces.push_back({calls_, true, std::move(call.id), std::move(call.name), ""});
        ++calls_;
        buf_.erase(0, skipped + length);
        pos_ = 0;
        mode_ = Mode::kCall;
        raw_ = raw_done_ = false;
        arguments_ = 0;
        keys_.clear();
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

// Kimi: ARGS goes out as it comes, up to <|tool_call_end|> (the call ends), another marker (the
// call ends and the rest is content) or the output's end; a tail that may begin a marker waits.
bool ToolCallStream::run_kimi_call(ToolCallDelta& out, bool at_end) {
  size_t length = 0;
  const size_t m = first_kimi_marker(buf_, length);
  if (m != std::string::npos) {
    emit(out, std::string_view(buf_).substr(0, m));
    const bool closed = std::string_view(buf_).substr(m, length) == kKimiCallEnd;
    buf_.erase(0, closed ? m + length : m);
    end_call(out, closed ? Mode::kSection : Mode::kBroken);
    return true;
  }
  const size_t keep = at_end ? 0 : partial_kimi_marker(buf_);
  emit(out, std::string_view(buf_).substr(0, buf_.size() - keep));
  buf_.erase(0, buf_.size() - keep);
  if (at_end) end_call(out, Mode::kContent);
  return false;
}

// K3: each typed argument goes out once complete, as the JSON object's next member; a json
// block's text goes out as it comes (a tail that may begin <|close|> waits). Anything that cannot
// continue the call ends it, and the rest is content.
bool ToolCallStream::run_k3_call(ToolCallDelta& out, bool at_end) {
  auto broken = [&] {
    end_call(out, Mode::kBroken);
    return true;
  };
  if (raw_ && !raw_done_) {
    const size_t c = buf_.find(kClose);
    if (c == std::string::npos) {
      const size_t keep = at_end ? 0 : partial_marker(buf_, kClose);
      emit(out, std::string_view(buf_).substr(0, buf_.size() - keep));
      buf_.erase(0, buf_.size() - keep);
      if (at_end) end_call(out, Mode::kContent);
      return false;
    }
    emit(out, std::string_view(buf_).substr(0, c));
    buf_.erase(0, c);
    size_t e = 0;
    const Status st = expect_close(buf_, 0, "json", e);
    if (st == Status::kBroken) return broken();
    if (st == Status::kNeedMore) return at_end ? broken() : false;
    buf_.erase(0, e);
    raw_done_ = true;
    return true;
  }
  const size_t at = skip_space(buf_, 0);
  Tag item;
  Status st = read_tag(buf_, at, item);
  if (st == Status::kNeedMore) return at_end ? broken() : false;
  if (st == Status::kBroken) return broken();
  if (!item.open) {
    if (item.name != "call") return broken();
    buf_.erase(0, item.end);
    end_call(out, Mode::kSection);
    return true;
  }
  std::vector<std::string> v;
  if (item.name == "json") {  // one raw block, instead of typed arguments
    if (raw_ || arguments_ > 0 || !take_attrs(item.attrs, {"type"}, v) || v[0] != "object")
      return broken();
    raw_ = true;
    buf_.erase(0, item.end);
    return true;
  }
  if (item.name != "argument" || raw_ || !take_attrs(item.attrs, {"key", "type"}, v))
    return broken();
  // The value is message text up to the next <|close|>, which must close this argument.
  const size_t close = buf_.find(kClose, item.end);
  if (close == std::string::npos) return at_end ? broken() : false;
  size_t e = 0;
  st = expect_close(buf_, close, "argument", e);
  if (st == Status::kNeedMore) return at_end ? broken() : false;
  if (st == Status::kBroken) return broken();
  nlohmann::ordered_json value;
  if (std::find(keys_.begin(), keys_.end(), v[0]) != keys_.end() ||
      !argument_value(v[1], std::string_view(buf_).substr(item.end, close - item.end), value))
    return broken();
  keys_.push_back(v[0]);
  // Members as python_json_dumps writes a whole object: {"k": v, "k2": v2}.
  emit(out, (arguments_++ == 0 ? "{" : ", ") + python_json_dumps(nlohmann::ordered_json(v[0])) +
                ": " + python_json_dumps(value));
  buf_.erase(0, e);
  return true;
}

ToolCallSplit split_tool_calls(TemplateKind format, std::string_view text,
                               const std::string& id_prefix) {
  ToolCallStream s(format, id_prefix);
  ToolCallDelta a = s.feed(text), b = s.finish();
  ToolCallSplit out;
  out.content = std::move(a.content) + b.content;
  add_pieces(out.calls, a.pieces);
  add_pieces(out.calls, b.pieces);
  return out;
}

}  // namespace md::server
