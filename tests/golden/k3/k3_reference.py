#!/usr/bin/env python3
"""Independent float64 numpy reference of the Kimi K3 text model (model_type "kimi_k3").

Written for megadecode from the published descriptions (facts only, no code copied); see
tests/golden/k3/README.md for the sources and for every decision where sources disagree.
Deliberately simple: float64 everywhere, one token at a time, plain recurrences, no absorption
tricks, no fused kernels. Weights are read from the checkpoint exactly (bf16 -> float64 is exact;
MXFP4 routed experts are decoded exactly).

Source keys used in the comments:
  [K3CFG]  moonshotai/Kimi-K3 config.json + safetensors tensor listing (dumped in a public model
           report, corpus id 62826164383): names, shapes, dtypes, config fields.
  [K3ML]   moonshotai/Kimi-K3 modeling_kimi_linear.py, as quoted with line numbers in a public
           architecture analysis (corpus id 59322289100) and in ports that cite it
           (e.g. corpus ids 58077525422, 60611711224, 60335663056).
  [TPU]    Inferact/tpu-megakernels kimi/__init__.py (rms, route, attention_residual, kda_step,
           unpack_mxfp4).
  [FLA]    fla-org/flash-linear-attention ops/kda (gate.py naive/fused gate, fused_recurrent.py):
           lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), L2-norm eps 1e-6, scale K^-0.5.
  [CT]     neuralmagic compressed-tensors MXFP4PackedCompressor / pack_fp4_to_uint8 (E8M0 scale,
           bias 127; two e2m1 codes per byte, low nibble = even column).
  [KL]     transformers kimi_linear (the Kimi-Linear parts K3 inherits: KDA conv/recurrence, MLA
           NoPE, router) -- see tests/golden/README.md and /work/shared/MODELS.md.

Usage as a library:
    m = K3Reference("tests/data/golden/k3-tiny")
    st = m.new_state()
    logits, trace = m.step(st, token_id)

bf16 emulation (K3Reference(dir, bf16=True)): the same math with bf16 rounding R() applied at the
rounding points of megadecode's BF16 mode (src/engine/forward*.cpp, model.cpp; listed in
tests/golden/k3/README.md, "bf16 rounding points"). It exists only to measure how far bf16
activations move this checkpoint's logits from the float64 ones (the noise the engine's BF16 test
is scaled by); the goldens themselves are the float64 run.
"""

import json
import math
import os
import struct
import sys

import numpy as np

# ----------------------------------------------------------------------------------------------
# safetensors reader (format: u64 little-endian header length, JSON header, raw little-endian data)
# ----------------------------------------------------------------------------------------------

_DT = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "U8": np.uint8,
       "I8": np.int8, "I32": np.int32, "I64": np.int64, "U16": np.uint16}


def load_safetensors(path):
    """Returns {name: (dtype_string, numpy array)}. BF16 is converted exactly to float32."""
    with open(path, "rb") as f:
        blob = f.read()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + hlen])
    base = 8 + hlen
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dt = meta["dtype"]
        a, b = meta["data_offsets"]
        raw = blob[base + a:base + b]
        shape = tuple(meta["shape"])
        if dt == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32).reshape(shape)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(_DT[dt]).newbyteorder("<")).reshape(shape)
        out[name] = (dt, arr)
    return out


# ----------------------------------------------------------------------------------------------
# MXFP4 (compressed-tensors "mxfp4-pack-quantized", group 32)  [CT] [TPU unpack_mxfp4] [K3CFG]
# ----------------------------------------------------------------------------------------------

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


