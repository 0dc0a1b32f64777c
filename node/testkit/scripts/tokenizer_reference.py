#!/usr/bin/env python3
"""Writes data/vocab/corpus.json: text of our own and llama.cpp's token ids for it.

llama.cpp (llama-cpp-python 0.3.36, `Llama(vocab_only=True)`, `tokenize(add_bos=False,
special=True)` as llama.cpp's own tokenizer tests and its server do) tokenizes every case with
Qwen3.5's vocabulary (`ggml-vocab-qwen35.gguf`, `tokenizer.ggml.pre = qwen35`) and with the
same vocabulary under `tokenizer.ggml.pre = qwen2` (llama.cpp's `ggml-vocab-qwen2.gguf`, which
differs from it in that key only). Run from node/testkit:

    pip install llama-cpp-python==0.3.36
    python3 scripts/tokenizer_reference.py VOCAB_DIR   # holds ggml-vocab-qwen{2,35}.gguf
"""
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "data", "vocab", "corpus.json")

LINES = [
    # English prose, punctuation, contractions.
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "I'd've thought you'll see they're right; we've said so, haven't we?",
    "DON'T SHOUT! I'M RIGHT HERE, AREN'T I?",
    "He said: \"Well... maybe.\" She replied -- 'no'.",
    "Mr. O'Neil's dog (aged 3½) won the 1st prize at 10:45 a.m.",
    "e-mail: someone@example.com, web: https://example.org/path?q=1&r=two#frag",
    "A swarm of small devices runs one large Mixture-of-Experts model.",
    "Wait—what? That's… impossible!",
    "“Curly quotes” and ‘single ones’ and «guillemets».",
    # Other scripts and languages.
    "Der Fluß ist breit, die Straße ist lang, und die Äpfel sind süß.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "¿Dónde está la biblioteca? ¡Aquí!",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Γαζέες καὶ μυρτιὲς δὲν θὰ βρῶ πιὰ στὸ χρυσαφὶ ξέφωτο.",
    "שלום עולם, מה שלומך היום?",
    "مرحبا بالعالم! كيف حالك اليوم؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "স্বাগতম, আপনি কেমন আছেন?",
    "வணக்கம் உலகம்",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "我想在apple工作1314151天～",
    "日本語の文章：東京は日本の首都です。カタカナとひらがな。",
    "한국어 문장입니다. 안녕하세요, 세계!",
    "Tiếng Việt có dấu: Cửa Việt, Hà Nội, Sài Gòn.",
    "Türkçe: Işık ılık süt iç, ğüşöç.",
    "Polski: Zażółć gęślą jaźń.",
    "Čeština: Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "ქართული ენა და ᲥᲐᲠᲗᲣᲚᲘ",
    "Ελληνικά και English mixed με 123 numbers.",
    "Հայերեն տեքստ",
    "ᚠᚢᚦᚨᚱᚲ runes and 𐌰𐌱𐌲 gothic",
    # Combining marks and normalization forms.
    "e\u0301 vs \u00e9 (decomposed vs precomposed)",
    "re\u0301sume\u0301 and résumé",
    "a\u0300\u0301\u0302\u0303\u0304 stacked marks",
    "Zalgo: Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367\u0369\u0358\u0320G\u0311\u0357\u030e\u0305\u035b\u0341\u0334\u033b\u0348\u034d\u0354\u0339O\u0342\u030c\u030c\u0358\u0328\u0335\u0339\u033b\u031d\u0333",
    "क्षत्रिय and ष्ट्र conjuncts",
    "\u0915\u093f \u0915\u0940 \u0915\u0941 vowel signs",
    "Hangul jamo: \u1100\u1161\u11a8 vs 각",
    "Thai marks: \u0e01\u0e34\u0e48\u0e19",
    "Arabic harakat: \u0643\u064e\u062a\u064e\u0628\u064e",
    # Code.
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{v:?}\");\n}",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "<div class=\"row\"><span id='x'>&amp;&lt;&gt;</span></div>",
    "{\"key\": [1, 2.5, -3e-7, true, null], \"nested\": {\"a\": \"b\"}}",
    "x = a**2 + b**2; y = (x >> 3) | 0xFF; z = ~y & 0b1010",
    "#!/bin/sh\nset -eu\ncd \"$(dirname \"$0\")\" && ls -la | grep -v '^d'",
    "  if (ok) {\n      return;\n  }\n",
    "\t\t// tabs before a comment\n\t\tcall();",
    "λx. λy. x y → ∀ε>0 ∃δ>0: |x−y|<δ ⇒ |f(x)−f(y)|<ε",
    "a == b != c <= d >= e && f || !g",
    "path/to/file.rs:123:45: error[E0308]: mismatched types",
    # Numbers.
    "3.14159265358979323846264338327950288419716939937510",
    "1,234,567.89 and 1.234.567,89 and 1 234 567",
    "Call +1 (555) 012-3456 or 0044 20 7946 0958.",
    "2026-12-06T08:53:34Z",
    "0x7fffffff 0b1010 0o777 1e10 -2.5e-3",
    "١٢٣٤٥ ०१२३४ 一二三 ①②③ Ⅻ ½ ¾ ²³",
    "12345678901234567890123456789012345678901234567890",
    # Emoji.
    "Hello 👋 world 🌍!",
    "🚀🚀🚀 launch",
    "Family: 👨‍👩‍👧‍👦 and flags: 🇫🇷🇯🇵🇺🇸",
    "Skin tones: 👍🏻👍🏼👍🏽👍🏾👍🏿",
    "❤️ vs ❤ (with and without VS16)",
    "🦙.cpp and 🦀 rust and 🐍 python",
    "😶‍🌫️ fog face and 🏳️‍🌈 flag",
    # Whitespace.
    "",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n\n",
    "\r\n",
    " \n \n ",
    "word" + " " * 40 + "word",
    "\t" * 12 + "indented",
    "trailing spaces    ",
    "   leading spaces",
    "mixed \t \n \r\n\t whitespace",
    "\u00a0non-breaking\u00a0spaces\u2003em\u2009thin",
    "line one\nline two\n\nline four",
    "\n\n\nstarts with newlines",
    # Special and user-defined tokens.
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more",
    "[PAD151650] is user-defined and [PAD151700]x too",
    "<|im_start|><|im_start|><|im_end|>",
    "< |im_start| > is not a token",
]

