#!/usr/bin/env python3
"""Projects a `megadecode bench --model <k3-slice>` run to the full 93-layer Kimi K3.

This is a PROJECTION, not a measurement. Inputs: the bench JSON of the k3-slice checkpoint (full K3
widths, a few layers, 64 experts per layer) and its config.json. Outputs, per batch size:

1. The bytes a decode step of the full K3 moves on one device (all 93 layers, 896 experts), from
   the released geometry (MODELS.md "Kimi K3"), and the same formula applied to the slice, checked
   against the bytes the bench counted.
2. "This machine, whole model": the slice's measured ms/step scaled by bytes(full) / bytes(slice),
   i.e. assuming the full model streams at the fraction of read bandwidth the slice achieved (the
   step is bandwidth-bound; the dense layer 0 and lm_head weigh the same in both).
3. The seed's 16-way deployment (BENCHMARKS.md "The seed's K3 deployment"): per device the bytes of
   2 of the 32 cores' shards (heads split 32 ways, routed experts 8 ways by expert x 4 ways inside
   each expert, shared expert and dense layer 32 ways, embedding and lm_head by vocabulary; router
   and the small low-rank/gate vectors replicated), streamed at `--device-bw` times the fraction of
   bandwidth the megakernel achieved here, plus the seed's collectives (an all-reduce after each
   attention output projection and after each expert combine, one latent all-gather per MoE layer)
   at the time NCCL's own cost model gives for each message (`nccl_time_us`: the latency and
   bandwidth constants of NVIDIA/nccl src/graph/tuning.cc, commit b6475625, for 16 GPUs either in
   one NVLink domain (`--topology nvl16`, e.g. GB200 NVL72 or MNNVL, which NCCL treats as one node)
   or two 8-GPU HGX nodes over the network (`--topology 2x8`)), or at `--allreduce-us` if given.
   No GPU was measured: every figure of this part is a projection.

Usage: python3 bench/project_k3.py bench/k3-slice.json models/k3-slice/config.json
"""
import argparse
import json
import math

MXFP4_BYTES = 4.25 / 8  # e2m1 codes + one E8M0 scale per 32


def k3_geometry(cfg):
    t = cfg.get("text_config", cfg)
    lin = t.get("linear_attn_config", {})
    mla_layers = {i - 1 for i in lin.get("full_attn_layers", [])}
    L = t["num_hidden_layers"]
    g = dict(
        D=t["hidden_size"], L=L, V=t["vocab_size"],
        H=lin.get("num_heads", 96), K=lin.get("head_dim", 128),
        Hm=t["num_attention_heads"], qlora=t.get("q_lora_rank") or 0,
        kv=t["kv_lora_rank"], nope=t["qk_nope_head_dim"], rope=t["qk_rope_head_dim"],
        v=t["v_head_dim"], E=t["num_experts"], k=t["num_experts_per_token"],
        I=t["moe_intermediate_size"], S=t.get("num_shared_experts", 0),
        latent=t.get("routed_expert_hidden_size") or t["hidden_size"],
        dense_I=t["intermediate_size"], dense=t.get("first_k_dense_replace", 1),
    )
    g["mla"] = [i in mla_layers for i in range(L)]
    return g


# NCCL's cost model (src/graph/tuning.cc at NVIDIA/nccl b6475625): latencies in us, per algorithm
# and protocol; the ring / tree latency formulas of ncclTopoTuneModel; LL's bus bandwidth capped at
# llMaxBw (87.7 GB/s on Hopper, one node; 22.5 multi-node). NCCL picks the fastest candidate.
NCCL_BASE = {("ring", "LL"): 6.6, ("ring", "LL128"): 14.0, ("ring", "Simple"): 8.4,
             ("tree", "LL"): 6.8, ("tree", "LL128"): 14.0}
NCCL_HW = {"nvlink": {("ring", "LL"): 0.6, ("ring", "LL128"): 1.9, ("ring", "Simple"): 3.4,
                      ("tree", "LL"): 0.6, ("tree", "LL128"): 1.25},
           "net": {("ring", "LL"): 2.7, ("ring", "LL128"): 4.0, ("ring", "Simple"): 14.0,
                   ("tree", "LL"): 5.0, ("tree", "LL128"): 8.5}}


