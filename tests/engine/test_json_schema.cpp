// JSON Schema in constrained decoding (engine/json_schema.h): schemas the cursor cannot follow are
// errors naming the place; objects that follow a schema pass token by token and each kind of
// violation is refused; random walks through the masks end in JSON that a validator written here
// (for the supported keywords) accepts, the masks agreeing with one-by-one checks on the way.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <regex>

#include "megadecode/base/error.h"
#include "megadecode/engine/json_schema.h"
#include "megadecode/engine/token_constraint.h"
#include "megadecode/tokenizer/tokenizer.h"
#include "test_util.h"

namespace md {
namespace {

using nlohmann::json;
using Kind = ConstraintElement::Kind;

const Tokenizer& tokenizer() {
  static const Tokenizer tok = Tokenizer::load(test::shared_text_checkpoint("tiny", 31));
  return tok;
}

const json kSchema = json::parse(R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "description": "an annotation"},
    "age": {"type": "integer"},
    "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "ok": {"type": "boolean"},
    "extra": {"type": ["string", "null"]},
    "child": {"$ref": "#/$defs/Child"},
    "opt": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "free": {},
    "list": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1,
             "maxItems": 2},
    "code": {"type": "string", "minLength": 2, "maxLength": 4}
  },
  "required": ["name", "age"],
  "additionalProperties": false,
  "$defs": {
    "Child": {"type": "object", "properties": {"x": {"const": 1}, "next": {"$ref": "#/$defs/Child"}},
              "required": ["x"], "additionalProperties": false}
  }
})");

std::shared_ptr<const ConstraintProgram> schema_then_stop(const json& schema, int32_t stop) {
  ConstraintElement j, s;
  j.kind = Kind::kJson;
  j.schema = JsonSchema::compile(schema);
  s.kind = Kind::kStop;
  s.stop_ids = {stop};
  return std::make_shared<const ConstraintProgram>(std::vector<ConstraintElement>{j, s});
}

// Whether the constraint takes every token of `text` (checking the mask against allows() on the
// way); afterwards it must be done.
bool takes(const json& schema, const std::string& text) {
  const Tokenizer& tok = tokenizer();
  const int64_t v = tok.vocab_size();
  static auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  TokenConstraint c(schema_then_stop(schema, *tok.special_id("<|im_end|>")), vocab);
  std::vector<uint8_t> m(static_cast<size_t>(v));
  for (int32_t id : tok.encode_ordinary(text)) {
    c.allowed(m);
    const bool ok = c.allows(id);
    EXPECT_EQ(m[size_t(id)], ok ? 1 : 0) << text;
    if (!ok) return false;
    c.accept(id);
  }
  // The object is complete: only the stop id is left.
  c.allowed(m);
  return m[size_t(*tok.special_id("<|im_end|>"))] == 1 && std::count(m.begin(), m.end(), 1) == 1;
}

TEST(JsonSchema, ObjectsThatFollowTheSchemaPass) {
  for (
      const char* text : {
          R"({"name":"a","age":3})",
          R"({"age": -12, "name": "b\"q", "tags": ["x", "y"], "unit": "celsius", "ok": true})",
          R"({"name":"","age":0,"extra":null,"child":{"x":1,"next":{"x":1}},"opt":5,"score":1.5e3})",
          R"({"name":"n","age":1,"extra":"s","opt":null,"unit":"fahrenheit","tags":[]})",
          R"({"name":"n","age":1,"free":{"any":[1,{"k":null}],"thing":"x"},"score":-0.25})",
          R"({"name":"n","age":1,"list":["a"],"code":"ab"})",
          R"({"name":"n","age":1,"list":["abc","é日x"],"code":"abcd"})",
          R"({"name":"n","age":1,"code":"\n\t","list":["\u00e9\"z"]})",
      })
    EXPECT_TRUE(takes(kSchema, text)) << text;
}

