#!/usr/bin/env python3
"""Records the reference tokenizer's ids for the differential tests (run by hand, output committed).

The reference is the tiktoken package driven the way Kimi's tokenization_kimi.py drives it: the
ORIGINAL Kimi pattern (Rust fancy-regex syntax, compiled by tiktoken), the ranks of
tests/data/tokenizer/tiktoken.model, and 256 special ids after the ranks named from
tokenizer_config.json (unnamed ones are <|reserved_token_{id}|>).

    pip install tiktoken
    python3 tests/tokenizer/make_tiktoken_golden.py   # writes tests/data/tokenizer/tiktoken_golden.json
"""
import base64
import json
import pathlib
import random
import unicodedata

import tiktoken

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "tokenizer"

# Kimi's pre-tokenisation pattern exactly as published (tokenization_kimi.py pat_str).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_SPECIAL = 256


def load_encoding():
    ranks = {}
    for line in (DATA / "tiktoken.model").read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    cfg = json.loads((DATA / "tokenizer_config.json").read_text())
    named = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
    base = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_SPECIAL)}
    return tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials), specials


def fixed_cases(specials):
    c = {}
    c["empty"] = ""
    c["english"] = ("The quick brown fox jumps over the lazy dog. Tokenizers split text into "
                    "pieces, then merge bytes by rank until no pair can be merged.")
    c["contractions_lower"] = "it's don't we're they've I'm you'll he'd she's can't won't"
    c["contractions_upper"] = "IT'S DON'T WE'RE THEY'VE I'M YOU'LL HE'D SHE'S CAN'T WON'T"
    c["contractions_mixed"] = "It'S dOn'T We'Re THEY'Ve i'M You'LL hE'd 'S 'sx ''s x's's"
    c["contraction_long_s"] = "it'\u017f IT'\u017f lets'\u017f \u017ftop"
    c["code_python"] = ("def f(x, y=2):\n    return {'a': x ** y, \"b\": [1, 2, 3]}\n\n"
                        "if __name__ == '__main__':\n\tprint(f(3))\n")
    c["code_cpp"] = ("template <typename T>\nT add(T a, T b) { return a + b; }  // sum\n"
                     "int main() { std::vector<int> v{1,2,3}; return v.size() > 2 ? 0 : 1; }\n")
    c["json_html"] = '{"k": [1, 2.5, -3e10], "s": "x\\ny"} <a href="https://x.org/?a=1&b=2">t</a>'
    c["numbers"] = "0 7 42 123 1234 12345 1234567 3.14159 1,000,000 -12.5e-3 0x1F 2025-10-30 12:00"
    c["numbers_other_scripts"] = "\u0661\u0662\u0663\u0664 \u0967\u0968\u0969\u096a\u096b \u2460\u2461 \u00bd \u2167 \uff11\uff12\uff13\uff14"
    c["cjk_han"] = "人工智能正在改变世界。我们今天学习了很多新的知识，明天继续努力！"
    c["cjk_punct_after_han"] = "中、文。「引用」（括号）中々〇〆 三〇〇 北京、上海"
    c["cjk_no_han"] = "「、。」〜・ー（）【】『』〒〓"
    c["japanese_kana"] = "ひらがなとカタカナ。コンピューターのプログラムをかきます。ｶﾀｶﾅ ﾊﾝｶｸ"
    c["japanese_mixed"] = "東京は日本の首都です。今日はとても良い天気ですね。私はコーヒーを飲みます。"
    c["korean"] = "안녕하세요, 만나서 반갑습니다. 서울은 대한민국의 수도입니다. ᄀᄁ ㄱㄴㄷ"
    c["emoji"] = "😀😃 👍 👍🏽 ❤️ 🔥🚀 ✅❌ ⭐ text😀text 1😀2"
    c["emoji_zwj"] = "👨‍👩‍👧‍👦 👩‍💻 🏳️‍🌈 🧑🏾‍🚀 🇯🇵🇰🇷 a👨‍👩‍👧b"
    c["combining"] = "e\u0301 a\u0300\u0301 n\u0303o Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356 \u0301\u0302x x\u0301\u0302 \u0915\u093f \u0e01\u0e34"
    c["whitespace_mixed"] = "a  b   c\t\td \n e\n\n\nf \r\n g\r\rh   \n\n   i\t \t\n\u3000j\u00a0k\u2003l \u2028m\u2029n\x0b\x0co\x85p"
    c["whitespace_only"] = "   \n\t  \r\n  \n\n \t "
    c["trailing_spaces"] = "word   \nword2\t\t\nword3 \u3000"
    c["mongolian_vowel_separator"] = "a\u180eb \u180e! x \u180e\u180e y\u200bz \u2060w"
    c["long_spaces"] = " " * 3000 + "x" + "\n" * 500 + "\t" * 300
    c["long_word"] = "a" * 2500 + " " + "ab" * 1500 + " " + "Supercalifragilistic" * 60
    c["long_digits"] = "9" * 1000 + " " + "1234567890" * 50
    c["long_han"] = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处理" * 2
    c["greek_cyrillic"] = "Γειά σου κόσμε! ΕΛΛΗΝΙΚΑ. Привет, МИР! ёЁ Ѐ"
    c["rtl"] = "مرحبا بالعالم 123 שלום עולם"
    c["indic_thai"] = "नमस्ते दुनिया। สวัสดีชาวโลก"
    c["latin_accents"] = "déjà vu, CAFÉ crème, naïve, Größe STRASSE, ǅungla ǈ ǋ, ß ẞ, ﬁ ﬂ"
    c["titlecase_modifier"] = "ǅa ǅ ʰʲ ˈstress ʼapos ᵃᵇᶜ"
    c["symbols_math"] = "∑x²+√y≤∞ α≠β ∀x∈ℝ © ® ™ § ¶ † … ‰ ← → ★ ♠ ° µ € £ ¥"
    c["fullwidth"] = "ＡＢＣ　１２３　ｈｅｌｌｏ。ｗｏｒｌｄ！"
    c["control_chars"] = "a\x00b\x01c\x7fd\x1b[0m\x1fe"
    c["private_use_unassigned"] = "\ue000\uf8ff\U000f0000 \U0010fffd x\U000e0001y a\u0378b \u0378!"
    c["newer_unicode_cjk_ext_i"] = "中\U0002ebf0\U0002ebf1文 \U0002ee5d"
    c["special_tokens"] = ("<|im_system|>system<|im_middle|>You are helpful.<|im_end|>"
                           "<|im_user|>user<|im_middle|>Hi!<|im_end|><|im_assistant|>assistant<|im_middle|>")
    c["special_adjacent"] = "[BOS]<|im_end|><|im_end|>x<|im_end|> [EOS][PAD][UNK]"
    c["special_embedded"] = "abc<|im_end|>def 123<|tool_call_begin|>456 <|im_end|"
    c["special_partial"] = "<|im_end <|im_end|| |im_end|> <| im_end |> [BOS [EOS]]"
    reserved = [name for name in specials if name.startswith("<|reserved_token_")]
    c["special_reserved"] = reserved[0] + "x" + reserved[-1] + " " + reserved[3]
    c["tool_calls"] = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                       "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
                       "<|tool_calls_section_end|>")
    return c


