// The op table (plan/ops.h).
#include "megadecode/plan/ops.h"

#include <array>

namespace md::plan {

namespace {

using S = Slot;

constexpr OperandDesc kGemv[] = {{"w", S::kWeight}, {"x", S::kAct}, {"y", S::kActOrLogits}};
constexpr OperandDesc kEmbed[] = {{"tokens", S::kTokens},
                                  {"embed", S::kWeight},
                                  {"x0", S::kAct},
                                  {"norm", S::kWeight},
                                  {"h0", S::kAct}};
constexpr OperandDesc kKdaCore[] = {{"q", S::kAct},
                                    {"k", S::kAct},
                                    {"v", S::kAct},
                                    {"fa", S::kAct},
                                    {"ga", S::kAct},
                                    {"braw", S::kAct},
                                    {"o", S::kAct},
                                    {"f_b", S::kWeight},
                                    {"g_b", S::kWeightOpt},
                                    {"q_conv", S::kWeight},
                                    {"k_conv", S::kWeight},
                                    {"v_conv", S::kWeight},
                                    {"A_log", S::kWeight},
                                    {"dt_bias", S::kWeight},
                                    {"o_norm", S::kWeight},
                                    {"kda_state", S::kKdaState},
                                    {"conv_cache", S::kConvCache}};
constexpr OperandDesc kMlaQUp[] = {
    {"q_b", S::kWeight}, {"qa", S::kAct}, {"q_a_norm", S::kWeight}, {"q", S::kAct}};
constexpr OperandDesc kMlaLatent[] = {
    {"a", S::kAct}, {"kv_a_norm", S::kWeight}, {"mla_cache", S::kMlaCache}};
constexpr OperandDesc kMlaCore[] = {{"q", S::kAct},
                                    {"kv_b", S::kWeight},
                                    {"mla_cache", S::kMlaCache},
                                    {"out", S::kAct},
                                    {"gate", S::kActOpt}};
constexpr OperandDesc kMlaMerge[] = {
    {"parts", S::kAct}, {"kv_b", S::kWeight}, {"att", S::kAct}, {"gate", S::kActOpt}};
constexpr OperandDesc kAttnOut[] = {
    {"w", S::kWeight}, {"x", S::kAct}, {"resid", S::kActOpt}, {"out", S::kAct}};
constexpr OperandDesc kFfnNorm[] = {{"x", S::kAct}, {"norm", S::kWeight}, {"h", S::kAct}};
constexpr OperandDesc kRouter[] = {
    {"logits", S::kAct}, {"bias", S::kWeight}, {"ids", S::kAct}, {"wts", S::kAct}};
constexpr OperandDesc kGateUp[] = {
    {"gate", S::kWeight}, {"up", S::kWeight}, {"x", S::kAct}, {"act", S::kAct}};
constexpr OperandDesc kExpertGateUp[] = {{"ids", S::kAct},
                                         {"x", S::kAct},
                                         {"gate", S::kWeightSet},
                                         {"up", S::kWeightSet},
                                         {"act", S::kAct}};
constexpr OperandDesc kExpertDown[] = {
    {"ids", S::kAct}, {"act", S::kAct}, {"down", S::kWeightSet}, {"out", S::kAct}};
constexpr OperandDesc kLatentNorm[] = {
    {"wts", S::kAct}, {"dn", S::kAct}, {"norm", S::kWeightOpt}, {"r", S::kAct}};
constexpr OperandDesc kCombine[] = {
    {"x_mid", S::kAct},  {"wts", S::kActOpt},  {"out", S::kAct},   {"shared", S::kActOpt},
    {"x_next", S::kAct}, {"norm", S::kWeight}, {"h_next", S::kAct}};
constexpr OperandDesc kSample[] = {{"logits", S::kLogits}, {"next", S::kAct}};
constexpr OperandDesc kDraftCtxNorm[] = {{"x", S::kAct}, {"norm", S::kWeight}, {"h", S::kAct}};
constexpr OperandDesc kDraftCtxWrite[] = {{"k", S::kAct},
                                          {"v", S::kAct},
                                          {"k_norm", S::kWeight},
                                          {"ctx_pos", S::kAct},
                                          {"ring", S::kDraftRing}};
constexpr OperandDesc kDraftAttn[] = {{"q", S::kAct},           {"k", S::kAct},
                                      {"v", S::kAct},           {"q_norm", S::kWeight},
                                      {"k_norm", S::kWeight},   {"att", S::kAct},
                                      {"ring", S::kDraftRing}};
constexpr OperandDesc kDraftMarkov[] = {{"base", S::kAct},    {"w1", S::kWeight},
                                        {"w2", S::kWeight},   {"tokens", S::kTokens},
                                        {"drafts", S::kAct},  {"biased", S::kActOpt},
                                        {"best", S::kAct}};
constexpr OperandDesc kDraftPick[] = {{"best", S::kAct}, {"drafts", S::kAct}};
constexpr OperandDesc kAllReduce[] = {{"x", S::kAct}, {"x2", S::kActOpt}, {"resid", S::kActOpt}};
constexpr OperandDesc kLogitsGather[] = {{"logits", S::kLogits}};
constexpr OperandDesc kAllGather[] = {{"x", S::kAct}};

constexpr uint8_t kNo = 0xff;

OpDesc gemv(std::string_view name, uint32_t flags = 0) {
  return OpDesc{name, "matrix rows", kGemv, false, 1.0, Stream::kRows, {arg::Gemv::w, kNo}, flags};
}
OpDesc small(std::string_view name, std::string_view ranges, std::span<const OperandDesc> ops,
             double cost = 1.0) {
  return OpDesc{name, ranges, ops, false, cost, Stream::kNone, {kNo, kNo}, 0};
}

const std::array<OpDesc, kNumOps>& table() {
  static const std::array<OpDesc, kNumOps> t = [] {
    std::array<OpDesc, kNumOps> a{};
    auto set = [&](Op op, OpDesc d) { a[size_t(op)] = d; };
    set(Op::kEmbed, {"embed", "token rows", kEmbed, false, 1.0, Stream::kNone, {kNo, kNo}, 0});
    set(Op::kKdaProj, gemv("kda_proj"));
    // The delta rule and gates of a KDA head run at about a third of the GEMV byte rate, the MLA
    // cores at about half (measured on the reference machine).
    set(Op::kKdaCore, {"kda_core",
                       "heads of sequence `seq`",
                       kKdaCore,
                       false,
                       3.0,
                       Stream::kKdaHeads,
                       {arg::KdaCore::f_b, arg::KdaCore::g_b},
                       kFlagFullRankGate | kFlagBoundedDecay});
    set(Op::kMlaProj, gemv("mla_proj"));
    set(Op::kMlaQUp, {"mla_q_up",
                      "matrix rows",
                      kMlaQUp,
                      false,
                      1.0,
                      Stream::kRows,
                      {arg::MlaQUp::q_b, kNo},
                      0});
    set(Op::kMlaLatent,
        {"mla_latent", "sequences", kMlaLatent, false, 1.0, Stream::kNone, {kNo, kNo}, 0});
    set(Op::kMlaCore, {"mla_core",
                       "heads of sequence `seq` (KV split `slot` of `splits`)",
                       kMlaCore,
                       false,
                       2.0,
                       Stream::kMlaHeads,
                       {arg::MlaCore::kv_b, kNo},
                       kFlagOutputGate});
    set(Op::kMlaMerge, {"mla_merge",
                        "heads of sequence `seq`",
                        kMlaMerge,
                        false,
                        2.0,
                        Stream::kMlaValues,
                        {arg::MlaMerge::kv_b, kNo},
                        kFlagOutputGate});
    set(Op::kAttnOut, {"attn_out",
                       "matrix rows",
                       kAttnOut,
                       false,
                       1.0,
                       Stream::kRows,
                       {arg::AttnOut::w, kNo},
                       kFlagResidual | kFlagPartial});
    set(Op::kFfnNorm,
        {"ffn_norm", "token rows", kFfnNorm, true, 1.0, Stream::kNone, {kNo, kNo}, kFlagAttnRes});
    set(Op::kRouterLogits, gemv("router_logits"));
    set(Op::kRouter, {"router", "token rows", kRouter, false, 1.0, Stream::kNone, {kNo, kNo}, 0});
    set(Op::kDenseGateUp, {"dense_gate_up",
                           "matrix rows",
                           kGateUp,
                           false,
                           1.0,
                           Stream::kRows,
                           {arg::GateUp::gate, arg::GateUp::up},
                           0});
    set(Op::kDenseDown, gemv("dense_down", kFlagPartial));
    set(Op::kSharedGateUp, {"shared_gate_up",
                            "matrix rows",
                            kGateUp,
                            false,
                            1.0,
                            Stream::kRows,
                            {arg::GateUp::gate, arg::GateUp::up},
                            0});
    set(Op::kSharedDown, gemv("shared_down", kFlagPartial));
    set(Op::kExpertGateUp, {"expert_gate_up",
                            "matrix rows of the expert in slot `slot`",
                            kExpertGateUp,
                            false,
                            1.0,
                            Stream::kExpert,
                            {arg::ExpertGateUp::gate, arg::ExpertGateUp::up},
                            0});
    set(Op::kExpertDown, {"expert_down",
                          "matrix rows of the expert in slot `slot`",
                          kExpertDown,
                          false,
                          1.0,
                          Stream::kExpert,
                          {arg::ExpertDown::down, kNo},
                          kFlagPartial});
    set(Op::kLatentDown, gemv("latent_down"));
    set(Op::kLatentNorm,
        {"latent_norm", "token rows", kLatentNorm, false, 1.0, Stream::kNone, {kNo, kNo}, 0});
    set(Op::kLatentUp, gemv("latent_up"));
    set(Op::kCombine,
        {"combine",
         "token rows",
         kCombine,
         true,
         1.0,
         Stream::kNone,
         {kNo, kNo},
         kFlagMoeCombine | kFlagSharedExpert | kFlagLatentMoe | kFlagAttnRes | kFlagLogitRows});
    set(Op::kLmHead, gemv("lm_head"));
    set(Op::kSample, {"sample", "logit rows", kSample, false, 1.0, Stream::kNone, {kNo, kNo}, 0});
    // The draft plan. Its context rows are not token rows (the block rows are).
    set(Op::kDraftCtxProj, gemv("draft_ctx_proj"));
    set(Op::kDraftCtxNorm, small("draft_ctx_norm", "context rows", kDraftCtxNorm));
    set(Op::kDraftCtxWrite, small("draft_ctx_write", "sequence `seq`", kDraftCtxWrite));
    set(Op::kDraftProj, gemv("draft_proj"));
    // Attention over a ring of up to 2048 rows per KV head: compute, not bytes.
    set(Op::kDraftAttn, small("draft_attn", "KV heads of sequence `seq`", kDraftAttn, 3.0));
    set(Op::kDraftMarkov, {"draft_markov",
                           "vocabulary rows of slot `slot` (tile `seq`)",
                           kDraftMarkov,
                           false,
                           1.0,
                           Stream::kRows,
                           {arg::DraftMarkov::w2, kNo},
                           0});
    set(Op::kDraftPick, small("draft_pick", "sequences (slot `slot`)", kDraftPick));
    // Collectives (one instruction each; its time is the runtime's, not bytes of this worker).
    set(Op::kAllReduce, {"all_reduce", "token rows", kAllReduce, false, 1.0, Stream::kNone,
                         {kNo, kNo}, kFlagResidual});
    set(Op::kLogitsGather, small("logits_gather", "logit rows", kLogitsGather));
    set(Op::kAllGather, small("all_gather", "token rows", kAllGather));
    return a;
  }();
  return t;
}

}  // namespace

const OpDesc& op_desc(Op op) {
  static const OpDesc unknown{"?", "", {}, false, 1.0, Stream::kNone, {kNo, kNo}, 0};
  return size_t(op) < size_t(kNumOps) ? table()[size_t(op)] : unknown;
}

std::string_view op_name(Op op) {
  return op_desc(op).name;
}

std::string_view operand_name(Op op, uint32_t i) {
  const OpDesc& d = op_desc(op);
  if (i < d.operands.size()) return d.operands[i].name;
  if (!d.mix_tail) return "?";
  return i == d.operands.size() + arg::MixTail::res_w ? "res_w" : "mix_source";
}

}  // namespace md::plan
