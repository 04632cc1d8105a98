// The built-in BPE training text (written for megadecode; no external source). It mixes the kinds
// of text a chat model sees so that the learned merges exercise every pre-tokeniser branch.
#include "megadecode/tokenizer/bpe_train.h"

namespace md {

std::string_view builtin_training_corpus() {
  static constexpr std::string_view kCorpus = R"corpus(
The engine reads the weights once per token, so the speed of decoding is set by memory bandwidth.
A small model is useful for testing: it loads in a second, and every layer can be checked against
the reference. We don't guess; we measure. It's the only way to know what the machine can do.
They're running the benchmark again tonight, and I'll write down the numbers when it's done.
You've seen the plan: the kernels wait on counters, and the counters are signalled by producers.
WHAT'S THE STATUS? IT'S FINE. WE'LL KNOW BY MORNING. I'M SURE THEY'D AGREE. YOU'RE RIGHT.
The quick brown fox jumps over the lazy dog. The lazy dog sleeps; the fox runs into the forest.
Attention is computed over the cached latent vectors, and the delta rule updates the state.
In the morning, the team reviewed the results: throughput was 41.7 tokens per second at batch 1,
and 312.5 tokens per second at batch 16. The memory bandwidth was 204.8 GB/s on that machine.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 4096 65536 163840 3.14159 2.71828 -17 +5
Dates and times: 2025-10-30, 12:45:07, 1999/12/31 23:59, version 1.2.3, build #8812, ID A7F3-22B9.
Prices: $19.99, EUR 42,50, 1,000,000 users, 99.9% uptime, 3x faster, 0.5 ms, 1e-5, 6.02e23.

def rms_norm(x, weight, eps=1e-5):
    variance = (x * x).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight

for i in range(10):
    if i % 2 == 0:
        print(f"even: {i}")
    else:
        print("odd:", i)

class Tokenizer:
    def __init__(self, path: str) -> None:
        self.path = path
        self.cache = {}

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

#include <vector>
#include <string>

int main(int argc, char** argv) {
  std::vector<int> values = {1, 2, 3, 4};
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] *= 2;  // double every value
  }
  if (argc > 1 && argv[1][0] == '-') return 1;
  return 0;
}

template <typename T>
T clamp(T x, T lo, T hi) { return x < lo ? lo : (x > hi ? hi : x); }

SELECT name, COUNT(*) AS n FROM users WHERE age >= 18 GROUP BY name ORDER BY n DESC LIMIT 10;
{"model": "kimi-linear", "layers": 27, "hidden_size": 2304, "experts": [256, 8], "ok": true}
<html><body><p class="note">Hello, world!</p><a href="https://example.org/a?b=1&c=2">link</a></body></html>
$ cmake -S . -B build -G Ninja && ninja -C build && ./build/megadecode --help
git commit -m "Fix the off-by-one in the router"; echo $? >> log.txt 2>&1
    Tabs	separate	these	columns	and	these	values:	1	2	3
Line one
Line two

Line four after an empty line
  indented line with trailing spaces   
Windows line ending here
Mixed    spacing   and		tabs   here.

人工智能正在改变世界。我们今天学习了很多新的知识，明天继续努力。
这个模型的推理速度很快，内存带宽决定了解码的速度。中文文本没有空格分隔词语。
北京、上海、广州和深圳都是中国的大城市。天气很好，我们去公园散步吧！
机器学习和深度学习是人工智能的重要分支。数据越多，模型越好。
東京は日本の首都です。今日はとても良い天気ですね。私は毎朝コーヒーを飲みます。
ひらがなとカタカナとかんじをつかってぶんしょうをかきます。コンピューターのプログラム。
ありがとうございます。よろしくお願いします。すみません、駅はどこですか？
한국어는 한글로 씁니다. 안녕하세요, 만나서 반갑습니다. 오늘 날씨가 정말 좋네요.
서울은 대한민국의 수도입니다. 저는 매일 아침 커피를 마십니다. 감사합니다!
Русский текст: привет, мир! Это пример предложения на русском языке. Спасибо.
Ελληνικά: Γειά σου κόσμε. Η γλώσσα είναι όμορφη. Ευχαριστώ πολύ.
العربية: مرحبا بالعالم. هذه جملة قصيرة للتجربة.
עברית: שלום עולם. זה משפט קצר לבדיקה.
हिन्दी: नमस्ते दुनिया। यह एक छोटा वाक्य है।
ไทย: สวัสดีชาวโลก นี่คือประโยคสั้นๆ
Français : déjà vu, café crème, naïve façade, Noël à l'hôtel, où est l'élève ?
Deutsch: Größe, Straße, schön, Mädchen, Übermäßig — über alles; Äpfel und Öl.
Español: ¿Dónde está la biblioteca? ¡Mañana será otro día! Canción, niño, corazón.
Português: ação, coração, não, você, pão. Tiếng Việt: Xin chào thế giới, cảm ơn bạn.
Emoji: 😀 😃 😄 😁 😆 😅 😂 🤣 🥲 ☺️ 😊 👍 👍🏽 ❤️ 🔥 🚀 🎉 ✅ ❌ ⭐ 🌍 🍕 🐍
Families and flags: 👨‍👩‍👧‍👦 👩‍💻 🏳️‍🌈 🇯🇵 🇰🇷 🇨🇳 🇺🇸 🇫🇷 🇩🇪
Math: ∑ x² + √y ≤ ∞, α β γ δ ε λ μ π σ ω, ∀x ∈ ℝ: x² ≥ 0, 1/2 + 1/3 = 5/6, a ≠ b, ≈ ± × ÷
Symbols: © ® ™ § ¶ † ‡ • … ‰ ← → ↑ ↓ ↔ ⇒ ⇔ ★ ☆ ♠ ♣ ♥ ♦ ♪ ♫ ° µ ¢ £ ¥ €
Combining marks: e\u0301 a\u0300 n\u0303 o\u0308 — é à ñ ö — Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇
Full-width: ＡＢＣ　１２３　ｈｅｌｌｏ。 Ideographic space:　between.
We are training a tokenizer. Training tokenizers is fun! Tokenization splits text into tokens.
The tokenizer, the tokenizers, tokenizing, tokenized: the same root, many forms. Decoding works.
Streaming decode must hold back bytes of a character until the character is complete.
Special tokens like these are plain text here: <|im_end|> [BOS] <|im_middle|>.
She said, "I can't believe it's already 5 o'clock!" He replied: 'We'd better hurry, then.'
(parentheses) [brackets] {braces} <angles> "quotes" 'single' `backticks` --dashes-- ...dots...
URL: https://github.com/example/repo/blob/main/src/file.cpp#L120 and mail: someone@example.com
Path: /usr/local/lib/libexample.so.1.2.3 and C:\Program Files\Example\bin\tool.exe
Hex: 0xDEADBEEF 0x7fffffff 0b1010 0o755 #ff8800 rgba(255, 128, 0, 0.5) U+1F600 \x41\u00e9
)corpus";
  return kCorpus;
}

}  // namespace md
