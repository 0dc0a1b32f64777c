"""What llama.cpp (llama-cpp-python) says of a trained model, written beside it for the
engine's tests to compare with:

- `M.reference.json`: the held-out passage's tokens; llama.cpp's per-token cross-entropy on
  the whole held-out text beside the corpus's unigram cross-entropy (and the unigram
  probabilities' negative logs, for the engine to score its own); a prompt and llama.cpp's
  greedy continuation, with the share of its words found in the training text's words;
- `M.logits.bin`: llama.cpp's logits over the held-out passage, f32 `[T][n_vocab]`;
- `words.txt`: every word of the training text (lower case, letters only).

    python3 sim/train/reference.py sim/models/fortunes-qwen3moe-q8_0.gguf --window 128

The cross-entropy is scored in windows of the length the model was trained on (`--window`):
past it, its attention meets positions it never saw.
"""

import argparse

import json
import re
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama

sys.path.insert(0, str(Path(__file__).parent))
import corpus  # noqa: E402

PASSAGE_TOKENS = 128
PROMPT = "The best thing about a good friend is"
WORD = re.compile(r"[a-z]+")


def main(path, window):
    path = Path(path)
    stem = path.with_suffix("")
    train_docs, held_docs = corpus.split(0)
    m = Llama(str(path), logits_all=True, verbose=False, n_ctx=2048, seed=0)
    n_vocab = m.n_vocab()
    eot = m.tokenize(b"<|endoftext|>", add_bos=False, special=True)[0]

    def tokens(docs):
        out = []
        for d in docs:
            out += m.tokenize(d.encode(), add_bos=False, special=False) + [eot]
        return out

    train, held = tokens(train_docs), tokens(held_docs)
    counts = np.bincount(train, minlength=n_vocab) + 1
    neglog = -np.log(counts / counts.sum())
    unigram = float(np.mean(neglog[held]))

    # Cross-entropy over the held-out text, in windows (each scored from its start).
    ces = []
    for s in range(0, len(held) - 1, window):
        w = held[s : s + window + 1]
        m.reset()
        m.eval(w[:-1])
        lp = np.array(m.scores[: len(w) - 1], dtype=np.float64)
        lp = lp - np.log(np.exp(lp - lp.max(1, keepdims=True)).sum(1, keepdims=True)) - lp.max(1, keepdims=True)
        ces.extend(-lp[np.arange(len(w) - 1), w[1:]])
    ce = float(np.mean(ces))

    passage = held[:PASSAGE_TOKENS]
    m.reset()
    m.eval(passage)
    np.asarray(m.scores[: len(passage)], dtype=np.float32).tofile(f"{stem}.logits.bin")

    m.reset()
    prompt = m.tokenize(PROMPT.encode(), add_bos=False, special=False)
    out = m.create_completion(PROMPT, max_tokens=48, temperature=0.0, top_k=1)
    text = out["choices"][0]["text"]
    words = set(WORD.findall("".join(train_docs).lower()))
    got = WORD.findall(text.lower())
    share = sum(w in words for w in got) / max(1, len(got))
    (path.parent / "words.txt").write_text("\n".join(sorted(words)) + "\n")

    ref = {
        "passage": passage,
        "held_out_ce": ce,
        "window": window,
        "unigram_ce": unigram,
        "ratio": ce / unigram,
        "unigram_neglog": [float(x) for x in neglog],
        "prompt": PROMPT,
        "prompt_tokens": prompt,
        "greedy_text": text,
        "greedy_words_in_training_words": share,
    }
    Path(f"{stem}.reference.json").write_text(json.dumps(ref, indent=1))
    print(json.dumps({k: v for k, v in ref.items() if k not in ("unigram_neglog", "passage")}, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--window", type=int, default=128, help="the model's training context")
    a = ap.parse_args()
    main(a.model, a.window)