TEST(JsonSchema, ViolationsAreRefused) {
  for (const char* text : {
           R"({"name":"a"})",                               // a required member missing
           R"({"name":1,"age":1})",                         // a wrong type
           R"({"age":1.5,"name":"a"})",                     // an integer with a fraction
           R"({"age":1e3,"name":"a"})",                     // an integer with an exponent
           R"({"nam":"a","age":1})",                        // a key that is not a member
           R"({"name":"a","age":1,"zzz":1})",               // an additional key
           R"({"name":"a","age":1,"unit":"kelvin"})",       // outside the enum
           R"({"name":"a","age":1,"unit":"celsiusx"})",     // an enum value's prefix only
           R"({"name":"a","name":"b","age":1})",            // a member twice
           R"({"child":{},"name":"a","age":1})",            // a nested required member missing
           R"({"child":{"x":2},"name":"a","age":1})",       // const
           R"({"opt":"s","name":"a","age":1})",             // no alternative is a string
           R"({"tags":[1],"name":"a","age":1})",            // an element's type
           R"({"extra":5,"name":"a","age":1})",             // not in the type list
           R"({"name":"a","age":1,})",                      // a comma with nothing left to write
           R"({"name":"a","age":1,"list":[]})",             // minItems
           R"({"name":"a","age":1,"list":["a","b","c"]})",  // maxItems
           R"({"name":"a","age":1,"list":["abcd"]})",       // an element's maxLength
           R"({"name":"a","age":1,"list":["日本語x"]})",    // characters, not bytes
           R"({"name":"a","age":1,"code":"a"})",            // minLength
           R"({"name":"a","age":1,"code":"abcde"})",        // maxLength
       })
    EXPECT_FALSE(takes(kSchema, text)) << text;
  // With additional properties allowed: any other key, any value, but a member still once.
  json open = kSchema;
  open["additionalProperties"] = true;
  EXPECT_TRUE(takes(open, R"({"name":"a","age":1,"zzz":[1,{"q":2}],"na":3})"));
  EXPECT_FALSE(takes(open, R"({"name":"a","name":"b","age":1})"));
  EXPECT_FALSE(takes(open, R"({"zzz":1})"));  // required members still required
}

