// JSON Schema for constrained decoding (engine/json_schema.h): the compiler into nodes and the
// cursor's events.
#include "megadecode/engine/json_schema.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "json_schema_all_of.h"
#include "megadecode/base/error.h"

namespace md {

using nlohmann::json;

namespace {

uint8_t kind_of_byte(uint8_t b) {
  switch (b) {
    case '{':
      return kJsonObject;
    case '[':
      return kJsonArray;
    case '"':
      return kJsonString;
    case 't':
    case 'f':
      return kJsonBool;
    case 'n':
      return kJsonNull;
    default:
      return b == '-' || (b >= '0' && b <= '9') ? kJsonNumber : 0;
  }
}

uint8_t kind_of_value(const json& v) {
  if (v.is_object()) return kJsonObject;
  if (v.is_array()) return kJsonArray;
  if (v.is_string()) return kJsonString;
  if (v.is_number()) return kJsonNumber;
  if (v.is_boolean()) return kJsonBool;
  return kJsonNull;
}

constexpr size_t kMaxNodes = 4096;
constexpr size_t kMaxMembers = 64;  // bits of the cursor's masks

// ---- numeric bounds ----------------------------------------------------------------------------
// A bounded number's text so far (sign, integer digits, '.', fraction digits; no exponent) can
// still become any value of a union of intervals; a byte is allowed when one of them meets the
// node's range. Integer nodes take the integers of those intervals.

// [lo, hi] with each end open or closed.
struct Interval {
  double lo, hi;
  bool lo_open, hi_open;
};

// Whether the interval has a value in the node's range (integers only for an integer node).
bool meets(const JsonSchema::Node& n, Interval v) {
  if (n.minimum > v.lo) {
    v.lo = n.minimum;
    v.lo_open = n.min_exclusive;
  } else if (n.minimum == v.lo) {
    v.lo_open = v.lo_open || n.min_exclusive;
  }
  if (n.maximum < v.hi) {
    v.hi = n.maximum;
    v.hi_open = n.max_exclusive;
  } else if (n.maximum == v.hi) {
    v.hi_open = v.hi_open || n.max_exclusive;
  }
  if (n.integer) {
    // The smallest and largest integers inside (exact below 2^53, where bounds live in practice),
    // and with multipleOf the smallest multiple from the smallest integer on.
    double a = v.lo_open && std::floor(v.lo) == v.lo ? v.lo + 1 : std::ceil(v.lo);
    const double b = v.hi_open && std::floor(v.hi) == v.hi ? v.hi - 1 : std::floor(v.hi);
    if (n.multiple_of > 0 && std::isfinite(a)) a = std::ceil(a / n.multiple_of) * n.multiple_of;
    return a <= b;
  }
  return v.lo < v.hi || (v.lo == v.hi && !v.lo_open && !v.hi_open);
}

// Whether a number starting with text t (a valid JSON number prefix without exponent) can end in
// the node's range.
bool number_prefix_viable(const JsonSchema::Node& n, std::string_view t) {
  const bool neg = !t.empty() && t[0] == '-';
  if (neg) t.remove_prefix(1);
  const size_t dot = t.find('.');
  const std::string_view ip = t.substr(0, dot);
  // A magnitude interval [a, b), as the value's interval (negated for a negative sign).
  auto test = [&](double a, double b, bool b_closed) {
    return neg ? meets(n, {-b, -a, !b_closed, false}) : meets(n, {a, b, false, !b_closed});
  };
  if (ip.empty()) return test(0, HUGE_VAL, false);  // "-": any magnitude
  const double v = std::strtod(std::string(ip).c_str(), nullptr);
  if (dot != std::string_view::npos) {
    // Fraction digits f so far: the value is w and may grow by less than 10^-f.
    const std::string_view fp = t.substr(dot + 1);
    const double w = std::strtod(std::string(t).c_str(), nullptr);
    return test(w, w + std::pow(10.0, -double(fp.size())), false);
  }
  if (ip == "0") return n.integer ? test(0, 0, true) : test(0, 1, false);
  // More integer digits (j of them) and maybe a fraction: [v 10^j, (v + 1) 10^j), the values
  // growing away from zero on the sign's side. Unbounded there: long enough is in range.
  if (std::isinf(neg ? n.minimum : n.maximum)) return true;
  const double reach = neg ? -n.minimum : n.maximum;
  for (double scale = 1; v * scale <= reach; scale *= 10)
    if (test(v * scale, (v + 1) * scale, false)) return true;
  return false;
}

bool number_in_range(const JsonSchema::Node& n, std::string_view t) {
  const double x = std::strtod(std::string(t).c_str(), nullptr);
  return meets(n, {x, x, false, false});
}

// The pattern of a format (RFC 3339 for the times: the offset is required; JSON Schema's
// definitions), or "" for a format that stays an annotation.
std::string format_pattern(const std::string& format) {
  const std::string date = R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]))";
  const std::string time =
      R"(([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d))";
  const std::string octet = R"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d))";
  if (format == "date") return "^" + date + "$";
  if (format == "time") return "^" + time + "$";
  if (format == "date-time") return "^" + date + "[Tt]" + time + "$";
  if (format == "uuid")
    return R"(^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$)";
  if (format == "ipv4") return "^(" + octet + R"(\.){3})" + octet + "$";
  if (format == "email")
    return R"(^[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+$)";
  return "";
}

}  // namespace

// Schema -> nodes, depth first; $ref targets compiled once (recursion through them allowed).
class JsonSchemaCompiler {
 public:
  explicit JsonSchemaCompiler(const json& root) : root_(root) {}

  std::shared_ptr<const JsonSchema> run() {
    auto out = std::make_shared<JsonSchema>();
    s_ = out.get();
    s_->nodes_.emplace_back();  // the root is node 0
    fill(0, root_, "");
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& where, const std::string& why) const {
    throw Error(fmt::format("json schema at '#{}': {}", where, why));
  }

  int add() {
    if (s_->nodes_.size() >= kMaxNodes) fail("", "more than 4096 schema nodes");
    s_->nodes_.emplace_back();
    return int(s_->nodes_.size()) - 1;
  }

  // The schema at `ref` ("#", "#/$defs/NAME", "#/definitions/NAME"); null: none of these.
  const json* ref_target(const std::string& ref) const {
    if (ref == "#") return &root_;
    for (const char* base : {"#/$defs/", "#/definitions/"}) {
      const std::string b = base;
      if (ref.rfind(b, 0) == 0) {
        const std::string key = b.substr(2, b.size() - 3), name = ref.substr(b.size());
        if (root_.contains(key) && root_[key].is_object() && root_[key].contains(name))
          return &root_[key][name];
      }
    }
    return nullptr;
  }

  // The node of the schema at `ref`.
  int ref_node(const std::string& ref, const std::string& where) {
    if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
    if (ref == "#") return 0;
    const json* target = ref_target(ref);
    if (!target)
      fail(where,
           fmt::format(
               "$ref '{}' is not '#', '#/$defs/NAME' or '#/definitions/NAME' of this schema", ref));
    const int n = add();
    refs_[ref] = n;
    fill(n, *target, ref.substr(1));
    return n;
  }

  // A child schema as a node of its own ($ref: the target's node; keywords beside a $ref are not
  // merged into it).
  int child(const json& v, const std::string& where) {
    if (v.is_object() && v.contains("$ref")) {
      if (!v["$ref"].is_string()) fail(where, "$ref must be a string");
      return ref_node(v["$ref"].get<std::string>(), where);
    }
    const int n = add();
    fill(n, v, where);
    return n;
  }

  void fill(int n, const json& v, const std::string& where) {
    if (v.is_boolean()) {
      if (!v.get<bool>()) fail(where, "the schema 'false' allows no value");
      return;  // true: any value
    }
    if (!v.is_object()) fail(where, "a schema must be an object or a boolean");
    if (v.contains("allOf") && !v.contains("$ref")) {
      const json merged = detail::merge_all_of(
          v, where, [this](const std::string& ref) { return ref_target(ref); });
      fill(n, merged, where);
      return;
    }
    JsonSchema::Node node;
    if (v.contains("$ref")) {
      // $ref beside other keywords: the reference alone decides (they are not merged).
      if (!v["$ref"].is_string()) fail(where + "/$ref", "$ref must be a string");
      const int r = ref_node(v["$ref"].get<std::string>(), where + "/$ref");
      if (r != n) s_->nodes_[size_t(n)] = s_->nodes_[size_t(r)];  // (the root as a reference)
      return;
    }
    if (v.contains("type")) {
      const json& t = v["type"];
      node.kinds = 0;
      auto one = [&](const json& name) {
        if (!name.is_string()) fail(where + "/type", "a type must be a string");
        const std::string s = name.get<std::string>();
        if (s == "object")
          node.kinds |= kJsonObject;
        else if (s == "array")
          node.kinds |= kJsonArray;
        else if (s == "string")
          node.kinds |= kJsonString;
        else if (s == "number")
          node.kinds |= kJsonNumber, number_ = true;
        else if (s == "integer")
          node.kinds |= kJsonNumber, integer_ = true;
        else if (s == "boolean")
          node.kinds |= kJsonBool;
        else if (s == "null")
          node.kinds |= kJsonNull;
        else
          fail(where + "/type", fmt::format("unknown type '{}'", s));
      };
      number_ = integer_ = false;
      if (t.is_array()) {
        for (const json& x : t) one(x);
      } else {
        one(t);
      }
      node.integer = integer_ && !number_;
      if (node.kinds == 0) fail(where + "/type", "an empty list of types allows no value");
    }
    if (v.contains("properties")) {
      const json& props = v["properties"];
      if (!props.is_object()) fail(where + "/properties", "'properties' must be an object");
      if (props.size() > kMaxMembers) fail(where + "/properties", "more than 64 properties");
      std::vector<std::pair<std::string, std::string>> named;  // (written name, key)
      for (const auto& [key, sub] : props.items()) {
        const std::string quoted = json(key).dump();
        named.emplace_back(quoted.substr(1, quoted.size() - 2), key);
      }
      std::sort(named.begin(), named.end());
      for (const auto& [written, key] : named) {
        node.names.push_back(written);
        node.members.push_back(-1);
      }
      // Members compiled after the node is stored (children may refer back to it).
      s_->nodes_[size_t(n)] = node;
      std::vector<int> members;
      for (const auto& [written, key] : named)
        members.push_back(child(props[key], where + "/properties/" + key));
      node.members = members;
      if (v.contains("required")) {
        const json& req = v["required"];
        if (!req.is_array()) fail(where + "/required", "'required' must be a list of names");
        for (const json& r : req) {
          if (!r.is_string()) fail(where + "/required", "'required' must be a list of names");
          const std::string q = json(r.get<std::string>()).dump();
          const std::string w = q.substr(1, q.size() - 2);
          const auto it = std::lower_bound(node.names.begin(), node.names.end(), w);
          if (it == node.names.end() || *it != w)
            fail(where + "/required",
                 fmt::format("required '{}' is not among the properties", r.get<std::string>()));
          node.required |= uint64_t(1) << (it - node.names.begin());
        }
      }
    } else if (v.contains("required") && v["required"].is_array() && !v["required"].empty()) {
      fail(where + "/required", "'required' names members without 'properties' to write them by");
    }
    if (v.contains("additionalProperties")) {
      const json& a = v["additionalProperties"];
      node.additional = !(a.is_boolean() && !a.get<bool>());
      if (a.is_object()) {  // other keys' values follow it
        s_->nodes_[size_t(n)] = node;
        node.additional_node = child(a, where + "/additionalProperties");
      }
    }
    auto count = [&](const char* key, uint32_t& out) {
      if (!v.contains(key)) return;
      const json& x = v[key];
      if (!x.is_number_integer() || x.get<int64_t>() < 0)
        fail(where + "/" + key, fmt::format("'{}' must be a non-negative integer", key));
      out = uint32_t(std::min<int64_t>(x.get<int64_t>(), UINT32_MAX - 1));
    };
    bounds(node, v, where);
    pattern(node, v, where);
    count("minItems", node.min_items);
    count("maxItems", node.max_items);
    count("minLength", node.min_length);
    count("maxLength", node.max_length);
    if (node.min_items > node.max_items) fail(where, "minItems is above maxItems");
    if (node.min_length > node.max_length) fail(where, "minLength is above maxLength");
    if (v.contains("prefixItems")) {
      const json& pre = v["prefixItems"];
      if (!pre.is_array()) fail(where + "/prefixItems", "'prefixItems' must be a list of schemas");
      if (pre.size() > kMaxMembers) fail(where + "/prefixItems", "more than 64 prefixItems");
      s_->nodes_[size_t(n)] = node;
      std::vector<int> prefix;
      for (size_t i = 0; i < pre.size(); ++i)
        prefix.push_back(child(pre[i], where + "/prefixItems/" + std::to_string(i)));
      node.prefix = prefix;
    }
    if (v.contains("items")) {
      const json& it = v["items"];
      if (it.is_boolean() && !it.get<bool>()) {
        // No element past the prefix.
        node.max_items = std::min<uint32_t>(node.max_items, uint32_t(node.prefix.size()));
        if (node.min_items > node.max_items) fail(where, "minItems is above the prefixItems");
      } else if (!it.is_boolean()) {
        s_->nodes_[size_t(n)] = node;
        node.items = child(it, where + "/items");
      }
    }
    auto literal = [&](const json& x, const std::string& at) {
      if (x.is_object() || x.is_array()) fail(at, "enum / const values must be scalars");
      node.literals.push_back(x.dump());
    };
    if (v.contains("const")) literal(v["const"], where + "/const");
    if (v.contains("enum")) {
      const json& e = v["enum"];
      if (!e.is_array() || e.empty()) fail(where + "/enum", "'enum' must be a non-empty list");
      if (e.size() > kMaxMembers) fail(where + "/enum", "more than 64 values");
      for (size_t i = 0; i < e.size(); ++i) literal(e[i], where + "/enum/" + std::to_string(i));
    }
    if (!node.literals.empty()) {
      // Keep the ones the type allows.
      std::vector<std::string> kept;
      for (const std::string& l : node.literals) {
        const json x = json::parse(l);
        const uint8_t k = kind_of_value(x);
        if (!(node.kinds & k)) continue;
        if (k == kJsonNumber && node.integer && !x.is_number_integer()) continue;
        kept.push_back(l);
      }
      if (kept.empty()) fail(where, "no enum / const value has an allowed type");
      std::sort(kept.begin(), kept.end());
      kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
      node.literals = kept;
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!v.contains(key)) continue;
      const json& alts = v[key];
      const std::string at = where + "/" + key;
      if (!alts.is_array() || alts.empty())
        fail(at, fmt::format("'{}' must be a non-empty list", key));
      if (!node.alt.empty()) fail(at, "both anyOf and oneOf");
      node.alt.assign(6, -1);
      s_->nodes_[size_t(n)] = node;
      uint8_t covered = 0;
      for (size_t i = 0; i < alts.size(); ++i) {
        const int c = child(alts[i], at + "/" + std::to_string(i));
        // The kinds this alternative takes (its literals' kinds when it is an enum).
        uint8_t kinds = s_->nodes_[size_t(c)].kinds;
        if (!s_->nodes_[size_t(c)].alt.empty())
          fail(at + "/" + std::to_string(i), "nested anyOf / oneOf");
        if (!s_->nodes_[size_t(c)].literals.empty()) {
          kinds = 0;
          for (const std::string& l : s_->nodes_[size_t(c)].literals)
            kinds |= kind_of_value(json::parse(l));
        }
        kinds &= node.kinds;
        if (kinds & covered)
          fail(at + "/" + std::to_string(i),
               "two alternatives take values of the same kind (they must differ in the value's "
               "first byte: object, array, string, number, boolean or null)");
        covered |= kinds;
        for (int k = 0; k < 6; ++k)
          if (kinds & (1 << k)) node.alt[size_t(k)] = c;
      }
      if (!covered) fail(at, "no alternative has an allowed type");
    }
    s_->nodes_[size_t(n)] = node;
  }

  // minimum / maximum / exclusiveMinimum / exclusiveMaximum (numbers; draft 4's booleans).
  void bounds(JsonSchema::Node& node, const json& v, const std::string& where) const {
    auto number = [&](const char* key, double& out) {
      if (!v.contains(key) || v[key].is_boolean()) return false;
      if (!v[key].is_number()) fail(where + "/" + key, fmt::format("'{}' must be a number", key));
      out = v[key].get<double>();
      return true;
    };
    double x = 0;
    if (number("minimum", x)) node.minimum = x;
    if (number("maximum", x)) node.maximum = x;
    if (number("exclusiveMinimum", x) && x >= node.minimum) {
      node.minimum = x;
      node.min_exclusive = true;
    }
    if (number("exclusiveMaximum", x) && x <= node.maximum) {
      node.maximum = x;
      node.max_exclusive = true;
    }
    auto flag = [&](const char* key) {  // draft 4: minimum / maximum made exclusive
      return v.contains(key) && v[key].is_boolean() && v[key].get<bool>();
    };
    if (flag("exclusiveMinimum")) node.min_exclusive = true;
    if (flag("exclusiveMaximum")) node.max_exclusive = true;
    if (v.contains("multipleOf")) {
      const json& m = v["multipleOf"];
      if (!m.is_number() || !(m.get<double>() > 0))
        fail(where + "/multipleOf", "'multipleOf' must be a number above 0");
      // Enforced for integer values by an integer (a fraction's multiples: an annotation).
      const double d = m.get<double>();
      if (node.integer && std::floor(d) == d && d < 9007199254740992.0) {
        node.multiple_of = d;
        // Within the doubles' exact integers (|x| < 2^53), where the test of a multiple holds.
        constexpr double kExact = 9007199254740991.0;
        node.minimum = std::max(node.minimum, -kExact);
        node.maximum = std::min(node.maximum, kExact);
      }
    }
    node.bounded =
        std::isfinite(node.minimum) || std::isfinite(node.maximum) || node.multiple_of > 0;
    if (!node.bounded) return;
    if (!(node.kinds & kJsonNumber)) return;  // (bounds of another type's value: nothing to do)
    if (!meets(node, {-HUGE_VAL, HUGE_VAL, false, false}))
      fail(where, node.integer ? "no integer (multiple) lies between the bounds"
                               : "no number lies between the bounds");
  }

  // pattern, or else a format that has one (json_schema.h).
  void pattern(JsonSchema::Node& node, const json& v, const std::string& where) const {
    std::string re, at;
    if (v.contains("pattern")) {
      if (!v["pattern"].is_string()) fail(where + "/pattern", "'pattern' must be a string");
      re = v["pattern"].get<std::string>();
      at = where + "/pattern";
    } else if (v.contains("format") && v["format"].is_string()) {
      re = format_pattern(v["format"].get<std::string>());
      at = where + "/format";
    }
    if (re.empty() || !(node.kinds & kJsonString)) return;
    try {
      node.pattern = Regex::compile(re);
    } catch (const Error& e) {
      fail(at, e.what());
    }
  }

  const json& root_;
  JsonSchema* s_ = nullptr;
  std::map<std::string, int> refs_;
  bool number_ = false, integer_ = false;
};