def decode_mxfp4(packed, scale, group=32):
    """packed uint8 [N, K/2] (low nibble = column 2j, high nibble = column 2j+1),
    scale uint8 [N, K/group] E8M0 (value 2^(s-127)). Returns float64 [N, K], exact."""
    packed = np.asarray(packed, dtype=np.uint8)
    n, half = packed.shape
    k = half * 2
    codes = np.empty((n, k), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    mag = E2M1[codes & 7]
    val = np.where(codes & 8, -mag, mag)
    assert scale.shape == (n, k // group), (scale.shape, n, k)
    s = np.ldexp(1.0, scale.astype(np.int64) - 127)          # 2^(s-127), exact
    return val * np.repeat(s, group, axis=1)


# ----------------------------------------------------------------------------------------------
# elementwise helpers
# ----------------------------------------------------------------------------------------------

def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def rmsnorm(x, w, eps):
    # x * rsqrt(mean(x^2) + eps) * w   [KL KimiRMSNorm; K3ML same class]
    return x / np.sqrt(np.mean(x * x) + eps) * w


def bf16_round(x):
    """Round to the nearest bf16 (ties to even) through float32, as an fp32 engine rounds its fp32
    results; returned as float64."""
    u = np.asarray(x, dtype=np.float64).astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


def _identity(x):
    return x


def situ_glu(g, u, beta, linear_beta):
    # SiTU-GLU [K3ML SituAndMul, lines 75-82]:
    #   beta * tanh(g / beta) * sigmoid(g)  *  linear_beta * tanh(u / linear_beta)
    # (the up half is left unbounded when linear_beta is null)
    a = beta * np.tanh(g / beta) * sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * np.tanh(u / linear_beta)
    return a * u


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------

class K3Reference:
    def __init__(self, model_dir, verbose=False, bf16=False):
        # bf16 emulation: R rounds to bf16 at the engine's rounding points; identity in float64
        self.bf16 = bf16
        self.R = bf16_round if bf16 else _identity
        with open(os.path.join(model_dir, "config.json")) as f:
            full = json.load(f)
        # [K3CFG]: top level model_type kimi_k3 with text_config (model_type kimi_linear)
        assert full.get("model_type") == "kimi_k3", full.get("model_type")
        c = full["text_config"]
        self.cfg = c
        lac = c["linear_attn_config"]
        self.V = c["vocab_size"]
        self.D = c["hidden_size"]
        self.n_layers = c["num_hidden_layers"]
        self.eps = c["rms_norm_eps"]
        # q_a_layernorm / kv_a_layernorm are built without an eps argument -> module default 1e-6
        # [K3ML lines 368/383: KimiRMSNorm(q_lora_rank), KimiRMSNorm(kv_lora_rank)] [KL]
        self.lora_eps = 1e-6
        # 1-indexed layer lists [K3CFG: full_attn_layers ends with 93 = num_hidden_layers]
        self.mla_layers = set(i - 1 for i in lac["full_attn_layers"])
        self.kda_layers = set(i - 1 for i in lac["kda_layers"])
        assert self.mla_layers.isdisjoint(self.kda_layers)
        assert self.mla_layers | self.kda_layers == set(range(self.n_layers))
        self.H = lac["num_heads"]
        self.K = lac["head_dim"]
        self.conv_k = lac["short_conv_kernel_size"]
        self.lower_bound = lac.get("gate_lower_bound")          # -5.0 in K3
        assert lac.get("use_full_rank_gate", False), "K3 uses the full-rank KDA output gate"
        self.Hm = c["num_attention_heads"]
        self.q_lora = c["q_lora_rank"]
        self.kv_lora = c["kv_lora_rank"]
        self.nope = c["qk_nope_head_dim"]
        self.rope = c["qk_rope_head_dim"]
        self.vdim = c["v_head_dim"]
        assert c.get("mla_use_nope", True)
        assert c.get("mla_use_output_gate", False)
        self.first_dense = c["first_k_dense_replace"]
        self.E = c["num_experts"]
        self.topk = c["num_experts_per_token"]
        self.latent = c["routed_expert_hidden_size"]
        self.latent_norm = c.get("latent_moe_use_norm", False)
        self.renorm = c.get("moe_renormalize", True)
        self.rsf = c.get("routed_scaling_factor", 1.0)
        # ablation switch only (never set for the goldens): weight the selected experts by the
        # bias-corrected scores like the original Kimi-Linear remote code did
        self.biased_weights = False
        assert c.get("moe_router_activation_func", "sigmoid") == "sigmoid"
        assert c.get("num_expert_group", 1) == 1
        assert c.get("hidden_act") == "situ"
        self.beta = c["activation_situ_beta"]
        self.linear_beta = c.get("activation_situ_linear_beta")
        self.block = c["attn_res_block_size"]
        qc = c.get("quantization_config", {})
        grp = qc.get("config_groups", {}).get("group_0", {}).get("weights", {})
        self.qgroup = grp.get("group_size", 32)

        tensors = load_safetensors(os.path.join(model_dir, "model.safetensors"))
        self.dtypes = {k: v[0] for k, v in tensors.items()}
        self.used = set()
        self._t = tensors
        P = "language_model.model."

        def W(name):
            self.used.add(name)
            return np.asarray(tensors[name][1], dtype=np.float64)

        def Q(name):   # MXFP4 packed expert weight
            self.used.add(name + ".weight_packed")
            self.used.add(name + ".weight_scale")
            return decode_mxfp4(tensors[name + ".weight_packed"][1],
                                tensors[name + ".weight_scale"][1], self.qgroup)

        self.embed = W(P + "embed_tokens.weight")
        self.final_norm = W(P + "norm.weight")
        self.lm_head = W("language_model.lm_head.weight")
        # output AttnRes pair [K3ML KimiLinearModel: output_attn_res_norm / output_attn_res_proj]
        self.out_res_norm = W(P + "output_attn_res_norm.weight")
        self.out_res_proj = W(P + "output_attn_res_proj.weight")[0]

        self.layers = []
        for i in range(self.n_layers):
            p = f"{P}layers.{i}."
            L = {"kind": "mla" if i in self.mla_layers else "kda"}
            L["in_norm"] = W(p + "input_layernorm.weight")
            L["post_norm"] = W(p + "post_attention_layernorm.weight")
            L["attn_res_norm"] = W(p + "self_attention_res_norm.weight")
            L["attn_res_proj"] = W(p + "self_attention_res_proj.weight")[0]
            L["mlp_res_norm"] = W(p + "mlp_res_norm.weight")
            L["mlp_res_proj"] = W(p + "mlp_res_proj.weight")[0]
            a = p + "self_attn."
            if L["kind"] == "kda":
                for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj",
                          "g_proj", "o_proj"):
                    L[n] = W(a + n + ".weight")
                for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                    L[n] = W(a + n + ".weight")[:, 0, :]            # [C, conv_k]
                L["dt_bias"] = W(a + "dt_bias").reshape(-1)
                # A_log may carry more entries than heads ([128] for 96 heads in K3): the kernels
                # index it by head, so only the first H are used  [K3CFG] [FLA]
                A = W(a + "A_log").reshape(-1)
                assert A.size >= self.H
                L["A_log"] = A[:self.H]
                L["o_norm"] = W(a + "o_norm.weight")
            else:
                for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj",
                          "o_proj"):
                    L[n] = W(a + n + ".weight")
                L["q_a_norm"] = W(a + "q_a_layernorm.weight")
                L["kv_a_norm"] = W(a + "kv_a_layernorm.weight")
            if i < self.first_dense:
                L["ffn"] = "dense"
                for n in ("gate_proj", "up_proj", "down_proj"):
                    L["mlp_" + n] = W(p + "mlp." + n + ".weight")
            else:
                L["ffn"] = "moe"
                m = p + "block_sparse_moe."
                L["router"] = W(m + "gate.weight")                     # read as fp32/f64 [K3ML 707-710]
                L["router_bias"] = W(m + "gate.e_score_correction_bias")
                L["lat_down"] = W(m + "routed_expert_down_proj.weight")
                L["lat_up"] = W(m + "routed_expert_up_proj.weight")
                if self.latent_norm:
                    L["lat_norm"] = W(m + "routed_expert_norm.weight")
                for n in ("gate_proj", "up_proj", "down_proj"):
                    L["sh_" + n] = W(m + "shared_experts." + n + ".weight")
                L["w1"] = [Q(f"{m}experts.{e}.w1") for e in range(self.E)]   # gate [I, L]
                L["w3"] = [Q(f"{m}experts.{e}.w3") for e in range(self.E)]   # up   [I, L]
                L["w2"] = [Q(f"{m}experts.{e}.w2") for e in range(self.E)]   # down [L, I]
            self.layers.append(L)
        self.ignored = sorted(set(tensors) - self.used)
        if verbose:
            print("ignored tensors:", self.ignored, file=sys.stderr)

    # ------------------------------------------------------------------------------------------
    def new_state(self):
        st = {"pos": 0, "layers": []}
        for L in self.layers:
            if L["kind"] == "kda":
                C = self.H * self.K
                st["layers"].append({
                    # conv history: the previous conv_k-1 PRE-conv inputs per channel  [KL]
                    "conv": {n: np.zeros((self.conv_k - 1, C)) for n in ("q", "k", "v")},
                    "S": np.zeros((self.H, self.K, self.K)),            # [head, key, value]
                })
            else:
                st["layers"].append({"k": [], "v": []})
        return st

    # ------------------------------------------------------------------------------------------
    def attn_res_mix(self, sources, proj, norm):
        """Block attention residual [K3ML _apply_attn_res, lines 1075-1088] [TPU attention_residual]:
        score_j = sum_d RMSNormNoWeight(src_j)[d] * norm.w[d] * proj.w[d] (eps = rms_norm_eps);
        output = sum_j softmax(score)_j * src_j (un-normalised sources)."""
        V = np.stack(sources)                                        # [n, D]
        kn = V / np.sqrt(np.mean(V * V, axis=1, keepdims=True) + self.eps)
        s = kn @ (norm * proj)
        s = s - s.max()
        p = np.exp(s)
        p /= p.sum()
        return self.R(p @ V), p

    # ------------------------------------------------------------------------------------------
    def kda(self, L, S, x, tr):
        """Kimi Delta Attention, one token [KL][K3ML 543-663][FLA][TPU kda_step]."""
        H, K = self.H, self.K
        out = {}
        R = self.R
        for n in ("q", "k", "v"):
            raw = R(L[n + "_proj"] @ x)                               # [H*K]
            hist = S["conv"][n]                                       # [conv_k-1, C]
            w = L[n + "_conv1d"]                                      # [C, conv_k]; tap conv_k-1 = now
            y = (w[:, :-1] * hist.T).sum(axis=1) + w[:, -1] * raw     # causal depthwise conv, no bias
            S["conv"][n] = np.vstack([hist[1:], raw[None, :]])
            out[n] = R(silu(R(y))).reshape(H, K)                      # ShortConvolution(activation=silu)
        q, k, v = out["q"], out["k"], out["v"]
        # L2 norm with eps 1e-6 inside the sqrt, q scaled by K^-0.5  [FLA use_qk_l2norm_in_kernel]
        q = q / np.sqrt((q * q).sum(axis=1, keepdims=True) + 1e-6) * K ** -0.5
        k = k / np.sqrt((k * k).sum(axis=1, keepdims=True) + 1e-6)
        # decay gate per channel  [FLA safe gate][K3ML lower_bound=self.gate_lower_bound][TPU]
        f = (R(L["f_b_proj"] @ R(L["f_a_proj"] @ x)) + L["dt_bias"]).reshape(H, K)
        A = np.exp(L["A_log"])[:, None]
        if self.lower_bound is not None:
            g = self.lower_bound * sigmoid(A * f)                    # in (lower_bound, 0)
        else:                                                          # Kimi-Linear form
            g = -A * np.where(f > 20.0, f, np.log1p(np.exp(np.minimum(f, 20.0))))
        beta = sigmoid(R(L["b_proj"] @ x))                            # [H]  use_beta_sigmoid_in_kernel
        o = np.empty((H, K))
        for h in range(H):
            Sh = S["S"][h] * np.exp(g[h])[:, None]                    # decay scales the KEY index
            u = beta[h] * (v[h] - Sh.T @ k[h])                        # delta rule
            Sh = Sh + np.outer(k[h], u)
            S["S"][h] = Sh
            o[h] = Sh.T @ q[h]
        tr["decay"].append(np.exp(g).ravel())
        tr["kda_o_rms"].append(float(np.sqrt(np.mean(o * o))))
        tr["kda_qk_cos"].append(float(np.mean(np.abs((q * k).sum(axis=1)) / np.maximum(
            np.sqrt((q * q).sum(axis=1) * (k * k).sum(axis=1)), 1e-30))))
        o = R(o)
        # output: per-head RMSNorm(o) * o_norm.w * sigmoid(g_proj(x))  [K3ML 651-659 FusedRMSNormGated,
        # eps = rms_norm_eps; full-rank gate g_proj since use_full_rank_gate]
        gate = R(L["g_proj"] @ x).reshape(H, K)
        o = R(np.stack([rmsnorm(o[h], L["o_norm"], self.eps) for h in range(H)]) * sigmoid(gate))
        return R(L["o_proj"] @ o.reshape(-1))

    # ------------------------------------------------------------------------------------------
    def mla(self, L, S, x, phase):
        """Gated NoPE MLA with q LoRA, one token, full (un-absorbed) keys/values
        [K3ML 405-474][KL]. `phase` matters only for the bf16 emulation: the engine's prefill
        rounds k_nope / v, the scores and the probabilities; its absorbed decode does not."""
        Hm, nope, rope, vd, r = self.Hm, self.nope, self.rope, self.vdim, self.kv_lora
        qk = nope + rope
        R = self.R
        Rp = R if phase == "prefill" else _identity
        # q = q_b(RMSNorm(q_a(x), q_a_layernorm, 1e-6))  [K3ML 419]
        q = R(L["q_b_proj"] @ self.norm(R(L["q_a_proj"] @ x), L["q_a_norm"], self.lora_eps))
        q = q.reshape(Hm, qk)                                         # per head: nope | rope
        a = R(L["kv_a_proj_with_mqa"] @ x)                            # [kv_lora + rope]
        c = self.norm(a[:r], L["kv_a_norm"], self.lora_eps)
        k_pe = a[r:]                                                  # shared by heads, NOT rotated
        kv = (L["kv_b_proj"] @ c).reshape(Hm, nope + vd)              # per head: nope rows | v rows
        key = np.concatenate([kv[:, :nope], np.broadcast_to(k_pe, (Hm, rope))], axis=1)
        S["k"].append(key)
        S["v"].append(kv[:, nope:])
        Kc = np.stack(S["k"], axis=1)                                 # [Hm, T, qk]
        Vc = np.stack(S["v"], axis=1)                                 # [Hm, T, vd]
        if phase == "prefill" and self.bf16:                         # k_pe is bf16 already
            Kc, Vc = R(Kc), R(Vc)
        s = Rp(Rp(np.einsum("hd,htd->ht", q, Kc)) * qk ** -0.5)      # scaling = (nope+rope)^-0.5
        s = s - s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p = Rp(p / p.sum(axis=1, keepdims=True))
        o = R(np.einsum("ht,htd->hd", p, Vc).reshape(-1))             # [Hm*vd]
        o = R(o * R(sigmoid(R(L["g_proj"] @ x))))                    # output gate [K3ML 470-472]
        return R(L["o_proj"] @ o)

    # ------------------------------------------------------------------------------------------
    def norm(self, x, w, eps):
        # RMSNorm; the bf16 engine rounds the normalised value, then the product with the weight
        if not self.bf16:
            return rmsnorm(x, w, eps)
        r = 1.0 / np.sqrt(np.mean(x * x) + eps)
        return self.R(w * self.R(x * r))

    def glu_mlp(self, gate_w, up_w, down_w, h):
        R = self.R
        return R(down_w @ R(situ_glu(R(gate_w @ h), R(up_w @ h), self.beta, self.linear_beta)))

    def dense_mlp(self, L, h):
        # KimiMLP with SiTU-GLU [K3ML KimiMLP + SituAndMul]
        return self.glu_mlp(L["mlp_gate_proj"], L["mlp_up_proj"], L["mlp_down_proj"], h)

    def moe(self, L, h, tr, layer):
        """Latent MoE [K3ML KimiSparseMoeBlock 815-838, KimiMoEGate 703-759]."""
        logits = L["router"] @ h                                      # fp32 in the official code
        scores = sigmoid(logits)
        choice = scores + L["router_bias"]                            # bias only selects
        order = sorted(range(self.E), key=lambda e: (-choice[e], e))  # ties: lowest id
        ids = order[:self.topk]
        wts = (choice if self.biased_weights else scores)[ids]        # unbiased scores weight
        if self.topk > 1 and self.renorm:
            wts = wts / (wts.sum() + 1e-20)
        wts = wts * self.rsf
        gap = choice[order[self.topk - 1]] - choice[order[self.topk]] if self.topk < self.E else 1.0
        R = self.R
        z = R(L["lat_down"] @ h)                                      # routed experts live in the latent
        y = np.zeros(self.latent)
        for e, w in zip(ids, wts):
            y += w * self.glu_mlp(L["w1"][e], L["w3"][e], L["w2"][e], z)
        y = R(y)
        if self.latent_norm:
            y = self.norm(y, L["lat_norm"], self.eps)                 # after the sum, before up-proj
        y = R(L["lat_up"] @ y)
        sh = self.glu_mlp(L["sh_gate_proj"], L["sh_up_proj"], L["sh_down_proj"], h)  # shared MLP on h
        tr["routes"].append({"layer": layer, "ids": [int(i) for i in ids],
                             "weights": [float(w) for w in wts], "gap": float(gap),
                             "scores": [float(s) for s in scores],
                             "biased": [float(s) for s in choice]})
        return R(y + sh)

    # ------------------------------------------------------------------------------------------
    def step(self, st, token, phase="decode"):
        """Process one token; returns (logits float64 [V], trace). `phase` ("prefill" or
        "decode") selects the engine's MLA rounding points in the bf16 emulation only."""
        R = self.R
        tr = {"routes": [], "decay": [], "res_probs": [], "kda_o_rms": [], "kda_qk_cos": [],
              "sublayer_in": [], "sublayer_out": []}
        x = self.embed[token].copy()
        blocks = []                                                   # completed block summaries
        # [K3ML KimiDecoderLayer._forward_attn_residual 984-1046, KimiLinearModel.forward 1188-1219]
        for i, L in enumerate(self.layers):
            prefix = x
            if blocks:
                h, pr = self.attn_res_mix(blocks + [prefix], L["attn_res_proj"], L["attn_res_norm"])
                tr["res_probs"].append(pr)
            else:
                h = prefix                                            # layer 0: the raw embedding
            if i % self.block == 0:                                   # block boundary counts layers
                blocks.append(prefix)
                prefix = None
            hn = self.norm(h, L["in_norm"], self.eps)
            tr["sublayer_in"].append(hn)
            S = st["layers"][i]
            a = self.kda(L, S, hn, tr) if L["kind"] == "kda" else self.mla(L, S, hn, phase)
            tr["sublayer_out"].append(a)
            prefix = a if prefix is None else R(prefix + a)
            h, pr = self.attn_res_mix(blocks + [prefix], L["mlp_res_proj"], L["mlp_res_norm"])
            tr["res_probs"].append(pr)
            hn = self.norm(h, L["post_norm"], self.eps)
            tr["sublayer_in"].append(hn)
            f = self.dense_mlp(L, hn) if L["ffn"] == "dense" else self.moe(L, hn, tr, i)
            tr["sublayer_out"].append(f)
            prefix = R(prefix + f)
            x = prefix
        h, pr = self.attn_res_mix(blocks + [x], self.out_res_proj, self.out_res_norm)
        tr["res_probs"].append(pr)
        tr["n_sources_final"] = len(blocks) + 1
        hn = self.norm(h, self.final_norm, self.eps)
        tr["final_hidden"] = hn
        st["pos"] += 1
        return R(self.lm_head @ hn), tr


def run_sequence(model, ids, prefill=0):
    """Teacher-forced run; the first `prefill` ids use the engine's prefill rounding points in
    the bf16 emulation (no effect in float64)."""
    st = model.new_state()
    rows, traces = [], []
    for i, t in enumerate(ids):
        lg, tr = model.step(st, t, "prefill" if i < prefill else "decode")
        rows.append(lg)
        traces.append(tr)
    return np.stack(rows), traces


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="run the K3 numpy reference on a model dir")
    ap.add_argument("model_dir")
    ap.add_argument("ids", nargs="+", type=int)
    args = ap.parse_args()
    m = K3Reference(args.model_dir, verbose=True)
    lg, _ = run_sequence(m, args.ids)
    for i, row in enumerate(lg):
        top = np.argsort(-row)[:5]
        print(i, args.ids[i], "top5", top.tolist(), np.round(row[top], 4).tolist())
