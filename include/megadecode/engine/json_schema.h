// JSON Schema for constrained decoding (engine/token_constraint.h, the kJson element): a schema
// compiled into a graph of nodes, and the cursor that walks it beside the JSON byte recognizer,
// refusing the bytes that would leave the schema. What is enforced (the subset that decides the
// shape of the output, and what OpenAI's structured outputs and tool parameters use most):
//
//   type                 one type or a list ("integer" refuses a fraction and an exponent)
//   properties           an object's named members, each with its schema; keys are written as
//                        json dumps them (no escapes beyond its own), each at most once
//   required             members the object cannot close without
//   additionalProperties false: only the named members; true or absent: any other key, its value
//                        any JSON; a schema: any other key, its value following the schema
//                        (pydantic's Dict[str, X])
//   items                the schema of every array element (after prefixItems'; false: none)
//   prefixItems          the schemas of the first elements, one each (pydantic's tuples)
//   minItems, maxItems   an array's element count (no ',' past the maximum, no ']' before the
//                        minimum)
//   minLength, maxLength a string value's characters (code points written as UTF-8 or as one
//                        escape each; an escaped surrogate pair counts as two)
//   pattern              a string value matches the regular expression (engine/json_regex.h:
//                        a search, as JSON Schema's; the string's code points after unescaping).
//                        Every byte keeps a match within reach (a partly written character
//                        must have a value the pattern takes). A code point above U+FFFF is
//                        written as UTF-8 there, not as an escaped surrogate pair
//   format               date, time, date-time (RFC 3339), uuid, ipv4, email (a simple
//                        local@domain.tld): as patterns (without a pattern); others annotate
//   enum, const          one of the given scalars (strings, numbers, booleans, null), written
//                        exactly as json dumps them
//   $ref                 "#", "#/$defs/NAME" or "#/definitions/NAME" (recursion allowed)
//   anyOf, oneOf         alternatives told apart by their first byte (object, array, string,
//                        number, boolean, null): at most one alternative per kind
//   allOf                merged into one schema before compiling (json_schema_all_of.h:
//                        properties and required joined, types intersected, the tighter bounds;
//                        pydantic's {"allOf": [{"$ref": ...}], "description": ...} among them)
//   minimum, maximum,    a number's bounds (exclusive ones as numbers, or as draft 4's booleans):
//   exclusiveMinimum,    every digit written keeps a value in range within reach, and the
//   exclusiveMaximum     number ends only in range. A bounded number is written without an
//                        exponent, in at most 32 bytes; values compare as doubles (the number's
//                        text and the bounds each rounded to the nearest double)
//   multipleOf           an integer node's integer multipleOf, with its bounds: a digit only
//                        while a multiple in range stays within reach (values then within
//                        +-(2^53 - 1), where doubles hold every integer)
//
// Everything else is an annotation or a bound that is not enforced (documented in
// docs/server.md): multipleOf of numbers or by a fraction, other formats, uniqueItems, not,
// if/then/else, patternProperties. A schema the cursor cannot follow (an empty enum, two anyOf
// alternatives of one kind, a $ref elsewhere, more than 64 properties or enum values) is an
// md::Error naming the place. An output nested deeper than kMaxSchemaDepth objects / arrays that
// follow the schema (a recursive schema) takes any JSON below that depth rather than refusing it
// (a refusal could leave a required member impossible to write).
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "megadecode/engine/json_regex.h"

namespace md {

// The kinds a JSON value's first byte tells apart.
enum JsonKind : uint8_t {
  kJsonObject = 1,
  kJsonArray = 2,
  kJsonString = 4,
  kJsonNumber = 8,  // integer or not
  kJsonBool = 16,
  kJsonNull = 32,
  kJsonAnyKind = 63,
};

class JsonSchema {
 public:
  struct Node {
    uint8_t kinds = kJsonAnyKind;  // the kinds a value may have
    bool integer = false;          // numbers are integers
    // anyOf / oneOf: the alternative for each kind (node ids; -1: none). Empty: no alternatives.
    std::vector<int> alt;
    // Objects: the members' names as written (the bytes between the quotes), sorted, and their
    // nodes; bit i of `required`; other keys allowed (their values any JSON).
    std::vector<std::string> names;
    std::vector<int> members;
    uint64_t required = 0;
    bool additional = true;
    int additional_node = -1;  // other keys' values: their node (-1: any JSON)
    int items = -1;            // arrays: the elements' node (-1: any JSON)
    std::vector<int> prefix;   // arrays: the first elements' nodes (prefixItems)
    uint32_t min_items = 0, max_items = UINT32_MAX;
    uint32_t min_length = 0, max_length = UINT32_MAX;  // strings, in characters
    // enum / const: the values as written (json dumps); empty: no enum.
    std::vector<std::string> literals;
    // Strings: the pattern their code points match (pattern, or format as a pattern; null: none).
    std::shared_ptr<const Regex> pattern;
    // Numbers: the bounds (infinite: none) and whether each is exclusive; bounded: any is set.
    double minimum = -HUGE_VAL, maximum = HUGE_VAL;
    bool min_exclusive = false, max_exclusive = false, bounded = false;
    double multiple_of = 0;  // integers: multipleOf (0: none); bounded is then set too
  };
  // Throws md::Error naming the unsupported or contradictory part (a JSON pointer into `schema`).
  // any_root: the value may be of any kind the root allows (else the root must allow an object:
  // the answer of response_format and of tool arguments is one object).
  static std::shared_ptr<const JsonSchema> compile(const nlohmann::json& schema,
                                                   bool any_root = false);
  const Node& node(int i) const { return nodes_[size_t(i)]; }
  int root() const { return 0; }
  // The node a value starting with kind `k` follows at node i (through anyOf); -1 when none.
  int resolve(int i, uint8_t k) const;

