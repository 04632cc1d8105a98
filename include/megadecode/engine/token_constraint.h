// Constrained decoding: which token ids may come next, so that a choice's output follows a given
// shape (a tool call of a named function with JSON arguments, no tool call at all, ...). The
// server builds a ConstraintProgram per request (server/chat_constraints.h); the engine keeps one
// TokenConstraint per constrained choice, masks that choice's logit row with allowed() before its
// token is drawn, and feeds the drawn id back with accept().
//
// The output is seen as a stream of symbols: a special token is one symbol (its id), any other
// token is its bytes. Matching specials by id keeps a marker such as <|tool_call_end|> from being
// spelled with ordinary tokens, and keeps stop tokens out of a JSON string. A program is a list of
// elements matched in order; when the last one is done the output is free again.
//
//   kSpecial   one given special token
//   kText      the given bytes
//   kName      one of the given names (the longest that the next symbol allows: a name is done
//              when the next symbol cannot continue any name; the element after a kName must not
//              start with a byte that can continue one)
//   kDigits    1 to max_digits ASCII digits (done at the first symbol that is not one)
//   kJson      one JSON object (with `any_value`, any JSON value: a top-level number ends at
//              the first symbol that does not go on with it) (RFC 8259; strings of valid UTF-8
//              and paired surrogate escapes;
//              whitespace between tokens at most kMaxJsonSpace bytes in a row, nesting at most
//              kMaxJsonDepth), done at its closing brace; with a `schema`, one that follows it
//              (engine/json_schema.h); with `schema_by_name`, the schema of the name the last
//              kName element matched (its index among that element's sorted names; null: any)
//   kRegex     UTF-8 text that the whole regular expression matches (engine/regex_dfa.h); the
//              longest the next symbol allows: done when the next symbol cannot continue a match
//              and the text so far is one
//   kGrammar   UTF-8 text of a context-free grammar's root rule (engine/grammar.h), the longest
//              the next symbol allows, as kRegex
//   kFree      anything, except that no `forbidden` pattern may be completed; done when its
//              `trigger` pattern has just been completed (never, without one)
//   kBranch    one of `branches`' specials, then on at that branch's target element
//   kStop      only `stop_ids` (when there are none, anything); one of them ends the program
// A pattern is a symbol sequence (special ids and bytes); a trigger must end with a special and a
// forbidden pattern must start with one, so that both are decided at token boundaries cheaply.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megadecode/engine/grammar.h"
#include "megadecode/engine/json_schema.h"
#include "megadecode/engine/regex_dfa.h"

namespace md {

class Tokenizer;
namespace detail {
class GrammarMasks;
}

// A symbol of the output stream: a special token id (>= 0) or a byte (kByte + its value).
using ConstraintSymbol = int64_t;
constexpr ConstraintSymbol kByteSymbol = int64_t(1) << 40;
inline ConstraintSymbol special_symbol(int32_t id) { return id; }
inline ConstraintSymbol byte_symbol(uint8_t b) { return kByteSymbol + b; }
// The symbols of `text`, one per byte, appended to `out`.
void append_text_symbols(std::vector<ConstraintSymbol>& out, std::string_view text);

struct ConstraintElement {
  enum class Kind {
    kSpecial,
    kText,
    kName,
    kDigits,
    kJson,
    kRegex,
    kGrammar,
    kFree,
    kBranch,
    kStop
  };
  Kind kind = Kind::kFree;
  int32_t special = -1;                              // kSpecial
  std::string text;                                  // kText
  std::vector<std::string> names;                    // kName: sorted, unique, none empty
  std::vector<ConstraintSymbol> trigger;             // kFree
  std::vector<std::vector<ConstraintSymbol>> forbidden;  // kFree
  std::vector<std::pair<int32_t, int>> branches;     // kBranch: (special id, element index)
  std::vector<int32_t> stop_ids;                     // kStop
  int max_digits = 4;                                // kDigits (a call's index)
  std::shared_ptr<const JsonSchema> schema;          // kJson (null: any object)
  bool any_value = false;  // kJson: any JSON value following `schema`, not only an object
  std::vector<std::shared_ptr<const JsonSchema>> schema_by_name;  // kJson
  std::shared_ptr<const RegexDfa> regex;                          // kRegex
  std::shared_ptr<const Grammar> grammar;                         // kGrammar
};

constexpr int kMaxJsonDepth = 64;
constexpr int kMaxJsonSpace = 16;

// A validated program (the constructor throws md::Error naming the bad element).
class ConstraintProgram {
 public:
  explicit ConstraintProgram(std::vector<ConstraintElement> elements);
  const std::vector<ConstraintElement>& elements() const { return elements_; }

 private:
  std::vector<ConstraintElement> elements_;
};

// The vocabulary as the masks need it: each id's bytes (ordinary tokens) or its being special,
// and the ordinary ids grouped by first byte, so that a byte the state refuses rules out its
// whole group at once. Built once per tokenizer and shared by every constraint.
class ConstraintVocab {
 public:
  // vocab_size: the model's (ids at or past the tokenizer's are never allowed).
  ConstraintVocab(const Tokenizer& tokenizer, int64_t vocab_size);
  int64_t size() const { return size_; }

 private:
  friend class TokenConstraint;
  int64_t size_ = 0;
  std::vector<uint8_t> special_;        // per id: 1 special, 0 ordinary, 2 never (no bytes)
  std::vector<uint8_t> plain_string_;   // per id: its bytes leave a clean JSON string clean
  std::vector<uint32_t> offset_;        // per id + 1: its bytes in bytes_
  std::string bytes_;
  std::vector<std::vector<int32_t>> by_first_byte_;  // 256 lists of ordinary ids
  std::vector<int32_t> specials_;                    // every special id
};

class TokenConstraint {
 public:
  TokenConstraint(std::shared_ptr<const ConstraintProgram> program,
                  std::shared_ptr<const ConstraintVocab> vocab);
  ~TokenConstraint();
  TokenConstraint(TokenConstraint&&) noexcept;
  TokenConstraint& operator=(TokenConstraint&&) noexcept;

  // Writes 1 for every id that may come next and 0 for the others (mask.size() == vocab size).
  // Returns the number of allowed ids; 0 only when the constraint is broken (see accept).
  int64_t allowed(std::span<uint8_t> mask) const;
  // The id that came next. An id the state refuses (a forced token, or a mask that was not
  // applied) breaks the constraint: from then on it allows everything and broken() is true.
  void accept(int32_t id);
  // Every element is done: the output is unconstrained from here.
  bool finished() const;
  bool broken() const;
  // Whether the symbols of `id` may come next (what allowed() computes for one id).
  bool allows(int32_t id) const;

 private:
  struct State;
  std::shared_ptr<const ConstraintProgram> program_;
  std::shared_ptr<const ConstraintVocab> vocab_;
  std::unique_ptr<State> state_;
  mutable std::unique_ptr<detail::GrammarMasks> grammar_masks_;  // kGrammar's, made when needed
};

}  // namespace md
