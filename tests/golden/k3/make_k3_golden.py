#!/usr/bin/env python3
"""Writes the k3-tiny random Kimi K3 checkpoint (official K3 schema, MXFP4 routed experts) and its
golden data, computed by the independent numpy reference k3_reference.py.

    python3 tests/golden/k3/make_k3_golden.py [out_dir]      (default tests/data/golden/k3-tiny)

Deterministic (numpy PCG64 with fixed seeds); needs only numpy. See tests/golden/k3/README.md.
"""

import copy
import json
import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import k3_reference as ref  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "golden", "k3-tiny")

# ---------------------------------------------------------------------------------------------
# geometry (fixed by the C++ preset)
# ---------------------------------------------------------------------------------------------
V, D, NL = 1024, 64, 6
DENSE_I = 128
MLA_1IDX = [4, 6]
KDA_1IDX = [i for i in range(1, NL + 1) if i not in MLA_1IDX]
H, K, CONV = 2, 32, 4
A_LOG_LEN = 4                     # more entries than heads (K3 stores 128 for 96 heads)
HM, QL, KVL, NOPE, ROPE, VD = 2, 48, 32, 16, 8, 16
E, TOPK, LAT, MI, NSH = 8, 2, 64, 64, 2   # 2 MXFP4 scale groups per expert row
BLOCK = 2
GLB = -5.0
BETA, LBETA = 4.0, 25.0
EPS = 1e-5
BOS, EOS, PAD = V - 256, V - 254, V - 1
PROMPT_LEN, DECODE_LEN = 20, 8
ROUTER_GAP_TARGET = 0.03          # bias-corrected score gap k-th vs (k+1)-th, every MoE decision
ROUTER_NOISE_RATIO = 10.0         # ... and >= this x the decision's bf16-emulation score noise
TOP1_GAP_TARGET = 0.3             # top1-top2 logit gap of every row (argmax robust)
WEIGHT_SEED = 20250752
QK_ALIGN = 0.9                    # KDA: correlation of the q and k projections / conv taps
V_GAIN = 2.0                      # KDA: v_proj gain
MLA_QK_GAIN = 1.0                 # MLA: q_b_proj and kv_a_proj_with_mqa gain (score spread)
SITU_GATE_GAIN, SITU_UP_GAIN = 2.5, 5.0
ROUTER_GAIN = 1.7
RES_GAIN = 2.0