std::shared_ptr<const JsonSchema> JsonSchema::compile(const json& schema, bool any_root) {
  auto s = JsonSchemaCompiler(schema).run();
  const Node& root = s->node(0);
  if (any_root) return s;
  if (!(root.kinds & kJsonObject) || !root.literals.empty() ||
      (!root.alt.empty() && root.alt[0] < 0))
    throw Error(
        "json schema at '#': the output is one JSON object, so the root must allow an object");
  return s;
}

int JsonSchema::resolve(int i, uint8_t k) const {
  const Node& n = nodes_[size_t(i)];
  if (!n.alt.empty()) {
    const int kb = __builtin_ctz(k);
    return n.alt[size_t(kb)];
  }
  if (!n.literals.empty()) return i;  // the literals decide (first byte checked by the cursor)
  return (n.kinds & k) ? i : -1;
}

// ---- the cursor --------------------------------------------------------------------------------

bool JsonSchemaCursor::value_begin(const JsonSchema& s, uint8_t b) {
  const uint8_t kind = kind_of_byte(b);
  if (kind == 0) return false;  // not a value's first byte (the recognizer refuses it too)
  auto free = [&] {
    if (kind == kJsonObject || kind == kJsonArray) ++free_depth;
    free_value = true;
    value_node = -1;
    return true;
  };
  if (free_depth > 0) return free();
  int expected = 0;  // the root
  if (depth > 0) {
    // An array's element, or an object's member (an additional key's value: any JSON).
    Frame& f = frames[depth - 1];
    const JsonSchema::Node& parent = s.node(f.node);
    if (f.array && f.count++ >= parent.max_items) return false;
    if (f.array)
      expected = f.count <= parent.prefix.size() ? parent.prefix[f.count - 1] : parent.items;
    else
      expected = f.member >= 0 ? parent.members[size_t(f.member)] : parent.additional_node;
  }
  if (expected < 0) return free();
  const int n = s.resolve(expected, kind);
  if (n < 0) return false;
  const JsonSchema::Node& node = s.node(n);
  free_value = false;
  if (!node.literals.empty()) {
    lit_cand = 0;
    for (size_t i = 0; i < node.literals.size(); ++i)
      if (uint8_t(node.literals[i][0]) == b) lit_cand |= uint64_t(1) << i;
    if (!lit_cand) return false;
    lit_pos = 1;
    value_node = int16_t(n);
    integer = false;
    return true;
  }
  if (!(node.kinds & kind)) return false;
  if (kind == kJsonObject || kind == kJsonArray) {
    if (depth >= kMaxSchemaDepth) return free();  // (json_schema.h: any JSON below)
    Frame& f = frames[depth++];
    f = Frame{};
    f.node = uint16_t(n);
    f.array = kind == kJsonArray;
    value_node = -1;
    return true;
  }
  value_node = int16_t(n);
  lit_cand = 0;
  chars = 0;
  counted =
      kind == kJsonString && (node.min_length > 0 || node.max_length != UINT32_MAX || node.pattern);
  if (kind == kJsonString && node.pattern) {
    re = node.pattern->start();
    cp = 0;
    utf_left = esc = 0;
  }
  integer = kind == kJsonNumber && node.integer;
  num_len = 0;
  if (kind == kJsonNumber && node.bounded) return number_byte(node, b);
  return true;
}