// A validator of the keywords the cursor enforces, written from the JSON Schema text.
bool valid(const json& root, const json& s, const json& v) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) {
    const std::string ref = s["$ref"];
    return valid(root, ref == "#" ? root : root["$defs"][ref.substr(8)], v);
  }
  if (s.contains("allOf"))
    for (const json& a : s["allOf"])
      if (!valid(root, a, v)) return false;
  if (s.contains("anyOf")) {
    int n = 0;
    for (const json& a : s["anyOf"]) n += valid(root, a, v);
    if (n == 0) return false;
  }
  if (s.contains("type")) {
    const json types = s["type"].is_array() ? s["type"] : json::array({s["type"]});
    bool any = false;
    for (const json& t : types) {
      const std::string n = t;
      any = any || (n == "object" && v.is_object()) || (n == "array" && v.is_array()) ||
            (n == "string" && v.is_string()) || (n == "number" && v.is_number()) ||
            (n == "integer" && v.is_number_integer()) || (n == "boolean" && v.is_boolean()) ||
            (n == "null" && v.is_null());
    }
    if (!any) return false;
  }
  if (s.contains("enum") && std::find(s["enum"].begin(), s["enum"].end(), v) == s["enum"].end())
    return false;
  if (s.contains("const") && s["const"] != v) return false;
  if (v.is_number()) {
    // (Draft 4: exclusiveMinimum / exclusiveMaximum as booleans on minimum / maximum.)
    const double x = v.get<double>();
    const json no = false;
    const json &xmin = s.value("exclusiveMinimum", no), &xmax = s.value("exclusiveMaximum", no);
    if (s.contains("minimum") &&
        (xmin == true ? x <= s["minimum"].get<double>() : x < s["minimum"].get<double>()))
      return false;
    if (s.contains("maximum") &&
        (xmax == true ? x >= s["maximum"].get<double>() : x > s["maximum"].get<double>()))
      return false;
    if (xmin.is_number() && x <= xmin.get<double>()) return false;
    if (xmax.is_number() && x >= xmax.get<double>()) return false;
    if (s.contains("multipleOf") && v.is_number_integer() &&
        v.get<int64_t>() % s["multipleOf"].get<int64_t>() != 0)
      return false;
  }
  if (v.is_object()) {
    const json props = s.value("properties", json::object());
    for (const json& r : s.value("required", json::array()))
      if (!v.contains(r.get<std::string>())) return false;
    for (const auto& [k, x] : v.items()) {
      if (props.contains(k)) {
        if (!valid(root, props[k], x)) return false;
      } else if (s.contains("additionalProperties") && s["additionalProperties"] == false) {
        return false;
      } else if (s.contains("additionalProperties") && s["additionalProperties"].is_object() &&
                 !valid(root, s["additionalProperties"], x)) {
        return false;
      }
    }
  }
  if (v.is_array()) {
    const json pre = s.value("prefixItems", json::array());
    for (size_t i = 0; i < v.size(); ++i) {
      const json& sub = i < pre.size() ? pre[i] : s.value("items", json(true));
      if (!valid(root, sub, v[i])) return false;
    }
  }
  if (v.is_array() && (v.size() < s.value("minItems", size_t(0)) ||
                       v.size() > s.value("maxItems", size_t(1) << 30)))
    return false;
  if (v.is_string() && s.contains("pattern") &&
      !std::regex_search(v.get<std::string>(), std::regex(s["pattern"].get<std::string>())))
    return false;
  if (v.is_string() && s.value("format", "") == "ipv4") {
    // Four decimal octets 0-255 without leading zeros (written here, not as a pattern).
    const std::string t = v.get<std::string>();
    int parts = 0;
    size_t at = 0;
    while (true) {
      const size_t dot = t.find('.', at);
      const std::string o = t.substr(at, dot == std::string::npos ? std::string::npos : dot - at);
      if (o.empty() || o.size() > 3 || (o.size() > 1 && o[0] == '0') ||
          o.find_first_not_of("0123456789") != std::string::npos || std::stoi(o) > 255)
        return false;
      ++parts;
      if (dot == std::string::npos) break;
      at = dot + 1;
    }
    if (parts != 4) return false;
  }
  if (v.is_string()) {
    size_t chars = 0;  // code points: the bytes that are not UTF-8 continuations
    for (unsigned char ch : v.get<std::string>()) chars += (ch & 0xC0) != 0x80;
    if (chars < s.value("minLength", size_t(0)) || chars > s.value("maxLength", size_t(1) << 30))
      return false;
  }
  return true;
}

// Random walks through the masks of `schema` (tokens drawn at random among the allowed ones,
// closing bytes preferred two times in three so that walks end), checking the mask against
// allows() every 8 steps; the texts of the walks that completed.
std::vector<std::string> random_walks(const json& schema, int walks, uint64_t seed) {
  const Tokenizer& tok = tokenizer();
  const int64_t v = tok.vocab_size();
  auto vocab = std::make_shared<const ConstraintVocab>(tok, v);
  const int32_t stop = *tok.special_id("<|im_end|>");
  const auto program = schema_then_stop(schema, stop);
  std::mt19937_64 rng(seed);
  std::vector<std::string> done;
  for (int walk = 0; walk < walks; ++walk) {
    TokenConstraint c(program, vocab);
    std::vector<int32_t> ids;
    std::vector<uint8_t> m(static_cast<size_t>(v));
    for (int step = 0; step < 400 && !c.finished(); ++step) {
      c.allowed(m);
      std::vector<int32_t> allowed, closing;
      for (int32_t id = 0; id < v; ++id) {
        if (step % 8 == 0) {
          EXPECT_EQ(m[size_t(id)], c.allows(id) ? 1 : 0) << id;
        }
        if (!m[size_t(id)]) continue;
        allowed.push_back(id);
        if (id == stop || (!tok.is_special(id) &&
                           tok.token_bytes(id).find_first_of("}]\",") != std::string_view::npos))
          closing.push_back(id);
      }
      if (allowed.empty()) {
        ADD_FAILURE() << "a dead end after " << tok.decode(ids);
        break;
      }
      const auto& pool = !closing.empty() && rng() % 3 != 0 ? closing : allowed;
      const int32_t id = pool[rng() % pool.size()];
      c.accept(id);
      EXPECT_FALSE(c.broken());
      ids.push_back(id);
    }
    if (!c.finished()) continue;
    ids.pop_back();  // the stop id
    done.push_back(tok.decode(ids));
  }
  return done;
}