 private:
  std::vector<Node> nodes_;
  friend class JsonSchemaCompiler;
};

constexpr int kMaxSchemaDepth = 16;  // nested containers with a schema

// Where the output is in the schema: plain data, copied for every token tried (a few hundred
// bytes). Driven by the kJson element with the recognizer's mode around each byte.
struct JsonSchemaCursor {
  struct Frame {
    uint16_t node = 0;
    bool array = false;
    int16_t member = -1;  // objects: the member whose key was read (-1: an additional key)
    uint16_t key_pos = 0;
    bool in_key = false;
    uint64_t seen = 0;  // members written
    uint64_t cand = 0;  // members whose name matches the key so far
    uint32_t count = 0;  // arrays: elements begun
  };
  std::array<Frame, kMaxSchemaDepth> frames{};
  uint8_t depth = 0;        // frames in use
  uint8_t free_depth = 0;   // containers open inside a value that follows no schema
  bool free_value = false;  // a scalar value that follows no schema is under way
  // A scalar value under way: its node; literal candidates (enum) and bytes matched.
  int16_t value_node = -1;
  uint16_t lit_pos = 0;
  uint64_t lit_cand = 0;
  bool integer = false;
  // A bounded number under way: its bytes so far; a patterned string under way: the pattern's
  // states (a value is one or the other: they share the bytes of a state copied per token).
  static constexpr int kMaxNumberBytes = 32;
  union {
    std::array<char, kMaxNumberBytes> num{};
    Regex::States re;
  };
  uint8_t num_len = 0;

  // The events of the JSON text, each false when the schema refuses it (the cursor is then
  // garbage). `b`: the value's first byte, or the byte read.
  bool value_begin(const JsonSchema& s, uint8_t b);
  bool key_begin(const JsonSchema& s);
  bool key_byte(const JsonSchema& s, uint8_t b);  // a byte of a key (not its closing quote)
  bool key_end(const JsonSchema& s);
  bool member_comma(const JsonSchema& s) const;  // ',' in an object
  bool element_comma(const JsonSchema& s) const;  // ',' in an array
  bool close_object(const JsonSchema& s);
  bool close_array(const JsonSchema& s);
  // A byte of a string, number or literal value after its first.
  bool scalar_byte(const JsonSchema& s, uint8_t b);
  // A byte of a string value's contents or its closing quote (closing); new_char: the byte starts
  // a character (a UTF-8 lead byte, an ASCII byte or an escape's backslash).
  bool string_byte(const JsonSchema& s, uint8_t b, bool new_char, bool closing);
  uint32_t chars = 0;    // characters of the string value under way
  bool counted = false;  // ... and its length is bounded or it has a pattern (every byte judged)
  // A patterned string under way: the code point being decoded from its bytes (UTF-8
  // continuation bytes still to come; esc: 1 after a backslash, 2-5 in a \u escape's hex
  // digits); its states are `re` above.
  uint32_t cp = 0;
  uint8_t utf_left = 0, utf_len = 0, esc = 0;
  bool pattern_byte(const Regex& r, uint8_t b);
  bool scalar_end(const JsonSchema& s);  // the scalar value ended (after its last byte)
  // A byte of a bounded number (its first included).
  bool number_byte(const JsonSchema::Node& node, uint8_t b);
  // Inside a string whose bytes the schema does not judge (a free value, not an enum or a key).
  bool free_string() const;
  bool in_key() const { return depth > 0 && free_depth == 0 && frames[depth - 1].in_key; }
};

}  // namespace md
