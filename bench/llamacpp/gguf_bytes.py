#!/usr/bin/env python3
"""Bytes a GGUF model reads per decoded token at batch 1, counted as megadecode counts its own
(decode_step_bytes): every tensor, except one row of the token embedding and, of each merged
expert tensor (*_exps), only the experts a token uses (expert_used_count of expert_count).

usage: gguf_bytes.py --llama-dir DIR FILE.gguf...   (prints: file, total GB, per-token GB)
"""
import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-dir", required=True, type=Path)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(args.llama_dir / "gguf-py"))
    import gguf  # noqa: E402  (from the llama.cpp tree)

    for path in args.files:
        reader = gguf.GGUFReader(path)
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

        def meta(key: str) -> int:
            field = reader.fields[f"{arch}.{key}"]
            return int(field.parts[field.data[0]][0])

        used, experts = meta("expert_used_count"), meta("expert_count")
        total = per_token = 0.0
        for t in reader.tensors:
            total += t.n_bytes
            if t.name == "token_embd.weight":
                per_token += t.n_bytes / t.shape[-1]  # ggml's shape is [n_embd, n_vocab]
            elif "_exps." in t.name:
                per_token += t.n_bytes * used / experts
            else:
                per_token += t.n_bytes
        print(f"{path.name}: {total / 1e9:.3f} GB, {per_token / 1e9:.3f} GB per token "
              f"({used} of {experts} experts)")


if __name__ == "__main__":
    main()