WORDS = ("alpha beta gamma delta epsilon Straße naïve café 東京 北京 Москва "
         "42 007 3.5 😀 🚀 don't it's x_y CamelCase snake_case kebab-case").split()


def generated(rng):
    out = []
    for _ in range(80):
        n = rng.randint(1, 12)
        seps = [" ", "  ", "\t", "\n", ", ", ". ", "-", "", " \n"]
        out.append("".join(rng.choice(WORDS) + rng.choice(seps) for _ in range(n)))
    for k in [1, 2, 3, 4, 5, 7, 9, 13, 64]:
        out.append(" " * k + "x")
        out.append("x" + "\n" * k)
        out.append("9" * k)
    for k in [2, 8, 33]:
        out.append("!" * k + "?" * k)
        out.append("ab" * k)
        out.append("é" * k)
    return out


def main():
    from llama_cpp import Llama

    vocab_dir = sys.argv[1]
    cases = LINES + generated(random.Random(32))
    result = {"cases": cases}
    for pre, name in [("qwen35", "ggml-vocab-qwen35.gguf"), ("qwen2", "ggml-vocab-qwen2.gguf")]:
        llm = Llama(os.path.join(vocab_dir, name), vocab_only=True, verbose=False)
        result[pre] = [llm.tokenize(c.encode(), add_bos=False, special=True) for c in cases]
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False, indent=0)
    print(len(cases), "cases")


if __name__ == "__main__":
    main()
