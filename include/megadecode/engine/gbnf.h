// GBNF grammars (llama.cpp's format, which vLLM's backends also take for `grammar`) for
// constrained decoding, as far as they describe regular languages: a grammar whose rules never
// refer to themselves, directly or through others, is written out as one regular expression
// (each rule inlined where it is used) and run as engine/regex_dfa.h's automaton.
//
// The syntax read: rules `name ::= alternatives` (names of letters, digits, '-' and '_'; `root`
// is the answer), alternatives separated by '|', sequences of: "literals" and [classes]
// ([^...] negated, ranges a-z) with the escapes \n \r \t \\ \" \[ \] \- \xHH \uHHHH \UHHHHHHHH,
// `.` (any character), rule names, ( groups ), each followed by * + ? {m} {m,} {m,n}; `#`
// comments to the end of the line. A rule may span lines: a new one starts at `name ::=`.
// Errors (md::Error) give the line and column: a syntax error, an undefined rule, no `root`, a
// recursive rule (recursion needs a pushdown automaton: engine/grammar.h), token references
// (<...>), or a grammar too large once written out.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "megadecode/engine/regex_dfa.h"

namespace md {

// The grammar's language as a pattern of engine/json_regex.h's syntax, to be matched whole.
std::string gbnf_to_regex(std::string_view grammar);

// The grammar's automaton (gbnf_to_regex, then RegexDfa::compile).
std::shared_ptr<const RegexDfa> compile_gbnf(std::string_view grammar);

}  // namespace md
