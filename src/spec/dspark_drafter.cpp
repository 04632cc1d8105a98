#include "megadecode/spec/dspark_drafter.h"

#include "megadecode/base/error.h"

namespace md {

DSparkDrafter::DSparkDrafter(const DraftModel& model) : model_(model), state_(model.new_state()) {}

void DSparkDrafter::observe(std::span<const int32_t> tokens, int64_t pos,
                            std::span<const float> aux) {
  if (tokens.empty()) return;
  const size_t width = size_t(model_.config().context_width());
  MD_CHECK(aux.size() == tokens.size() * width,
           "DSpark drafter: {} aux values for {} tokens of {} (the target's rows at the aux "
           "layers)",
           aux.size(), tokens.size(), width);
  positions_.resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) positions_[i] = int32_t(pos + int64_t(i));
  model_.update_context(state_, aux, positions_);
}

void DSparkDrafter::propose(std::span<const int32_t> context, std::span<int32_t> out) {
  MD_CHECK(!context.empty(), "DSpark drafter: empty context");
  // One block of out.size() rows: the anchor and out.size() - 1 mask rows. The block is causal,
  // so its first rows draft what the first rows of a longer block would.
  model_.draft(state_, context.back(), int64_t(context.size()) - 1, out);
}

}  // namespace md