// Random walks through the schema's masks: at least `completed` of them end, each in JSON the
// validator above accepts.
void expect_walks_valid(const json& schema, int walks, uint64_t seed, size_t completed) {
  const std::vector<std::string> texts = random_walks(schema, walks, seed);
  for (const std::string& text : texts) {
    json j;
    ASSERT_NO_THROW(j = json::parse(text)) << text;
    EXPECT_TRUE(valid(schema, schema, j)) << text;
  }
  EXPECT_GE(texts.size(), completed);
}

TEST(JsonSchema, RandomWalksThroughTheMasksEndInValidJson) {
  expect_walks_valid(kSchema, 16, 5, 8);
}

const json kBounded = json::parse(R"({
  "type": "object",
  "properties": {
    "pct": {"type": "integer", "minimum": 0, "maximum": 100},
    "temp": {"type": "number", "exclusiveMinimum": -273.15, "maximum": 1000},
    "neg": {"type": "integer", "maximum": -10},
    "small": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
    "big": {"type": "integer", "minimum": 5000},
    "d4": {"type": "number", "minimum": 5, "exclusiveMinimum": true}
  },
  "required": ["pct", "temp", "neg", "small", "big"],
  "additionalProperties": false
})");

TEST(JsonSchema, NumbersStayWithinTheirBounds) {
  const std::string ok = R"("temp":-273.1,"neg":-10,"small":0,"big":5000)";
  for (const std::string pct : {"0", "100", "57", "9"})
    EXPECT_TRUE(takes(kBounded, R"({"pct":)" + pct + "," + ok + "}")) << pct;
  for (const std::string pct : {"101", "-1", "1000", "100.5", "1e2", "-0.5"})
    EXPECT_FALSE(takes(kBounded, R"({"pct":)" + pct + "," + ok + "}")) << pct;
  const std::string rest = R"({"pct":5,"neg":-11,"small":0.5,"big":60000,"temp":)";
  for (const std::string t : {"-273.149", "1000", "1000.0", "0.5", "-0", "999.99999"})
    EXPECT_TRUE(takes(kBounded, rest + t + "}")) << t;
  for (const std::string t : {"-273.15", "-274", "1000.01", "1e3", "-300", "10000"})
    EXPECT_FALSE(takes(kBounded, rest + t + "}")) << t;
  const std::string p2 = R"({"pct":5,"temp":1,"small":0.25,"big":5001,"neg":)";
  for (const std::string n : {"-10", "-11", "-1000"})
    EXPECT_TRUE(takes(kBounded, p2 + n + "}")) << n;
  for (const std::string n : {"-9", "0", "5", "-1"})
    EXPECT_FALSE(takes(kBounded, p2 + n + "}")) << n;
  const std::string p3 = R"({"pct":5,"temp":1,"neg":-20,"big":5000,"small":)";
  for (const std::string x : {"0", "0.999", "0.5", "0.0"})
    EXPECT_TRUE(takes(kBounded, p3 + x + "}")) << x;
  for (const std::string x : {"1", "1.0", "-0.1", "2"})
    EXPECT_FALSE(takes(kBounded, p3 + x + "}")) << x;
  const std::string p4 = R"({"pct":5,"temp":1,"neg":-20,"small":0,"big":)";
  for (const std::string x : {"5000", "123456", "9999"}) EXPECT_TRUE(takes(kBounded, p4 + x + "}"));
  for (const std::string x : {"4999", "-5000", "0"}) EXPECT_FALSE(takes(kBounded, p4 + x + "}"));
  // Draft 4's boolean: minimum 5 made exclusive.
  const std::string p5 = R"({"pct":5,"temp":1,"neg":-20,"small":0,"big":5000,"d4":)";
  EXPECT_TRUE(takes(kBounded, p5 + "5.01}"));
  EXPECT_FALSE(takes(kBounded, p5 + "5}"));
  EXPECT_FALSE(takes(kBounded, p5 + "4.9}"));
}

TEST(JsonSchema, IntegersAreMultiplesOfTheirMultipleOf) {
  const json schema = json::parse(R"({"type":"object","properties":{
      "five":{"type":"integer","multipleOf":5},
      "one":{"type":"integer","multipleOf":5,"minimum":1,"maximum":9},
      "big":{"type":"integer","multipleOf":7,"exclusiveMinimum":-20,"maximum":-1}},
      "required":["five","one","big"],"additionalProperties":false})");
  for (const char* f : {"0", "15", "-20", "100", "-0"})
    EXPECT_TRUE(takes(schema, std::string(R"({"one":5,"big":-7,"five":)") + f + "}")) << f;
  for (const char* f : {"7", "12", "-3", "1"})
    EXPECT_FALSE(takes(schema, std::string(R"({"one":5,"big":-7,"five":)") + f + "}")) << f;
  EXPECT_FALSE(takes(schema, R"({"five":0,"big":-7,"one":0})"));   // below the minimum
  EXPECT_FALSE(takes(schema, R"({"five":0,"big":-7,"one":10})"));  // above the maximum
  EXPECT_TRUE(takes(schema, R"({"five":0,"one":5,"big":-14})"));
  EXPECT_FALSE(takes(schema, R"({"five":0,"one":5,"big":-21})"));  // exclusiveMinimum -20
  EXPECT_FALSE(takes(schema, R"({"five":0,"one":5,"big":0})"));    // maximum -1
  expect_walks_valid(schema, 12, 8, 6);
}

// Every walk through a bounded schema's masks ends in range: no digit leads to a dead end (a
// number that cannot be finished in range), and no number ends out of range.
TEST(JsonSchema, RandomWalksKeepNumbersInRange) {
  expect_walks_valid(kBounded, 12, 9, 6);
}

const json kPatterned = json::parse(R"({
  "type": "object",
  "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
    "word": {"type": "string", "pattern": "^(yes|no)!?$", "maxLength": 3},
    "free": {"type": "string", "pattern": "ab"},
    "when": {"type": "string", "format": "date-time"},
    "day": {"type": "string", "format": "date"},
    "id": {"type": "string", "format": "uuid"},
    "ip": {"type": "string", "format": "ipv4"},
    "mail": {"type": "string", "format": "email"},
    "note": {"type": "string", "format": "hostname"}
  },
  "required": ["code", "word", "free"],
  "additionalProperties": false
})");

