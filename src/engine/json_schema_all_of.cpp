// allOf merged into one schema (json_schema_all_of.h).
#include "json_schema_all_of.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "megadecode/base/error.h"

namespace md::detail {

using nlohmann::json;

namespace {

[[noreturn]] void fail(const std::string& where, const std::string& why) {
  throw Error(fmt::format("json schema at '#{}': {}", where, why));
}

std::set<std::string> type_set(const json& t) {
  std::set<std::string> out;
  for (const json& x : t.is_array() ? t : json::array({t}))
    if (x.is_string()) out.insert(x.get<std::string>());
  return out;
}

// The types both lists allow ("number" includes the integers).
json type_intersection(const json& x, const json& y) {
  const std::set<std::string> a = type_set(x), b = type_set(y);
  json both = json::array();
  for (const char* t : {"object", "array", "string", "boolean", "null"})
    if (a.count(t) && b.count(t)) both.push_back(t);
  const bool an = a.count("number"), bn = b.count("number");
  if (an && bn)
    both.push_back("number");
  else if ((an || a.count("integer")) && (bn || b.count("integer")))
    both.push_back("integer");
  return both;
}

// The tighter of two bounds: the larger lower bound (upper: the smaller), integers kept integers.
json tighter(const json& x, const json& y, bool lower) {
  if (x.is_number_integer() && y.is_number_integer())
    return lower ? std::max(x.get<int64_t>(), y.get<int64_t>())
                 : std::min(x.get<int64_t>(), y.get<int64_t>());
  if (x.is_number() && y.is_number())
    return lower ? std::max(x.get<double>(), y.get<double>())
                 : std::min(x.get<double>(), y.get<double>());
  if (x.is_boolean() && y.is_boolean()) return x.get<bool>() || y.get<bool>();  // (draft 4)
  return y;
}

// `into` takes e's keywords (json_schema_all_of.h).
void merge_into(json& into, const json& e, const std::string& where) {
  for (const auto& [k, x] : e.items()) {
    if (k == "$defs" || k == "definitions" || k == "$schema" || k == "$id") continue;
    if (!into.contains(k)) {
      into[k] = x;
      continue;
    }
    json& y = into[k];
    if (y == x) continue;
    const std::string at = where + "/" + k;
    if (k == "properties") {
      if (!x.is_object() || !y.is_object()) fail(at, "'properties' must be an object");
      for (const auto& [name, sub] : x.items()) {
        if (!y.contains(name))
          y[name] = sub;
        else if (y[name] != sub)
          y[name] = json{{"allOf", json::array({y[name], sub})}};
      }
    } else if (k == "required") {
      if (!x.is_array() || !y.is_array()) fail(at, "'required' must be a list of names");
      for (const json& r : x)
        if (std::find(y.begin(), y.end(), r) == y.end()) y.push_back(r);
    } else if (k == "additionalProperties") {
      if (x == false || y == false)
        y = false;
      else
        y = json{{"allOf", json::array({y, x})}};  // (schemas: not enforced either way)
    } else if (k == "type") {
      const json both = type_intersection(x, y);
      if (both.empty()) fail(at, "the allOf subschemas' types have no value in common");
      y = both.size() == 1 ? both[0] : both;
    } else if (k == "minimum" || k == "exclusiveMinimum" || k == "minLength" || k == "minItems") {
      y = tighter(x, y, true);
    } else if (k == "maximum" || k == "exclusiveMaximum" || k == "maxLength" || k == "maxItems") {
      y = tighter(x, y, false);
    } else if (k == "enum") {
      if (!x.is_array() || !y.is_array()) fail(at, "'enum' must be a list");
      json both = json::array();
      for (const json& v : y)
        if (std::find(x.begin(), x.end(), v) != x.end()) both.push_back(v);
      if (both.empty()) fail(at, "the allOf subschemas' enums have no value in common");
      y = both;
    } else if (k == "items") {
      y = json{{"allOf", json::array({y, x})}};
    } else if (k == "const" || k == "pattern" || k == "anyOf" || k == "oneOf" || k == "$ref" ||
               k == "format") {
      fail(at, fmt::format("two allOf subschemas give different '{}' (not merged)", k));
    }
    // Anything else (title, description, default, examples, ...): the first one's.
  }
}

}  // namespace

json merge_all_of(const json& v, const std::string& where,
                  const std::function<const json*(const std::string&)>& resolve, int depth) {
  if (depth > 8) fail(where, "allOf nested deeper than 8 (through references?)");
  const json& all = v["allOf"];
  const std::string at = where + "/allOf";
  if (!all.is_array() || all.empty()) fail(at, "'allOf' must be a non-empty list");
  json out = v;
  out.erase("allOf");
  // additionalProperties false holds each subschema to its own properties: the keys allowed are
  // those every such subschema names (JSON Schema's rule, not the union's).
  bool closed = false;
  std::set<std::string> allowed;
  auto close_over = [&](const json& e) {
    if (!e.is_object() || !e.contains("additionalProperties") || e["additionalProperties"] != false)
      return;
    std::set<std::string> own;
    if (e.contains("properties") && e["properties"].is_object())
      for (const auto& [name, sub] : e["properties"].items()) own.insert(name);
    if (!closed) {
      allowed = own;
    } else {
      std::set<std::string> both;
      for (const std::string& k : allowed)
        if (own.count(k)) both.insert(k);
      allowed = both;
    }
    closed = true;
  };
  close_over(out);
  for (size_t i = 0; i < all.size(); ++i) {
    const std::string ai = at + "/" + std::to_string(i);
    json e = all[i];
    if (e.is_boolean()) {
      if (!e.get<bool>()) fail(ai, "the schema 'false' allows no value");
      continue;
    }
    if (!e.is_object()) fail(ai, "a schema must be an object or a boolean");
    if (e.contains("$ref")) {
      if (!e["$ref"].is_string()) fail(ai + "/$ref", "$ref must be a string");
      const json* target = resolve(e["$ref"].get<std::string>());
      if (!target)
        fail(ai + "/$ref",
             fmt::format("$ref '{}' is not '#', '#/$defs/NAME' or '#/definitions/NAME' of this "
                         "schema",
                         e["$ref"].get<std::string>()));
      json t = *target;
      e.erase("$ref");
      if (t.is_object()) merge_into(t, e, ai);  // (keywords beside the reference)
      e = t;
      if (e.is_boolean()) {
        if (!e.get<bool>()) fail(ai, "the schema 'false' allows no value");
        continue;
      }
    }
    if (e.contains("allOf")) e = merge_all_of(e, ai, resolve, depth + 1);
    close_over(e);
    merge_into(out, e, ai);
  }
  if (closed) {
    out["additionalProperties"] = false;
    if (out.contains("properties") && out["properties"].is_object()) {
      json kept = json::object();
      for (const auto& [name, sub] : out["properties"].items())
        if (allowed.count(name)) kept[name] = sub;
      out["properties"] = kept;
    }
    if (out.contains("required") && out["required"].is_array())
      for (const json& r : out["required"])
        if (r.is_string() && !allowed.count(r.get<std::string>()))
          fail(at, fmt::format("'{}' is required, but a subschema's additionalProperties false "
                               "leaves it out",
                               r.get<std::string>()));
  }
  return out;
}

}  // namespace md::detail
