// Random walks through a constraint's masks (the regex and grammar elements' tests): at every
// step the mask must agree with allows() for every id, and allow the stop token exactly when
// `whole(text)` says the text so far is a whole answer; the walk draws among the allowed ids,
// leaning towards those holding a byte of `lean` (so that walks end) and taking the stop token a
// third of the times it is allowed.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <random>
#include <string>

#include "megadecode/engine/token_constraint.h"
#include "megadecode/tokenizer/tokenizer.h"
#include "test_util.h"

namespace md::test {

// The tiny test checkpoint's BPE tokenizer: multi-byte tokens, tokens that end mid-character.
inline const Tokenizer& bpe_test_tokenizer() {
  static const Tokenizer tok = Tokenizer::load(shared_text_checkpoint("tiny", 31));
  return tok;
}

// The elements, then a stop element taking `stop`.
inline std::shared_ptr<const ConstraintProgram> then_stop(std::vector<ConstraintElement> el,
                                                          int32_t stop) {
  el.emplace_back();
  el.back().kind = ConstraintElement::Kind::kStop;
  el.back().stop_ids = {stop};
  return std::make_shared<const ConstraintProgram>(std::move(el));
}

struct Walk {
  bool finished = false;  // the stop token was drawn
  std::string text;       // the answer's bytes (without the stop token)
};

inline Walk walk_masks(const Tokenizer& tok, std::shared_ptr<const ConstraintProgram> program,
                       std::shared_ptr<const ConstraintVocab> vocab, int32_t stop,
                       const std::string& lean, std::mt19937_64& rng, int steps,
                       const std::function<bool(const std::string&)>& whole) {
  const int64_t v = vocab->size();
  TokenConstraint c(std::move(program), std::move(vocab));
  Walk w;
  std::vector<uint8_t> m(static_cast<size_t>(v));
  for (int step = 0; step < steps && !c.finished(); ++step) {
    c.allowed(m);
    std::vector<int32_t> allowed, leaning;
    for (int32_t id = 0; id < v; ++id) {
      if (m[size_t(id)] != (c.allows(id) ? 1 : 0)) {
        ADD_FAILURE() << "mask and allows() differ on id " << id << " after '" << w.text << "'";
        return w;
      }
      if (!m[size_t(id)]) continue;
      allowed.push_back(id);
      if (!lean.empty() && !tok.is_special(id) &&
          tok.token_bytes(id).find_first_of(lean) != std::string_view::npos)
        leaning.push_back(id);
    }
    const bool is_whole = whole(w.text);
    if (allowed.empty() || (m[size_t(stop)] == 1) != is_whole ||
        (is_whole && allowed.size() == 1 && allowed[0] != stop)) {
      ADD_FAILURE() << "after '" << w.text << "': " << allowed.size() << " allowed, stop "
                    << int(m[size_t(stop)]) << ", whole " << is_whole;
      return w;
    }
    const auto& pool = !leaning.empty() && rng() % 3 != 0 ? leaning : allowed;
    const int32_t id = m[size_t(stop)] && rng() % 3 == 0 ? stop : pool[rng() % pool.size()];
    c.accept(id);
    if (c.broken()) {
      ADD_FAILURE() << "an allowed id broke the constraint";
      return w;
    }
    if (id == stop) {
      w.finished = true;
      EXPECT_TRUE(c.finished());
    } else {
      w.text += tok.token_bytes(id);
    }
  }
  return w;
}

}  // namespace md::test