TEST(JsonSchema, StringsFollowTheirPatternsAndFormats) {
  const std::string base = R"({"code":"AB-123","word":"yes","free":"xaby")";
  EXPECT_TRUE(takes(kPatterned, base + "}"));
  // Escapes are the characters they stand for: "A\u0042-12\u0033" is "AB-123".
  EXPECT_TRUE(takes(kPatterned, R"({"code":"A\u0042-12\u0033","word":"no!","free":"ab"})"));
  EXPECT_TRUE(takes(kPatterned, R"({"code":"ZZ-000","word":"no","free":"é\nab\u65e5"})"));
  for (const char* bad : {R"({"code":"ab-123","word":"yes","free":"ab"})",
                          R"({"code":"AB-1234","word":"yes","free":"ab"})",
                          R"({"code":"AB-12","word":"yes","free":"ab"})",
                          R"({"code":"AB-123","word":"yes!","free":"ab"})",  // maxLength 3
                          R"({"code":"AB-123","word":"maybe","free":"ab"})",
                          R"({"code":"AB-123","word":"no","free":"a b"})"})
    EXPECT_FALSE(takes(kPatterned, bad)) << bad;
  const std::pair<const char*, const char*> formats[] = {
      {R"("when":"2024-02-29T23:59:60.5+05:30")", R"("when":"2024-13-01T00:00:00Z")"},
      {R"("when":"1999-12-31t00:00:00z")", R"("when":"2024-01-01T00:00:00")"},  // no offset
      {R"("day":"2024-01-31")", R"("day":"2024-01-32")"},
      {R"("id":"123e4567-e89b-12d3-a456-426614174000")", R"("id":"123e4567-e89b-12d3-a456")"},
      {R"("ip":"192.168.0.255")", R"("ip":"192.168.0.256")"},
      {R"("mail":"a.b+c@example.co.uk")", R"("mail":"a@b")"},
      {R"("note":"any text")", R"("note":1)"},  // an annotation only: any string
  };
  for (const auto& [good, bad] : formats) {
    EXPECT_TRUE(takes(kPatterned, base + "," + good + "}")) << good;
    EXPECT_FALSE(takes(kPatterned, base + "," + bad + "}")) << bad;
  }
}

// Walks through the masks of patterned strings end in strings that match (std::regex checks).
TEST(JsonSchema, RandomWalksKeepStringsToTheirPatterns) {
  json schema = kPatterned;
  // (Not "free" nor "mail": an unanchored "ab", or an e-mail's local part, takes almost any
  // text, and the walks, preferring tokens with '}', would rarely write the "ab" or '@' they
  // need to end.)
  for (const char* key : {"free", "note", "mail"}) schema["properties"].erase(key);
  schema["properties"]["day"] = {{"type", "string"},
                                 {"pattern", R"(^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$)"}};
  schema["properties"]["ip"] = {{"type", "string"}, {"format", "ipv4"}};
  schema["required"] = {"code", "word", "day", "ip"};
  expect_walks_valid(schema, 16, 4, 6);
}

// allOf: pydantic's reference with a description, and subschemas whose members, requirements,
// types and bounds combine.
TEST(JsonSchema, AllOfSubschemasAreMerged) {
  const json pyd = json::parse(R"({"type":"object","properties":{
      "addr":{"allOf":[{"$ref":"#/$defs/Address"}],"description":"home"}},
      "required":["addr"],"additionalProperties":false,
      "$defs":{"Address":{"type":"object","properties":{"city":{"type":"string"}},
               "required":["city"],"additionalProperties":false}}})");
  EXPECT_TRUE(takes(pyd, R"({"addr":{"city":"x"}})"));
  EXPECT_FALSE(takes(pyd, R"({"addr":{}})"));
  EXPECT_FALSE(takes(pyd, R"({"addr":{"city":"x","zip":1}})"));
  EXPECT_FALSE(takes(pyd, R"({"addr":5})"));
  const json both = json::parse(R"({"allOf":[
      {"type":"object","properties":{"a":{"type":"integer"},"n":{"type":"number","minimum":0}},
       "required":["a"]},
      {"properties":{"a":{"minimum":-5},"b":{"type":"string"},"n":{"maximum":10},
                     "t":{"type":["integer","string"]}},
       "required":["b"],"additionalProperties":false},
      {"properties":{"t":{"type":["number","null"]}}}]})");
  EXPECT_TRUE(takes(both, R"({"a":1,"b":"x"})"));
  EXPECT_TRUE(takes(both, R"({"b":"x","a":2,"n":9.5,"t":3})"));
  EXPECT_FALSE(takes(both, R"({"a":1})"));                  // b required by the second
  EXPECT_FALSE(takes(both, R"({"b":"x"})"));                // a required by the first
  EXPECT_FALSE(takes(both, R"({"a":1,"b":"x","n":11})"));   // the second's maximum
  EXPECT_FALSE(takes(both, R"({"a":1,"b":"x","n":-1})"));   // the first's minimum
  EXPECT_FALSE(takes(both, R"({"a":1,"b":"x","t":"s"})"));  // integer|string and number|null
  EXPECT_FALSE(takes(both, R"({"a":1,"b":"x","t":1.5})"));  // ... leave the integers
  EXPECT_FALSE(takes(both, R"({"a":1,"b":"x","z":0})"));    // additionalProperties false
  EXPECT_FALSE(takes(both, R"({"a":-6,"b":"x"})"));         // the second's bound on a
  // Walks through the merged masks validate against every subschema.
  expect_walks_valid(both, 8, 7, 4);
}