bool JsonSchemaCursor::number_byte(const JsonSchema::Node& node, uint8_t b) {
  if (b == 'e' || b == 'E' || num_len >= kMaxNumberBytes) return false;
  num[num_len++] = char(b);
  return number_prefix_viable(node, std::string_view(num.data(), num_len));
}

bool JsonSchemaCursor::key_begin(const JsonSchema& s) {
  if (free_depth > 0) return true;
  Frame& f = frames[depth - 1];
  const JsonSchema::Node& node = s.node(f.node);
  const size_t m = node.names.size();
  const uint64_t all = m == 64 ? ~uint64_t(0) : (uint64_t(1) << m) - 1;
  // Without additional keys only the members not written yet may come (so a key never runs into
  // a dead end); with them every name is followed, and a repeated one is refused at its end.
  f.cand = node.additional ? all : all & ~f.seen;
  if (!node.additional && f.cand == 0) return false;
  f.in_key = true;
  f.key_pos = 0;
  f.member = -1;
  return true;
}

bool JsonSchemaCursor::key_byte(const JsonSchema& s, uint8_t b) {
  if (free_depth > 0) return true;
  Frame& f = frames[depth - 1];
  const JsonSchema::Node& node = s.node(f.node);
  uint64_t keep = 0;
  for (uint64_t c = f.cand; c; c &= c - 1) {
    const int i = __builtin_ctzll(c);
    const std::string& name = node.names[size_t(i)];
    if (name.size() > f.key_pos && uint8_t(name[f.key_pos]) == b) keep |= uint64_t(1) << i;
  }
  f.cand = keep;
  ++f.key_pos;
  return keep != 0 || node.additional;
}

