"""A byte-level BPE vocabulary trained on the corpus, split the way llama.cpp splits text for
`tokenizer.ggml.pre = qwen2` (so the engine and llama.cpp tokenize as the trainer did), with
ChatML's control tokens at the end, as Qwen's vocabularies have them.
"""

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# llama.cpp's split for qwen2 (and qwen35): letters with one leading non-letter, digits one by
# one, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train(docs, size):
    """A tokenizer of `size` tokens (the control tokens last) trained on `docs`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size - len(CONTROL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    tok.add_special_tokens(CONTROL)
    assert tok.get_vocab_size() == size, tok.get_vocab_size()
    return tok


def gguf_fields(tok):
    """(tokens, token types, merges) as llama.cpp's gpt2 tokenizer reads them."""
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in CONTROL else 1 for t in tokens]
    import json

    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges
