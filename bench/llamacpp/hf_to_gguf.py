#!/usr/bin/env python3
"""Convert a megadecode-made (or any tiktoken-vocab) Kimi Linear checkpoint to GGUF with
llama.cpp's own converter, for the llama.cpp comparison in bench/RESULTS.md.

llama.cpp's converter reads the Kimi vocabulary through the Hugging Face repo's remote tokenizer
code (tokenization_kimi.py), which megadecode's synthetic checkpoints do not carry. This wrapper
replaces only that step: it builds the same GPT-2-style token list and merge list from the
checkpoint's tiktoken.model and tokenizer_config.json, and lets the converter do everything else
(tensor names, layouts, metadata), so the GGUF is what llama.cpp itself would write.

Nothing of llama.cpp is part of megadecode: the converter is imported from a llama.cpp source tree
given on the command line (bench/llamacpp/compare.sh unpacks one from PyPI's llama-cpp-python
sdist).

usage: hf_to_gguf.py --llama-dir DIR --model MODEL_DIR --out FILE.gguf [--outtype bf16]
"""
import argparse
import base64
import json
import sys
from pathlib import Path


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        token_b64, rank = line.split()
        ranks[base64.b64decode(token_b64)] = int(rank)
    if not ranks:
        raise SystemExit(f"{path}: no tokens")
    return ranks


def read_special_tokens(model_dir: Path) -> dict[str, int]:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    decoder = config.get("added_tokens_decoder", {})
    return {entry["content"]: int(token_id) for token_id, entry in decoder.items()}


def make_set_vocab(gguf, qwen_model):
    """Returns a set_vocab for KimiLinearModel that needs no remote tokenizer code."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_encoder = bytes_to_unicode()  # GPT-2's byte -> printable character map, built once

    def as_text(token: bytes) -> str:
        return "".join(byte_encoder[b] for b in token)

    def set_vocab(self):
        model_dir = Path(self.dir_model)
        ranks = read_tiktoken_ranks(model_dir / "tiktoken.model")
        special = read_special_tokens(model_dir)
        # The merge list is what a byte-level BPE needs to reproduce tiktoken's ranks: for each
        # multi-byte token, the pair that the lower-ranked merges leave when they stop below it.
        by_id: dict[int, str] = {}
        merges: list[str] = []
        for token, rank in ranks.items():
            by_id[rank] = as_text(token)
            if len(token) == 1:
                continue
            pair = qwen_model.bpe(ranks, token, max_rank=rank)
            if len(pair) == 2:
                merges.append(" ".join(map(as_text, pair)))
        for content, token_id in special.items():
            by_id[token_id] = content
        tokens, types = [], []
        for token_id in range(self.hparams["vocab_size"]):
            if token_id not in by_id:
                tokens.append(f"[PAD{token_id}]")
                types.append(gguf.TokenType.UNUSED)
            else:
                tokens.append(by_id[token_id])
                types.append(gguf.TokenType.CONTROL if token_id in special.values()
                             else gguf.TokenType.NORMAL)
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("kimi-k2")  # llama.cpp's name for Kimi's pre-split
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_types(types)
        self.gguf_writer.add_token_merges(merges)
        gguf.SpecialVocab(model_dir, load_merges=False).add_to_gguf(self.gguf_writer)
        self.gguf_writer.add_eos_token_id(self.hparams["eos_token_id"])

    return set_vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-dir", required=True, type=Path)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--outtype", default="bf16", choices=["bf16", "f32", "f16", "q8_0"])
    args = parser.parse_args()

    sys.path.insert(0, str(args.llama_dir))
    sys.path.insert(1, str(args.llama_dir / "gguf-py"))
    import gguf  # noqa: E402  (from the llama.cpp tree)
    import convert_hf_to_gguf  # noqa: E402
    from conversion.kimi_linear import KimiLinearModel  # noqa: E402
    from conversion.qwen import QwenModel  # noqa: E402

    KimiLinearModel.set_vocab = make_set_vocab(gguf, QwenModel)
    sys.argv = ["convert_hf_to_gguf.py", str(args.model), "--outfile", str(args.out),
                "--outtype", args.outtype]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