bool JsonSchemaCursor::key_end(const JsonSchema& s) {
  if (free_depth > 0) return true;
  Frame& f = frames[depth - 1];
  const JsonSchema::Node& node = s.node(f.node);
  f.in_key = false;
  for (uint64_t c = f.cand; c; c &= c - 1) {
    const int i = __builtin_ctzll(c);
    if (node.names[size_t(i)].size() != f.key_pos) continue;
    if (f.seen >> i & 1) return false;  // a member written twice
    f.seen |= uint64_t(1) << i;
    f.member = int16_t(i);
    f.cand = 0;
    return true;
  }
  f.member = -1;
  f.cand = 0;
  return node.additional;
}

bool JsonSchemaCursor::member_comma(const JsonSchema& s) const {
  if (free_depth > 0) return true;
  const Frame& f = frames[depth - 1];
  const JsonSchema::Node& node = s.node(f.node);
  const size_t m = node.names.size();
  const uint64_t all = m == 64 ? ~uint64_t(0) : (uint64_t(1) << m) - 1;
  return node.additional || (all & ~f.seen) != 0;
}

bool JsonSchemaCursor::close_object(const JsonSchema& s) {
  if (free_depth > 0) {
    --free_depth;
    return true;
  }
  const Frame& f = frames[depth - 1];
  const uint64_t req = s.node(f.node).required;
  if ((f.seen & req) != req) return false;
  --depth;
  return true;
}

