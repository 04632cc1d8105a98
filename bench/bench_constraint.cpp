// The per-step cost of constrained decoding: TokenConstraint::allowed() over a tokenizer's
// vocabulary in the states a constrained choice passes through. A constrained choice pays this
// once per generated token, on the engine thread. The tokenizer: $MD_BENCH_TOKENIZER_DIR (e.g. a
// checkpoint made by `megadecode make-model --preset kl48-e32`, 163840 ids), else the small test
// tokenizer in tests/data/tokenizer.
//   MD_BENCH_TOKENIZER_DIR=models/kl48-e32 ./build/bench/megadecode_bench_constraint
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megadecode/engine/json_schema.h"
#include "megadecode/engine/token_constraint.h"
#include "megadecode/server/chat_constraints.h"
#include "megadecode/tokenizer/tokenizer.h"

namespace {

using md::ConstraintElement;

const md::Tokenizer& kimi_tokenizer() {
  static const md::Tokenizer tok = [] {
    const char* dir = std::getenv("MD_BENCH_TOKENIZER_DIR");
    return md::Tokenizer::load(dir && *dir ? dir : MD_BENCH_TOKENIZER_DIR);
  }();
  return tok;
}

// A JSON-object program, advanced through `prefix`; then one mask per iteration.
void run(benchmark::State& state, std::shared_ptr<const md::ConstraintProgram> program,
         const std::string& prefix) {
  const md::Tokenizer& tok = kimi_tokenizer();
  auto vocab = std::make_shared<const md::ConstraintVocab>(tok, tok.vocab_size());
  md::TokenConstraint c(std::move(program), vocab);
  for (int32_t id : tok.encode(prefix, true)) c.accept(id);
  if (c.broken()) state.SkipWithError("the prefix broke the constraint");
  std::vector<uint8_t> mask(size_t(vocab->size()));
  int64_t allowed = 0;
  for (auto _ : state) {
    allowed = c.allowed(mask);
    benchmark::DoNotOptimize(mask.data());
  }
  state.counters["allowed"] = double(allowed);
  state.counters["vocab"] = double(vocab->size());
}

std::shared_ptr<const md::ConstraintProgram> json_program() {
  return md::server::json_object_program(md::TemplateKind::kKimi, false, kimi_tokenizer(),
                                         {*kimi_tokenizer().special_id("<|im_end|>")});
}

void BM_MaskJsonStart(benchmark::State& s) { run(s, json_program(), ""); }
void BM_MaskJsonString(benchmark::State& s) { run(s, json_program(), "{\"city\": \"Par"); }
void BM_MaskJsonValue(benchmark::State& s) { run(s, json_program(), "{\"city\":"); }
void BM_MaskJsonNumber(benchmark::State& s) { run(s, json_program(), "{\"n\": 12"); }
void BM_MaskToolName(benchmark::State& s) {
  md::server::ToolChoice required{md::server::ToolChoice::Mode::kRequired, ""};
  run(s,
      md::server::tool_choice_program(md::TemplateKind::kKimi, required,
                                      {"get_time", "get_weather", "search"}, kimi_tokenizer(),
                                      {}),
      "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_");
}
void BM_MaskFreeTextNone(benchmark::State& s) {
  md::server::ToolChoice none{md::server::ToolChoice::Mode::kNone, ""};
  run(s,
      md::server::tool_choice_program(md::TemplateKind::kKimi, none, {"f"}, kimi_tokenizer(), {}),
      "Sure, here");
}

// The same states with a JSON Schema (engine/json_schema.h): a key among the members, an enum
// value, a free string value, an integer.
std::shared_ptr<const md::ConstraintProgram> schema_program() {
  const auto schema = md::JsonSchema::compile(nlohmann::json::parse(R"({
      "type": "object", "additionalProperties": false, "required": ["city", "unit"],
      "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                     "unit": {"enum": ["celsius", "fahrenheit", "kelvin"]},
                     "days": {"type": "integer"}}})"));
  return md::server::json_object_program(md::TemplateKind::kKimi, false, kimi_tokenizer(),
                                         {*kimi_tokenizer().special_id("<|im_end|>")}, schema);
}
void BM_MaskSchemaKey(benchmark::State& s) {
  run(s, schema_program(), "{\"c");
}
void BM_MaskSchemaEnum(benchmark::State& s) {
  run(s, schema_program(), "{\"city\": \"Paris\", \"unit\": \"c");
}
void BM_MaskSchemaString(benchmark::State& s) {
  run(s, schema_program(), "{\"city\": \"Par");
}
void BM_MaskSchemaInteger(benchmark::State& s) {
  run(s, schema_program(), "{\"days\": 12");
}