def config():
    quant = {
        "config_groups": {"group_0": {
            "format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None,
            "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                        "group_size": 32, "num_bits": 4, "observer": "minmax",
                        "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                        "symmetric": True, "type": "float", "zp_dtype": None}}},
        "format": "mxfp4-pack-quantized", "global_compression_ratio": None,
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                   "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed"}
    text = {
        "activation_situ_beta": BETA, "activation_situ_linear_beta": LBETA,
        "architectures": ["KimiLinearForCausalLM"], "attn_res_block_size": BLOCK,
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                     "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"},
        "bos_token_id": BOS, "dtype": "bfloat16", "eos_token_id": EOS,
        "first_k_dense_replace": 1, "hidden_act": "situ", "hidden_size": D,
        "initializer_range": 0.02, "intermediate_size": DENSE_I, "kv_lora_rank": KVL,
        "latent_moe_use_norm": True,
        "linear_attn_config": {"full_attn_layers": MLA_1IDX, "gate_lower_bound": GLB,
                               "head_dim": K, "kda_layers": KDA_1IDX, "num_heads": H,
                               "short_conv_kernel_size": CONV, "use_full_rank_gate": True},
        "max_position_embeddings": 4096, "mla_use_nope": True, "mla_use_output_gate": True,
        "model_type": "kimi_linear", "moe_intermediate_size": MI, "moe_layer_freq": 1,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "num_attention_heads": HM, "num_expert_group": 1, "num_experts": E,
        "num_experts_per_token": TOPK, "num_hidden_layers": NL, "num_key_value_heads": HM,
        "num_nextn_predict_layers": 0, "num_shared_experts": NSH, "pad_token_id": PAD,
        "q_lora_rank": QL, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
        "quantization_config": quant, "rms_norm_eps": EPS, "routed_expert_hidden_size": LAT,
        "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1,
        "topk_method": "noaux_tc", "transformers_version": "4.56.2", "use_bfloat16": False,
        "use_cache": True, "use_grouped_topk": True, "v_head_dim": VD, "vocab_size": V,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                     "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        "bos_token_id": BOS, "dtype": "bfloat16", "eos_token_id": EOS, "ignore_index": -100,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "media_placeholder_token_id": V - 256 + 21, "model_type": "kimi_k3", "pad_token_id": PAD,
        "text_config": text, "tie_word_embeddings": False, "transformers_version": "4.56.2",
        "vision_config": {"merge_kernel_size": [2, 2], "patch_size": 2, "text_hidden_size": D,
                          "vt_hidden_size": 8, "vt_num_hidden_layers": 0,
                          "mm_hidden_size": 8, "mm_projector_type": "patchmergerv2"},
    }


# ---------------------------------------------------------------------------------------------
# tensor helpers
# ---------------------------------------------------------------------------------------------

def bf16_bits(x):
    """float -> bf16 bit pattern, round to nearest even."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def bf16_round(x):
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def quantize_mxfp4(w, rng):
    """w float [N, Kin] -> (packed uint8 [N, Kin/2], scale uint8 [N, Kin/32]). Per 32-group E8M0
    exponent chosen so that max|w| maps into [0, 6]; values rounded to the nearest e2m1 code; the
    sign bit is kept for values that round to zero (-0 codes occur)."""
    n, kin = w.shape
    g = w.reshape(n, kin // 32, 32)
    amax = np.abs(g).max(axis=2)
    e = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int64)
    scale_u8 = (e + 127).astype(np.uint8)
    y = g / np.ldexp(1.0, e)[:, :, None]
    mag = np.abs(y)[..., None]
    codes = np.argmin(np.abs(mag - ref.E2M1[None, None, None, :]), axis=3).astype(np.uint8)
    codes |= (y < 0).astype(np.uint8) << 3
    codes = codes.reshape(n, kin)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale_u8


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype_string, numpy array already in that dtype's storage)."""
    header, blobs, off = {}, [], 0
    for name, dt, arr in sorted(tensors, key=lambda t: t[0]):
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((-len(h)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def make_weights(weight_seed):
    rng = np.random.default_rng(weight_seed)
    T = []
    P = "language_model.model."

    def bf(name, arr):
        T.append((name, "BF16", bf16_bits(arr)))

    def f32(name, arr):
        T.append((name, "F32", np.asarray(arr, dtype="<f4")))

    def lin(o, i, gain=1.0):
        return rng.normal(0.0, gain / np.sqrt(i), size=(o, i))

    def normw(n):
        return 1.0 + 0.1 * rng.normal(size=n)

    def res_pair(prefix):
        # AttnRes score weight: norm weight x proj weight; the proj gain makes the softmax over
        # sources clearly non-uniform (scores ~ N(0, 2^2))
        bf(prefix + "_res_norm.weight", normw(D))
        bf(prefix + "_res_proj.weight", lin(1, D, RES_GAIN))

    def situ_mlp(prefix, inter, din, dout, names):
        # gate pre-activations ~ N(0, 2.5^2), up ~ N(0, 5^2): both SiTU betas matter
        # (4*tanh(g/4) and 25*tanh(u/25) differ visibly from g and u)
        bf(prefix + names[0], lin(inter, din, SITU_GATE_GAIN))
        bf(prefix + names[1], lin(inter, din, SITU_UP_GAIN))
        bf(prefix + names[2], lin(dout, inter, 1.0 / SITU_UP_GAIN))

    bf(P + "embed_tokens.weight", rng.normal(size=(V, D)))
    bf(P + "norm.weight", normw(D))
    res_pair(P + "output_attn")
    lm = rng.normal(0.0, 2.0 / np.sqrt(D), size=(V, D)) * np.exp(0.35 * rng.normal(size=(V, 1)))
    bf("language_model.lm_head.weight", lm)

    mla0 = set(i - 1 for i in MLA_1IDX)
    for i in range(NL):
        p = f"{P}layers.{i}."
        bf(p + "input_layernorm.weight", normw(D))
        bf(p + "post_attention_layernorm.weight", normw(D))
        res_pair(p + "self_attention")
        res_pair(p + "mlp")
        a = p + "self_attn."
        if i in mla0:
            bf(a + "q_a_proj.weight", lin(QL, D))
            bf(a + "q_a_layernorm.weight", normw(QL))
            bf(a + "q_b_proj.weight", lin(HM * (NOPE + ROPE), QL, MLA_QK_GAIN))
            bf(a + "kv_a_proj_with_mqa.weight", lin(KVL + ROPE, D, MLA_QK_GAIN))
            bf(a + "kv_a_layernorm.weight", normw(KVL))
            bf(a + "kv_b_proj.weight", lin(HM * (NOPE + VD), KVL))
            bf(a + "g_proj.weight", lin(HM * VD, D, 1.5))
            bf(a + "o_proj.weight", lin(D, HM * VD))
        else:
            C = H * K
            # q and k share most of their projection and conv taps (cosine QK_ALIGN), as trained
            # queries and keys do: with independent random q/k weights, k.q is a small difference
            # of large terms (cosines ~0.1) and bf16 rounding of the inputs moves the KDA output
            # by tens of percent. v gets gain V_GAIN so that rms(o) stays far above sqrt(eps)
            # of the gated output norm.
            qw, kw_ = lin(C, D), lin(C, D)
            qc = rng.normal(0.0, 0.5, size=(C, 1, CONV))
            kc = rng.normal(0.0, 0.5, size=(C, 1, CONV))
            alt = np.sqrt(1.0 - QK_ALIGN ** 2)
            bf(a + "q_proj.weight", qw)
            f32(a + "q_conv1d.weight", qc)
            bf(a + "k_proj.weight", QK_ALIGN * qw + alt * kw_)
            f32(a + "k_conv1d.weight", QK_ALIGN * qc + alt * kc)
            bf(a + "v_proj.weight", lin(C, D, V_GAIN))
            f32(a + "v_conv1d.weight", rng.normal(0.0, 0.5, size=(C, 1, CONV)))
            bf(a + "f_a_proj.weight", lin(K, D))
            bf(a + "f_b_proj.weight", lin(C, K, 0.3))               # f_b(f_a(x)) ~ N(0, 0.3^2)
            f32(a + "dt_bias", rng.uniform(-2.2, -1.0, size=C))
            # exp(A_log) in [1, 2]; the entries past H are junk an engine must not read
            A = np.concatenate([np.log(rng.uniform(1.0, 2.0, size=H)),
                                rng.uniform(3.0, 5.0, size=A_LOG_LEN - H)])
            f32(a + "A_log", A)
            bf(a + "b_proj.weight", lin(H, D))
            bf(a + "g_proj.weight", lin(C, D, 1.5))
            f32(a + "o_norm.weight", normw(K))
            bf(a + "o_proj.weight", lin(D, C))
        if i == 0:
            situ_mlp(p + "mlp.", DENSE_I, D, D, ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
        else:
            m = p + "block_sparse_moe."
            bf(m + "gate.weight", lin(E, D, ROUTER_GAIN))           # K3 keeps the router in BF16
            f32(m + "gate.e_score_correction_bias", rng.normal(0.0, 0.05, size=E))
            bf(m + "routed_expert_down_proj.weight", lin(LAT, D))
            bf(m + "routed_expert_norm.weight", normw(LAT))
            bf(m + "routed_expert_up_proj.weight", lin(D, LAT))
            situ_mlp(m + "shared_experts.", MI * NSH, D, D,
                     ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
            for e in range(E):
                for wn, (o, i_, gain) in (("w1", (MI, LAT, SITU_GATE_GAIN)),
                                          ("w3", (MI, LAT, SITU_UP_GAIN)),
                                          ("w2", (LAT, MI, 1.0 / SITU_UP_GAIN))):
                    # a spread of magnitudes per row and per 32-column group, so that rows and the
                    # groups within a row get different E8M0 exponents
                    w = lin(o, i_, gain) * np.exp2(rng.integers(-2, 3, size=(o, 1)))
                    w = w * np.repeat(np.exp2(rng.integers(-1, 2, size=(o, i_ // 32))), 32, axis=1)
                    pk, sc = quantize_mxfp4(w, rng)
                    T.append((f"{m}experts.{e}.{wn}.weight_packed", "U8", pk))
                    T.append((f"{m}experts.{e}.{wn}.weight_scale", "U8", sc))
    # vision tower / projector tensors an engine must ignore
    bf("vision_tower.patch_embed.proj.weight", rng.normal(size=(8, 3, 2, 2)))
    bf("mm_projector.proj.0.weight", rng.normal(size=(16, 16)))
    return T


# ---------------------------------------------------------------------------------------------
# id selection
# ---------------------------------------------------------------------------------------------

def min_gap(tr):
    return min(r["gap"] for r in tr["routes"])


def top_gap(lg):
    s = np.sort(lg)
    return float(s[-1] - s[-2])


def router_noise(tr, trb):
    """Per MoE decision: the largest |bf16-emulated - float64| change of a bias-corrected score."""
    return [float(np.max(np.abs(np.array(a["biased"]) - np.array(b["biased"]))))
            for a, b in zip(tr["routes"], trb["routes"])]


def same_routes(tr, trb):
    return all(sorted(a["ids"]) == sorted(b["ids"]) for a, b in zip(tr["routes"], trb["routes"]))


def bf16_ulp(x):
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    return float(np.ldexp(1.0, int(np.floor(np.log2(max(abs(x), 1e-30)))) - 7))


def top1_needed(lg, lgb):
    """The top1-top2 gap a row needs so that the engine test's argmax rule applies to it (the rule
    of test_golden_k3.cpp): 2 bf16 ulps of the top logit + 2 sqrt(2) x the emulation's max |logit
    change|, and at least TOP1_GAP_TARGET."""
    return max(TOP1_GAP_TARGET,
               2 * bf16_ulp(np.max(lg)) + 2 * np.sqrt(2) * float(np.max(np.abs(lgb - lg))))


def position_ok(lg, tr, lgb, trb):
    """Selection test of one position (float64 run `lg, tr`, bf16 emulation `lgb, trb`): every
    router gap >= ROUTER_GAP_TARGET and >= ROUTER_NOISE_RATIO x that decision's bf16 score noise,
    the emulation picks the same expert sets, top1-top2 logit gap >= TOP1_GAP_TARGET, same argmax."""
    if top_gap(lg) < top1_needed(lg, lgb) or int(np.argmax(lg)) != int(np.argmax(lgb)):
        return False
    if not same_routes(tr, trb):
        return False
    return all(r["gap"] >= max(ROUTER_GAP_TARGET, ROUTER_NOISE_RATIO * n)
               for r, n in zip(tr["routes"], router_noise(tr, trb)))


def choose_ids(model, emu, seed):
    """BOS, then every further id (prompt and decode alike) drawn uniformly from [0, V-256) and
    redrawn (up to 500 times) while its position fails position_ok. The float64 reference and the
    bf16 emulation run in lockstep (the emulation with the engine's prefill rounding points for
    prompt positions, its decode ones after). Decode ids are teacher-forced like the prompt (a
    free greedy run almost never keeps all router decisions clear of near-ties); the argmax of
    every row is recorded instead."""
    rng = np.random.default_rng(seed)
    st, stb = model.new_state(), emu.new_state()
    lg, tr = model.step(st, BOS)
    lgb, trb = emu.step(stb, BOS, "prefill")
    if not position_ok(lg, tr, lgb, trb):
        return None
    ids = [BOS]
    redraws = 0
    while len(ids) < PROMPT_LEN + DECODE_LEN:
        phase = "prefill" if len(ids) < PROMPT_LEN else "decode"
        for _ in range(500):
            t = int(rng.integers(0, V - 256))
            trial, trialb = copy.deepcopy(st), copy.deepcopy(stb)
            lg2, tr2 = model.step(trial, t)
            lgb2, trb2 = emu.step(trialb, t, phase)
            if position_ok(lg2, tr2, lgb2, trb2):
                break
            redraws += 1
        else:
            return None
        st, stb = trial, trialb
        ids.append(t)
    return ids[:PROMPT_LEN], ids[PROMPT_LEN:], redraws


def protocols_ok(model, emu, ids, P):
    """The selection holds for every call protocol the engine test runs, not only the one the ids
    were drawn with: same expert sets, same argmax and the top1 rule's margin at every position."""
    lg, tr = ref.run_sequence(model, ids)
    for split in (P, 0, len(ids)):
        lb, trb = ref.run_sequence(emu, ids, split)
        for i in range(len(ids)):
            if not same_routes(tr[i], trb[i]) or int(np.argmax(lg[i])) != int(np.argmax(lb[i])) \
                    or top_gap(lg[i]) < top1_needed(lg[i], lb[i]):
                return False
    return True


def main():
    os.makedirs(OUT, exist_ok=True)
    cfg = config()
    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    # The BOS row is the same for every id seed: if it misses the targets, move to the next
    # weight seed.
    for weight_seed in range(WEIGHT_SEED, WEIGHT_SEED + 100):
        write_safetensors(os.path.join(OUT, "model.safetensors"), make_weights(weight_seed))
        model = ref.K3Reference(OUT)
        emu = ref.K3Reference(OUT, bf16=True)
        assert model.ignored == ["mm_projector.proj.0.weight",
                                 "vision_tower.patch_embed.proj.weight"], model.ignored
        lg0, tr0 = model.step(model.new_state(), BOS)
        lgb0, trb0 = emu.step(emu.new_state(), BOS, "prefill")
        if not position_ok(lg0, tr0, lgb0, trb0):
            continue
        for seed in range(200):
            got = choose_ids(model, emu, seed)
            if got is not None and protocols_ok(model, emu, got[0] + got[1], len(got[0])):
                break
            got = None
        if got is not None:
            break
    else:
        raise SystemExit("no seed met the targets")
    prompt, decode, redraws = got
    ids = prompt + decode
    P, Dn = len(prompt), len(decode)
    logits, traces = ref.run_sequence(model, ids)
    logits.astype("<f8").tofile(os.path.join(OUT, "logits_f64.bin"))
    logits.astype("<f4").tofile(os.path.join(OUT, "logits_f32.bin"))
    hidden = np.stack([t["final_hidden"] for t in traces])
    hidden.astype("<f8").tofile(os.path.join(OUT, "final_hidden_f64.bin"))

    # The reference's own bf16 noise: the bf16 emulation (engine rounding points) against float64,
    # per position, for the three call protocols the engine test runs.
    rms = np.sqrt(np.mean(logits * logits, axis=1))
    emulation = {}
    for name, split in (("golden", P), ("all_decode", 0), ("all_prefill", P + Dn)):
        lb, trb = ref.run_sequence(emu, ids, split)
        if name == "golden":
            lb.astype("<f4").tofile(os.path.join(OUT, "logits_bf16emu.bin"))
        diff = lb - logits
        ratios = [min(r["gap"] / max(n, 1e-30) for r, n in zip(a["routes"], router_noise(a, b)))
                  for a, b in zip(traces, trb)]
        emulation[name] = {
            "prefill_ids": split,
            "rel_rms": [float(x) for x in np.sqrt(np.mean(diff * diff, axis=1)) / rms],
            "max_abs": [float(x) for x in np.max(np.abs(diff), axis=1)],
            "routes_identical": all(same_routes(a, b) for a, b in zip(traces, trb)),
            "argmax_identical": bool(np.all(np.argmax(lb, axis=1) == np.argmax(logits, axis=1))),
            "max_router_score_noise": float(max(max(router_noise(a, b)) for a, b in zip(traces, trb))),
            "min_router_gap_over_noise": float(min(ratios)),
        }
        assert emulation[name]["routes_identical"] and emulation[name]["argmax_identical"], name

    gaps = [min_gap(t) for t in traces]
    decays = np.concatenate([np.concatenate(t["decay"]) for t in traces])
    routes = [[{"layer": r["layer"], "ids": r["ids"], "weights": r["weights"], "gap": r["gap"]}
               for r in t["routes"]] for t in traces]
    res_probs = traces[-1]["res_probs"]

    # sensitivity of the goldens to the disputed alternatives (max |logit diff| over all rows)
    def ablate(setup):
        m2 = ref.K3Reference(OUT)
        setup(m2)
        lg2, _ = ref.run_sequence(m2, ids)
        return float(np.max(np.abs(lg2 - logits)))
    ablations = {
        "no_gate_lower_bound (Kimi-Linear softplus gate)": ablate(lambda m: setattr(m, "lower_bound", None)),
        "situ_without_linear_beta": ablate(lambda m: setattr(m, "linear_beta", None)),
        "situ_gate_as_plain_silu (beta -> inf)": ablate(lambda m: setattr(m, "beta", 1e9)),
        "no_latent_norm": ablate(lambda m: setattr(m, "latent_norm", False)),
        "router_weights_from_biased_scores": ablate(lambda m: setattr(m, "biased_weights", True)),
        "attn_res_block_size_1": ablate(lambda m: setattr(m, "block", 1)),
        "attn_res_block_size_3": ablate(lambda m: setattr(m, "block", 3)),
        "mla_lora_norm_eps_1e-5": ablate(lambda m: setattr(m, "lora_eps", 1e-5)),
    }

    golden = {
        "reference": "tests/golden/k3/k3_reference.py (independent float64 numpy, one token at a time)",
        "model": "k3-tiny",
        "vocab_size": V,
        "prompt_ids": prompt,
        "decode_ids": decode,
        "prefill_len": P,
        "decode_len": Dn,
        "decode_is_greedy": False,
        "argmax": [int(np.argmax(r)) for r in logits],
        "top1_gaps": [top_gap(r) for r in logits],
        "ids_seed": seed,
        "weight_seed": weight_seed,
        "selection": {"router_gap_target": ROUTER_GAP_TARGET,
                      "router_noise_ratio": ROUTER_NOISE_RATIO,
                      "top1_gap_target": TOP1_GAP_TARGET,
                      "draw": "BOS then uniform [0, vocab-256), redrawn while any router gap is < target or < "
                              "router_noise_ratio x the bf16 emulation's score noise at that decision, the "
                              "emulation picks other experts or another argmax, or the row's top1 gap < target",
                      "redraws": redraws},
        "bf16_emulation": {
            "what": "k3_reference.py with bf16=True: the float64 math rounded to bf16 at megadecode's BF16 "
                    "rounding points (README 'bf16 rounding points'), run with the same ids; the engine's MLA "
                    "prefill rounding points for the first prefill_ids positions, its decode ones after",
            "rel_rms": "per position: RMS(emulated - float64 logits) / RMS(float64 logits)",
            "max_abs": "per position: max |emulated - float64 logit|",
            "logits_file": {"logits_bf16emu.bin": "float32 LE [P+D][vocab], the golden protocol's emulated "
                                                  "logits (bf16 values)"},
            "protocols": emulation},
        "logits_files": {"logits_f64.bin": "float64 LE [P+D][vocab]",
                         "logits_f32.bin": "the same rounded to float32"},
        "final_hidden_file": {"final_hidden_f64.bin": "float64 LE [P+D][hidden]: RMSNorm(output AttnRes mix, norm) before lm_head"},
        "shape": [P + Dn, V],
        "row_meaning": "row i = logits after input position i (prompt rows 0..P-1, then row P+j after decode_ids[j]); "
                       "decode ids are teacher-forced, not greedy",
        "min_router_gap": float(min(gaps)),
        "min_router_gap_prefill": float(min(gaps[:P])),
        "min_router_gap_decode": float(min(gaps[P:])),
        "position_min_router_gap": [float(g) for g in gaps],
        "min_top1_gap": float(min(top_gap(r) for r in logits)),
        "kda_stats": {"min_o_rms": float(min(x for t in traces for x in t["kda_o_rms"])),
                      "median_o_rms": float(np.median([x for t in traces for x in t["kda_o_rms"]])),
                      "sqrt_eps_o_norm": float(np.sqrt(EPS)),
                      "min_qk_cos": float(min(x for t in traces for x in t["kda_qk_cos"])),
                      "median_qk_cos": float(np.median([x for t in traces for x in t["kda_qk_cos"]]))},
        "logit_std": float(logits.std()),
        "logit_max_abs": float(np.abs(logits).max()),
        "routes": routes,
        "decay_stats": {"min": float(decays.min()), "max": float(decays.max()),
                        "mean": float(decays.mean()),
                        "frac_in_0.2_0.95": float(np.mean((decays >= 0.2) & (decays <= 0.95))),
                        "frac_below_0.2": float(np.mean(decays < 0.2)),
                        "frac_above_0.95": float(np.mean(decays > 0.95))},
        "attn_res": {"block_size": BLOCK, "snapshot_layers": [i for i in range(NL) if i % BLOCK == 0],
                     "n_sources_final": traces[-1]["n_sources_final"],
                     "last_position_probs": [[float(x) for x in p] for p in res_probs],
                     "last_position_probs_order": "for each layer: attention mix (absent for layer 0), "
                                                  "then FFN mix; finally the output mix"},
        "ignored_tensors": model.ignored,
        "ablation_max_abs_logit_diff": ablations,
    }
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    tot = sum(os.path.getsize(os.path.join(OUT, n)) for n in os.listdir(OUT))
    print(f"seed {seed}; prompt {prompt}; decode {decode}; min router gap {min(gaps):.4f}; "
          f"min top1 gap {golden['min_top1_gap']:.3f}; logit std {logits.std():.2f}; "
          f"decay in [0.2,0.95] {golden['decay_stats']['frac_in_0.2_0.95']:.3f}; total {tot} bytes")
    for name, e in emulation.items():
        print(f"bf16 emulation {name}: rel RMS max {max(e['rel_rms']):.4f} median "
              f"{float(np.median(e['rel_rms'])):.4f}; min router gap / noise "
              f"{e['min_router_gap_over_noise']:.1f}")
    print(json.dumps(ablations, indent=1))


if __name__ == "__main__":
    main()