bool JsonSchemaCursor::element_comma(const JsonSchema& s) const {
  if (free_depth > 0) return true;
  const Frame& f = frames[depth - 1];
  return f.count < s.node(f.node).max_items;
}

bool JsonSchemaCursor::close_array(const JsonSchema& s) {
  if (free_depth > 0) {
    --free_depth;
    return true;
  }
  const Frame& f = frames[depth - 1];
  if (f.count < s.node(f.node).min_items) return false;
  --depth;
  return true;
}

bool JsonSchemaCursor::string_byte(const JsonSchema& s, uint8_t b, bool new_char, bool closing) {
  if (free_value || value_node < 0 || lit_cand) return scalar_byte(s, b);
  const JsonSchema::Node& node = s.node(value_node);
  if (closing) {
    if (chars < node.min_length) return false;
    if (!node.pattern) return true;
    return node.pattern->accepts(re);
  }
  if (new_char) ++chars;
  if (chars > node.max_length) return false;
  return !node.pattern || pattern_byte(*node.pattern, b);
}

// Decodes the string's bytes (UTF-8 and JSON escapes) into code points for the pattern; a byte
// that leaves a character partly written passes if one of the values it can still take steps the
// pattern (so a token never ends in the middle of a character that cannot be finished). The
// recognizer judges the syntax (this runs before it, so a byte it refuses may pass here: the
// state is then dropped with the byte). Escaped surrogates are refused (json_schema.h).
bool JsonSchemaCursor::pattern_byte(const Regex& r, uint8_t b) {
  constexpr uint32_t kSurrogates = 0xD800, kSurrogatesEnd = 0xDFFF;
  // Some value in [lo, hi] but a surrogate steps the pattern.
  auto can = [&](uint32_t lo, uint32_t hi) {
    return (lo < kSurrogates && r.can_step(re, lo, std::min(hi, kSurrogates - 1))) ||
           (hi > kSurrogatesEnd && r.can_step(re, std::max(lo, kSurrogatesEnd + 1), hi));
  };
  auto step = [&](uint32_t c) {
    re = r.step(re, c);
    return !Regex::empty(re);
  };
  if (esc == 1) {
    esc = 0;
    switch (b) {
      case 'u':
        esc = 2;
        cp = 0;
        return can(0, 0xFFFF);
      case 'b':
        return step(8);
      case 'f':
        return step(12);
      case 'n':
        return step(10);
      case 'r':
        return step(13);
      case 't':
        return step(9);
      default:
        return step(b);  // \" \\ \/
    }
  }
  if (esc >= 2) {
    cp = (cp << 4 | uint32_t(b <= '9' ? b - '0' : (b | 0x20) - 'a' + 10)) & 0xFFFF;
    const int left = 5 - esc;  // hex digits still to come
    if (left > 0) {
      ++esc;
      return can(cp << (4 * left), (cp << (4 * left)) | ((1u << (4 * left)) - 1));
    }
    esc = 0;
    return (cp < kSurrogates || cp > kSurrogatesEnd) && step(cp);
  }
  // A UTF-8 character partly read: the values its remaining bytes can give, at least the
  // smallest its length encodes (shorter forms are invalid) and at most U+10FFFF.
  auto utf_can = [&] {
    const uint32_t lo = cp << (6 * utf_left), hi = lo | ((1u << (6 * utf_left)) - 1);
    const uint32_t least = utf_len == 2 ? 0x80 : utf_len == 3 ? 0x800 : 0x10000;
    return can(std::max(lo, least), std::min(hi, 0x10FFFFu));
  };
  if (utf_left > 0) {
    cp = cp << 6 | (b & 0x3F);
    if (--utf_left == 0) return step(cp);
    return utf_can();
  }
  if (b == '\\') {
    esc = 1;
    return can(0, 0xFFFF);  // (every escape's value is in the BMP)
  }
  if (b >= 0xC0) {
    utf_left = b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : 1;
    utf_len = utf_left + 1;
    cp = b & (0x3Fu >> utf_left);
    return utf_can();
  }
  return step(b);
}

bool JsonSchemaCursor::scalar_byte(const JsonSchema& s, uint8_t b) {
  if (free_value || value_node < 0) return true;
  if (lit_cand) {  // the enum's values that go on with b
    const JsonSchema::Node& node = s.node(value_node);
    uint64_t keep = 0;
    for (uint64_t c = lit_cand; c; c &= c - 1) {
      const int i = __builtin_ctzll(c);
      const std::string& l = node.literals[size_t(i)];
      if (l.size() > lit_pos && uint8_t(l[lit_pos]) == b) keep |= uint64_t(1) << i;
    }
    lit_cand = keep;
    ++lit_pos;
    return keep != 0;
  }
  if (integer && (b == '.' || b == 'e' || b == 'E')) return false;
  return num_len == 0 || number_byte(s.node(value_node), b);  // (a bounded number's)
}

bool JsonSchemaCursor::scalar_end(const JsonSchema& s) {
  bool ok = true;
  if (!free_value && value_node >= 0 && lit_cand) {
    ok = false;
    const JsonSchema::Node& node = s.node(value_node);
    for (uint64_t c = lit_cand; c; c &= c - 1)
      ok = ok || node.literals[size_t(__builtin_ctzll(c))].size() == lit_pos;
  } else if (!free_value && value_node >= 0 && num_len > 0) {
    ok = number_in_range(s.node(value_node), std::string_view(num.data(), num_len));
  }
  num_len = 0;
  value_node = -1;
  lit_cand = 0;
  integer = false;
  counted = false;
  free_value = false;
  return ok;
}

bool JsonSchemaCursor::free_string() const {
  return !in_key() && (free_value || value_node < 0 || (lit_cand == 0 && !counted));
}

}  // namespace md