// Structured outputs (server/structured_outputs.h): a regex in a state where most bytes go on
// (free text of a class), one where few do (digits), and a choice among names.
std::shared_ptr<const md::ConstraintProgram> regex_program(const char* pattern) {
  ConstraintElement e;
  e.kind = ConstraintElement::Kind::kRegex;
  e.regex = md::RegexDfa::compile(pattern);
  return md::server::structured_output_program(md::TemplateKind::kKimi, false, kimi_tokenizer(),
                                               {*kimi_tokenizer().special_id("<|im_end|>")},
                                               std::move(e));
}
void BM_MaskRegexText(benchmark::State& s) {
  run(s, regex_program("[A-Z][^\\n]{0,200}\\."), "The answer is");
}
void BM_MaskRegexDigits(benchmark::State& s) {
  run(s, regex_program("\\d{3}-\\d{4}( x\\d{1,4})?"), "555-1");
}
void BM_MaskChoice(benchmark::State& s) {
  ConstraintElement e;
  e.kind = ConstraintElement::Kind::kName;
  e.names = {"negative", "neutral", "positive"};
  run(s,
      md::server::structured_output_program(md::TemplateKind::kKimi, false, kimi_tokenizer(),
                                            {*kimi_tokenizer().special_id("<|im_end|>")},
                                            std::move(e)),
      "ne");
}

// A recursive grammar (engine/grammar.h): JSON as GBNF (tests/data/grammars/json.gbnf), inside a
// string and where a value starts.
std::shared_ptr<const md::ConstraintProgram> json_grammar_program() {
  ConstraintElement e;
  e.kind = ConstraintElement::Kind::kGrammar;
  std::ifstream f(std::string(MD_BENCH_TOKENIZER_DIR) + "/../grammars/json.gbnf");
  e.grammar = md::Grammar::compile_gbnf(
      std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()));
  return md::server::structured_output_program(md::TemplateKind::kKimi, false, kimi_tokenizer(),
                                               {*kimi_tokenizer().special_id("<|im_end|>")},
                                               std::move(e));
}
void BM_MaskGrammarString(benchmark::State& s) {
  run(s, json_grammar_program(), "{\"city\": [{\"name\": \"Par");
}
void BM_MaskGrammarValue(benchmark::State& s) {
  run(s, json_grammar_program(), "{\"city\": [{\"name\":");
}

// The first mask in a state: the per-frame splits computed (grammar_masks.h) for a constraint
// that has not seen the state before (the prefix's own masks are not taken).
void BM_MaskGrammarValueFirst(benchmark::State& state) {
  const md::Tokenizer& tok = kimi_tokenizer();
  auto vocab = std::make_shared<const md::ConstraintVocab>(tok, tok.vocab_size());
  const auto program = json_grammar_program();
  const std::vector<int32_t> prefix = tok.encode("{\"city\": [{\"name\":", true);
  std::vector<uint8_t> mask(size_t(vocab->size()));
  for (auto _ : state) {
    md::TokenConstraint c(program, vocab);
    for (int32_t id : prefix) c.accept(id);
    benchmark::DoNotOptimize(c.allowed(mask));
  }
}

BENCHMARK(BM_MaskGrammarString)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskGrammarValueFirst)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskGrammarValue)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskRegexText)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskRegexDigits)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskChoice)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskSchemaKey)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskSchemaEnum)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskSchemaString)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskSchemaInteger)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskJsonStart)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskJsonString)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskJsonValue)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskJsonNumber)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskToolName)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MaskFreeTextNone)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