def nccl_time_us(coll, nbytes, ranks=16, nodes=1):
    """NCCL's modelled time of one collective of nbytes (all-reduce: the buffer; all-gather: the
    gathered total) over `ranks` GPUs on `nodes` nodes: min over the LL/LL128/Simple ring and
    LL/LL128 tree candidates of latency + bytes / algorithm bandwidth."""
    best = None
    ll_bw = 87.7 if nodes == 1 else 22.5
    for (algo, proto), base in NCCL_BASE.items():
        if coll == "allgather" and algo == "tree":
            continue
        steps = 2 * (ranks - 1) if coll == "allreduce" else ranks - 1
        inter = (2 * nodes if nodes > 1 else 0) if coll == "allreduce" else nodes - 1
        intra_lat = NCCL_HW["nvlink"][(algo, proto)] * (1.8 if nodes > 1 and proto == "LL" else 1.0)
        net_lat = NCCL_HW["net"][(algo, proto)]
        if algo == "ring":
            lat = base + (steps - inter) * max(intra_lat, 1.0 if nodes > 1 else 0.0) + inter * net_lat
            ratio = ranks / steps
        else:
            lat = base + 2 * ((ranks // nodes - 1) * intra_lat + math.log2(nodes) * net_lat)
            ratio = 0.5
        # Bus bandwidth: LL at its cap; LL128 ~0.92 x and Simple ~ the link (~370 GB/s of an H200's
        # NVLink per direction in one node, ~50 GB/s of a 400 Gb/s NIC across nodes).
        link = 370.0 if nodes == 1 else 50.0
        bus = {"LL": ll_bw, "LL128": 0.92 * link, "Simple": link}[proto]
        t = lat + nbytes / (1000.0 * bus * ratio)
        best = t if best is None else min(best, t)
    return best


def expected_distinct(E, k, B):
    """Expected distinct experts when B tokens each pick k of E uniformly (no replacement)."""
    return E * (1.0 - (1.0 - k / E) ** B)


def layer_bytes(g, i, B, context, shard=None):
    """Bytes one layer moves in a decode step. shard=None: one device holds everything; otherwise
    a dict with the fraction of each part a device holds and its expected local expert routes."""
    D, K, H = g["D"], g["K"], g["H"]
    f = shard or {}
    heads = f.get("heads", 1.0)       # fraction of attention heads
    ffn = f.get("ffn", 1.0)           # fraction of shared/dense channels
    b = 0.0
    if g["mla"][i]:
        Hm, R, P, N, Vd = g["Hm"], g["kv"], g["rope"], g["nope"], g["v"]
        q = (g["qlora"] * D + Hm * (N + P) * g["qlora"] * heads) if g["qlora"] else Hm * (N + P) * D * heads
        b += 2 * (q + (R + P) * D + Hm * (N + Vd) * R * heads + 2 * Hm * Vd * D * heads)  # q, kv_a, kv_b, g, o
        b += B * context * (R + P) * 2 * (1.0 if shard is None else 1.0)  # latent cache (bf16), replicated
    else:
        b += 2 * (4 * H * K * D * heads + H * K * D * heads)   # q, k, v, g (full rank), o
        b += 2 * (K * D + H * K * K * heads + H * D)           # f_a, f_b, b_proj
        b += 2 * B * H * heads * K * K * 4                     # KDA state read + write (fp32)
    if i < g["dense"]:
        b += 2 * 3 * g["dense_I"] * D * ffn
    else:
        E, k, I, lat = g["E"], g["k"], g["I"], g["latent"]
        b += 2 * E * D                                          # router (bf16), replicated
        b += 2 * 2 * lat * D * ffn                              # latent down/up projections
        b += 2 * 3 * g["S"] * I * D * ffn                       # shared experts
        if shard is None:
            distinct = expected_distinct(E, k, B)
            b += distinct * 3 * I * lat * MXFP4_BYTES
        else:
            # Experts split `groups` ways by expert: a device's group holds E/groups experts; each
            # device holds `intra` of each expert's channels.
            groups, intra = shard["expert_groups"], shard["intra"]
            local = expected_distinct(E / groups, k / groups, B)
            b += local * 3 * I * lat * MXFP4_BYTES * intra
    return b


def step_bytes(g, B, context, shard=None):
    D, V = g["D"], g["V"]
    vocab = shard.get("vocab", 1.0) if shard else 1.0
    total = 2 * V * D * vocab + B * 2 * D  # lm_head + embedding rows
    return total + sum(layer_bytes(g, i, B, context, shard) for i in range(g["L"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json")
    ap.add_argument("slice_config")
    ap.add_argument("--device-bw", type=float, default=4.3e12, help="device read bandwidth, B/s (H200 measured ~4.3 TB/s)")
    ap.add_argument("--allreduce-us", type=float, default=None,
                    help="instead of NCCL's model: an assumed time per collective, us")
    ap.add_argument("--topology", choices=["nvl16", "2x8"], default="nvl16",
                    help="16 GPUs in one NVLink domain, or two 8-GPU nodes over the network")
    ap.add_argument("--context", type=int, default=None, help="context for the full-model projection (default: the bench's)")
    a = ap.parse_args()
    bench = json.load(open(a.bench_json))
    sl = k3_geometry(json.load(open(a.slice_config)))
    full = dict(sl)
    full.update(L=93, E=896, mla=[(i % 4 == 3) or i == 92 for i in range(93)])
    ctx = a.context or bench.get("context", 16)
    # Per device: 2 of the seed's 32 cores (BENCHMARKS.md): heads / 16, experts 8 groups x 2 of 4
    # channel quarters, shared/dense / 16, vocabulary / 16.
    shard = dict(heads=2 / 32, ffn=2 / 32, vocab=1 / 16, expert_groups=8, intra=2 / 4)
    core = dict(heads=1 / 32, ffn=1 / 32, vocab=1 / 32, expert_groups=8, intra=1 / 4)
    kda1 = layer_bytes(full, 1, 1, ctx, core)
    mla1 = layer_bytes(full, 3, 1, ctx, core)
    print(f"check vs BENCHMARKS.md (per core, batch 1): KDA MoE layer {kda1/1e6:.1f} MB (~70), "
          f"MLA MoE layer {mla1/1e6:.1f} MB (~84), step {step_bytes(full, 1, ctx, core)/1e9:.2f} GB (~6.9)")
    print("PROJECTION (not a measurement): full Kimi K3 (93 layers, 896 experts)")
    print(f"{'batch':>5} {'executor':>10} {'slice ms':>9} {'slice GB':>9} {'model GB':>9} "
          f"{'%bw':>6} {'full GB':>8} {'this CPU ms':>11} {'16-way GB/dev':>13} {'16-way ms/dev':>13}")
    for r in bench["results"]:
        B = r["batch"]
        model_slice = step_bytes(sl, B, ctx)
        fb = step_bytes(full, B, ctx)
        frac = r["pct_of_bandwidth"] / 100.0
        cpu_ms = r["ms_per_step"] * fb / r["bytes_per_step"]
        dev = step_bytes(full, B, ctx, shard)
        moe_layers = full["L"] - full["dense"]
        coll_ms, _ = collectives_ms(full, B, a)
        dev_ms = dev / (a.device_bw * frac) * 1e3 + coll_ms
        print(f"{B:>5} {r['executor']:>10} {r['ms_per_step']:>9.1f} {r['bytes_per_step']/1e9:>9.2f} "
              f"{model_slice/1e9:>9.2f} {100*frac:>5.1f}% {fb/1e9:>8.1f} {cpu_ms:>11.0f} "
              f"{dev/1e9:>13.2f} {dev_ms:>13.2f}")
    ms1, parts = collectives_ms(full, 1, a)
    print(f"16-way: streaming at (device bw {a.device_bw/1e12:.1f} TB/s x the %bw achieved here) + "
          f"{2*full['L'] + full['L'] - full['dense']} collectives per step; at batch 1 "
          f"({'assumed' if a.allreduce_us else 'NCCL cost model, ' + a.topology}):")
    for what, n, nbytes, us in parts:
        print(f"  {n:>3} x {what:<30} {nbytes/1e3:>8.1f} KB  {us:6.1f} us each  {n*us/1e3:6.2f} ms")
    print(f"  total {ms1:.2f} ms; seed: TPU v7 megakernel 4.02 ms/step, GB200 vLLM 7.87 ms/step "
          "at batch 1; 300 tokens/s needs 3.33 ms a step")
    md1, mparts = collectives_ms(full, 1, a, "megadecode")
    print(f"megadecode's plan instead ({sum(n for _, n, _, _ in mparts)} collectives, fp32, exact "
          "expert slots, two latent gathers), at batch 1:")
    for what, n, nbytes, us in mparts:
        print(f"  {n:>3} x {what:<30} {nbytes/1e3:>8.1f} KB  {us:6.1f} us each  {n*us/1e3:6.2f} ms")
    print(f"  total {md1:.2f} ms, against the seed's {ms1:.2f} ms")


def collectives_ms(g, B, a, plan="seed"):
    """The collectives of one decode step (per batch B). plan="seed": the seed's, per layer an
    all-reduce of the attention output [B, D] and of the expert combine [B, D], and per MoE layer
    a latent all-gather of [B, latent] (each GPU's 1/16), in bf16. plan="megadecode": what
    megadecode's distributed plan sends (docs/distributed.md "Collectives in the plan"), fp32:
    the attention all-reduce [B, D]; the FFN all-reduce, which for a MoE layer carries the
    expert slots and the shared expert [B, k * latent + D] (exact per-slot outputs); the
    all-gathers of the latent projections' row blocks, z [B, latent] and the up-projection
    [B, D]. Returns (ms, [(what, count, bytes, us each)])."""
    D, lat, L, k = g["D"], g["latent"], g["L"], g["k"]
    moe = L - g["dense"]
    nodes = 1 if a.topology == "nvl16" else 2
    if plan == "seed":
        msgs = [("all-reduce attention out", L, "allreduce", B * D * 2),
                ("all-reduce FFN / combine", L, "allreduce", B * D * 2),
                ("all-gather latent (MoE)", moe, "allgather", B * lat * 2)]
    else:
        msgs = [("all-reduce attention out", L, "allreduce", B * D * 4),
                ("all-reduce dense FFN", g["dense"], "allreduce", B * D * 4),
                ("all-reduce expert slots+shared", moe, "allreduce", B * (k * lat + D) * 4),
                ("all-gather latent z", moe, "allgather", B * lat * 4),
                ("all-gather latent up", moe, "allgather", B * D * 4)]
    parts = []
    for what, n, coll, nbytes in msgs:
        us = a.allreduce_us if a.allreduce_us else nccl_time_us(coll, nbytes, 16, nodes)
        parts.append((what, n, nbytes, us))
    return sum(n * us for _, n, _, us in parts) / 1e3, parts


if __name__ == "__main__":
    main()