// pydantic's Dict[str, int] (additionalProperties as a schema) and Tuple[int, str] / Tuple[int,
// ...] (prefixItems, with items false or a schema).
TEST(JsonSchema, DictValuesAndTupleElementsFollowTheirSchemas) {
  const json schema = json::parse(R"({"type":"object","properties":{
      "d":{"type":"object","additionalProperties":{"type":"integer","minimum":0}},
      "t":{"type":"array","prefixItems":[{"type":"integer"},{"type":"string"}],"items":false,
           "minItems":2},
      "u":{"type":"array","prefixItems":[{"type":"string"}],"items":{"type":"boolean"}}},
      "required":["d","t","u"],"additionalProperties":false})");
  const std::string tu = R"(,"t":[1,"a"],"u":["x"])";
  EXPECT_TRUE(takes(schema, R"({"d":{"x":1,"y":20})" + tu + "}"));
  EXPECT_TRUE(takes(schema, R"({"d":{})" + tu + "}"));
  EXPECT_FALSE(takes(schema, R"({"d":{"x":"s"})" + tu + "}"));
  EXPECT_FALSE(takes(schema, R"({"d":{"x":-1})" + tu + "}"));
  const std::string d = R"({"d":{},)";
  EXPECT_TRUE(takes(schema, d + R"("t":[7,""],"u":["x",true,false]})"));
  EXPECT_FALSE(takes(schema, d + R"("t":["a",1],"u":["x"]})"));      // positions' types
  EXPECT_FALSE(takes(schema, d + R"("t":[1,"a",3],"u":["x"]})"));    // items false: 2 at most
  EXPECT_FALSE(takes(schema, d + R"("t":[1],"u":["x"]})"));          // minItems
  EXPECT_FALSE(takes(schema, d + R"("t":[1,"a"],"u":["x","y"]})"));  // items after the prefix
  EXPECT_FALSE(takes(schema, d + R"("t":[1,"a"],"u":[true]})"));     // the prefix's type
  expect_walks_valid(schema, 12, 3, 5);
}

