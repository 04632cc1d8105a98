#!/usr/bin/env python3
"""Encode throughput, one core: megadecode's tokenizer vs the tiktoken package, same text, same run.

    pip install tiktoken
    python3 bench/bench_tokenizer.py --bench build/bench/megadecode_bench_tokenizer \
        [--model tests/data/tokenizer] [--mb 4] [--reps 5]

Builds a mixed corpus (English-like prose, code, numbers, Chinese, Japanese, Korean, emoji,
whitespace), encodes it with tiktoken (Kimi's original pattern, the model's ranks and specials,
as tokenization_kimi.py does) and with the C++ bench on the same file, checks the ids are equal,
and prints both figures. tiktoken's encode runs on the calling thread (one core); the C++ bench is
single-threaded.
"""
import argparse
import base64
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

import tiktoken

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "tokenizer"))
from make_tiktoken_golden import KIMI_PATTERN, NUM_SPECIAL  # noqa: E402


def load_encoding(model_dir):
    ranks = {}
    for line in (model_dir / "tiktoken.model").read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    named = {int(k): v["content"] for k, v in cfg.get("added_tokens_decoder", {}).items()}
    base = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_SPECIAL)}
    return tiktoken.Encoding("bench", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)


def make_corpus(target_bytes, seed=7):
    rng = random.Random(seed)
    syllables = ["th", "e", "an", "re", "on", "in", "er", "st", "ing", "ou", "al", "ed", "to",
                 "ke", "ma", "ri", "lo", "ne", "pro", "com", "ex", "ly", "tion", "ver", "a", "i"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    han = [chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(3000)]
    kana = [chr(c) for c in range(0x3041, 0x3097)] + [chr(c) for c in range(0x30A1, 0x30FB)]
    hangul = [chr(rng.randint(0xAC00, 0xD7A3)) for _ in range(1500)]
    emoji = ["😀", "👍", "🚀", "❤️", "👨‍👩‍👧", "🇯🇵", "✅", "🔥"]
    code = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { s += a[i]; }\n",
            '{"key": [1, 2, 3], "ok": true}\n', "if (err != nil) {\n\treturn err\n}\n"]
    parts, size = [], 0
    while size < target_bytes:
        kind = rng.random()
        if kind < 0.55:
            s = " ".join(rng.choice(words) for _ in range(rng.randint(5, 30)))
            s = s.capitalize() + rng.choice([". ", "! ", "? ", ", it's done. ", "\n", "\n\n"])
        elif kind < 0.65:
            s = rng.choice(code)
        elif kind < 0.72:
            s = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 9))) for _ in range(8)) + "\n"
        elif kind < 0.84:
            s = "".join(rng.choice(han) for _ in range(rng.randint(5, 40))) + "。"
        elif kind < 0.90:
            s = "".join(rng.choice(kana) for _ in range(rng.randint(5, 30))) + "、"
        elif kind < 0.96:
            s = " ".join("".join(rng.choice(hangul) for _ in range(rng.randint(1, 4)))
                         for _ in range(rng.randint(3, 12))) + ". "
        else:
            s = " ".join(rng.choice(emoji) for _ in range(rng.randint(1, 6))) + " "
        parts.append(s)
        size += len(s.encode())
    return "".join(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="path of megadecode_bench_tokenizer")
    ap.add_argument("--model", default=str(ROOT / "tests" / "data" / "tokenizer"))
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    model = pathlib.Path(args.model)
    enc = load_encoding(model)
    text = make_corpus(int(args.mb * 1e6))
    data = text.encode()
    with tempfile.TemporaryDirectory() as tmp:
        text_path = os.path.join(tmp, "corpus.txt")
        ids_path = os.path.join(tmp, "ids.txt")
        with open(text_path, "wb") as f:
            f.write(data)

        ref = enc.encode(text, allowed_special="all")  # warm-up (and the reference ids)
        best = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            enc.encode(text, allowed_special="all")
            best = min(best, time.perf_counter() - t0)

        out = subprocess.run([args.bench, "--model", str(model), "--text", text_path,
                              "--reps", str(args.reps), "--ids-out", ids_path],
                             check=True, capture_output=True, text=True).stdout
        ours = json.loads(out)
        with open(ids_path) as f:
            our_ids = [int(x) for x in f]

    mb = len(data) / 1e6
    print(f"corpus: {mb:.2f} MB, {len(ref)} tokens, vocabulary {model} ({enc.n_vocab} ids)")
    print(f"tiktoken {tiktoken.__version__}: best of {args.reps}: {mb / best:8.2f} MB/s")
    print(f"megadecode: best of {args.reps}: {ours['best_mb_per_s']:8.2f} MB/s "
          f"(first, cold piece cache: {ours['cold_mb_per_s']:.2f} MB/s)")
    print(f"ids identical: {our_ids == ref}")
    return 0 if our_ids == ref else 1


if __name__ == "__main__":
    sys.exit(main())