def random_cases(rng, count):
    ws = [" ", "\t", "\n", "\r", "\u3000", "\u00a0", "\u2003", "\u180e", "\u200b", "\x85"]
    pools = [
        (25, lambda: chr(rng.randint(0x20, 0x7e))),
        (6, lambda: rng.choice(ws)),
        (5, lambda: chr(rng.randint(0xc0, 0x24f))),
        (4, lambda: chr(rng.randint(0x370, 0x4ff))),
        (8, lambda: chr(rng.randint(0x4e00, 0x9fff))),
        (4, lambda: chr(rng.randint(0x3000, 0x303f))),
        (5, lambda: chr(rng.randint(0x3040, 0x30ff))),
        (4, lambda: chr(rng.randint(0xac00, 0xd7a3))),
        (5, lambda: chr(rng.randint(0x1f300, 0x1faff))),
        (4, lambda: chr(rng.randint(0x300, 0x36f))),
        (3, lambda: rng.choice("0123456789") * rng.randint(1, 5)),
        (2, lambda: rng.choice(["'s", "'T", "'re", "'VE", "'m", "'Ll", "'d"])),
        (2, lambda: chr(rng.randint(0x0600, 0x0fff))),
        (3, lambda: chr(rng.choice([rng.randint(0, 0xd7ff), rng.randint(0xe000, 0x10ffff)]))),
        (1, lambda: chr(rng.randint(0x20000, 0x323af))),
    ]
    weights = [w for w, _ in pools]

    # Only characters assigned in Python's Unicode tables (14.0 for Python 3.11), which are older
    # than both PCRE2 10.42's (15.0) and tiktoken's regex tables: the random cases must not fall
    # in the "newer Unicode" mismatch class, which the fixed newer_unicode_* cases cover.
    def draw():
        while True:
            ch = rng.choices(pools, weights)[0][1]()
            if all(unicodedata.category(c) != "Cn" for c in ch):
                return ch

    out = {}
    for i in range(count):
        n = rng.randint(1, 48)
        out[f"random_{i:03d}"] = "".join(draw() for _ in range(n))
    return out


INVALID_UTF8 = {
    "invalid_lone_continuation": b"ab\x80cd",
    "invalid_bad_lead": b"\xff\xfe x \xc0\xaf \xc1\xbf",
    "invalid_truncated_3": b"x\xe4\xb8 y",
    "invalid_truncated_at_end": b"end\xe4\xb8",
    "invalid_surrogate": b"s\xed\xa0\x80t",
    "invalid_overlong": b"o\xe0\x80\xafv \xf0\x80\x80\xaf",
    "invalid_too_large": b"\xf4\x90\x80\x80 \xf5\x80\x80\x80",
    "invalid_mixed": b"\xe4\xb8\xad\xe6\x96 \x87\xe4\xb8\xad <|im_end|>\xff",
}


def main():
    enc, specials = load_encoding()
    rng = random.Random(20251030)
    cases = []
    texts = dict(fixed_cases(specials))
    texts.update(random_cases(rng, 400))
    for name, text in texts.items():
        cases.append({"name": name, "text": text,
                      "ids": enc.encode(text, allowed_special="all"),
                      "ids_ordinary": enc.encode(text, disallowed_special=())})
    for name, raw in INVALID_UTF8.items():
        text = raw.decode("utf-8", errors="replace")
        cases.append({"name": name, "bytes_b64": base64.b64encode(raw).decode(),
                      "ids": enc.encode(text, allowed_special="all"),
                      "ids_ordinary": enc.encode(text, disallowed_special=())})
    out = {"generator": "tests/tokenizer/make_tiktoken_golden.py",
           "tiktoken_version": tiktoken.__version__, "pattern": KIMI_PATTERN,
           "num_ranks": enc.n_vocab - NUM_SPECIAL, "cases": cases}
    path = DATA / "tiktoken_golden.json"
    # One case per line keeps the committed file reviewable in diffs.
    head = json.dumps({k: v for k, v in out.items() if k != "cases"}, ensure_ascii=True)[:-1]
    body = ",\n".join(json.dumps(c, ensure_ascii=True, separators=(",", ":")) for c in cases)
    path.write_text(head + ', "cases": [\n' + body + "\n]}\n")
    print(f"wrote {path} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