TEST(JsonSchema, SchemasTheCursorCannotFollowAreErrorsNamingThePlace) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"type":"array"})", "root must allow an object"},
      {R"({"type":"object","properties":{"a":{"enum":[]}}})", "#/properties/a/enum"},
      {R"({"type":"object","properties":{"a":{"type":"text"}}})", "unknown type 'text'"},
      {R"({"properties":{"a":{"anyOf":[{"type":"string"},{"enum":["x"]}]}}})", "same kind"},
      {R"({"properties":{"a":{"$ref":"http://x/y"}}})", "$ref 'http://x/y'"},
      {R"({"properties":{"a":{"$ref":"#/$defs/missing"}}})", "#/$defs/missing"},
      {R"({"properties":{"a":{}},"required":["b"]})", "required 'b'"},
      {R"({"properties":{"a":{"type":"integer","enum":["x"]}}})", "no enum / const value"},
      {R"({"properties":{"a":false}})", "allows no value"},
      {R"({"properties":{"a":{"enum":[{"k":1}]}}})", "scalars"},
      {R"(5)", "an object or a boolean"},
      {R"({"properties":{"a":{"minItems":3,"maxItems":2}}})", "minItems is above maxItems"},
      {R"({"properties":{"a":{"maxLength":-1}}})", "non-negative integer"},
      {R"({"properties":{"a":{"type":"integer","minimum":1.2,"maximum":1.8}}})", "no integer"},
      {R"({"properties":{"a":{"type":"integer","multipleOf":5,"minimum":1,"maximum":4}}})",
       "no integer (multiple)"},
      {R"({"properties":{"a":{"type":"integer","multipleOf":0}}})", "above 0"},
      {R"({"properties":{"a":{"type":"number","minimum":3,"exclusiveMaximum":3}}})",
       "no number lies"},
      {R"({"properties":{"a":{"type":"number","maximum":"10"}}})", "'maximum' must be a number"},
      {R"({"properties":{"a":{"type":"string","pattern":"(a)\\1"}}})",
       "#/properties/a/pattern': pattern '(a)\\1': backreferences"},
      {R"({"properties":{"a":{"type":"string","pattern":5}}})", "'pattern' must be a string"},
      {R"({"properties":{"a":{"allOf":[{"type":"string"},{"type":"integer"}]}}})",
       "#/properties/a/allOf/1/type': the allOf subschemas' types have no value in common"},
      {R"({"properties":{"a":{"allOf":[{"pattern":"x"},{"pattern":"y"}]}}})", "two allOf"},
      {R"({"allOf":[{"$ref":"#"}]})", "allOf nested deeper than 8"},
      {R"({"allOf":[{"properties":{"a":{}},"required":["a"]},{"additionalProperties":false}]})",
       "'a' is required, but a subschema's additionalProperties false leaves it out"},
      {R"({"properties":{"a":{"allOf":[]}}})", "'allOf' must be a non-empty list"},
      {R"({"properties":{"a":{"prefixItems":{}}}})", "'prefixItems' must be a list"},
      {R"({"properties":{"a":{"prefixItems":[{}],"items":false,"minItems":2}}})",
       "minItems is above the prefixItems"},
      {R"({"properties":{"a":{"allOf":[{"$ref":"#/$defs/none"}]}}})", "$ref '#/$defs/none'"},
  };
  for (const auto& [text, what] : cases) {
    try {
      JsonSchema::compile(json::parse(text));
      ADD_FAILURE() << text << " compiled";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << text << ": " << e.what();
    }
  }
  // Recursion through $ref, and "#" itself, compile.
  EXPECT_NO_THROW(JsonSchema::compile(json::parse(R"({"properties":{"self":{"$ref":"#"}}})")));
}

// A recursive schema whose member is required: the output can always go deeper (past the
// cursor's kMaxSchemaDepth frames it takes any JSON), and at the shallow levels the schema holds.
TEST(JsonSchema, RecursionDeeperThanTheCursorNeverDeadEnds) {
  const json schema = json::parse(R"({"type":"object","additionalProperties":false,
      "properties":{"next":{"anyOf":[{"$ref":"#"},{"type":"null"}]},"n":{"type":"integer"}},
      "required":["next"]})");
  std::string deep, tail;
  for (int i = 0; i < 24; ++i) deep += R"({"next":)", tail += "}";
  EXPECT_TRUE(takes(schema, deep + "null" + tail));
  EXPECT_TRUE(takes(schema, deep + R"({"next":null,"x":[1]})" + tail));  // free below 16
  EXPECT_FALSE(takes(schema, R"({"next":{"next":null,"x":1}})"));        // held at depth 2
  EXPECT_FALSE(takes(schema, R"({"next":{"n":1}})"));                    // "next" required
}

}  // namespace
}  // namespace md
