"""The MTP block's reference outputs for a trained qwen35moe, for the engine to compare with
(llama.cpp does not run the block through its Python API): the JAX definition in
`qwen35moe.py` run in f32 on the GGUF's own weights, dequantized by gguf-py.

- `M.mtp.logits.bin`: f32 `[T-1][n_vocab]`, row t the MTP block's logits for the token after
  next, from the main model's residual stream at position t of the held-out passage and the
  passage's token t + 1;
- `M.mtp.json`: over all held-out text (windows of `--window`), how often the block's top-1
  equals the main model's greedy token one position later, and how often it is the text's.

    python3 sim/train/mtp_reference.py sim/models/fortunes-qwen35moe-q8_0.gguf --window 256
"""

import argparse
import json
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import export  # noqa: E402
import qwen35moe  # noqa: E402
import train  # noqa: E402
import vocab  # noqa: E402
import corpus  # noqa: E402


def weights(path):
    """The GGUF's tensors by name, dequantized to f32 in gguf-py's (out × in) shapes."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(t.shape))
        out[t.name] = a.reshape(shape) if a.size == np.prod(shape) else a
    return out


def params_of(w, hp):
    """The trainer's parameter tree from a GGUF's tensors."""
    template = qwen35moe.init(hp, 0)

    def block(l, names):
        return {n: w[export.gguf_name(l, n)].reshape(template_shape(n, l)) for n in names}

    def template_shape(n, l):
        src = template["mtp"] if l == hp["n_layer"] else template["layers"][l]
        return src[n].shape

    return {
        "token_embd": w["token_embd.weight"],
        "output_norm": w["output_norm.weight"],
        "output": w["output.weight"],
        "layers": [block(l, template["layers"][l]) for l in range(hp["n_layer"])],
        "mtp": block(hp["n_layer"], template["mtp"]),
    }


def main(path, window):
    path = Path(path)
    stem = path.with_suffix("")
    hp = train.SHAPES["qwen35moe"]
    params = jax.tree_util.tree_map(jnp.asarray, params_of(weights(str(path)), hp))
    reference = json.loads(Path(f"{stem}.reference.json").read_text())
    passage = jnp.asarray(reference["passage"], jnp.int32)
    fwd = jax.jit(lambda p, s: qwen35moe.forward(p, s, hp))
    mtp = jax.jit(lambda p, h, n: qwen35moe.mtp(p, h, n, hp)[0])
    _, hidden, _ = fwd(params, passage)
    logits = mtp(params, hidden[:-1], passage[1:])
    np.asarray(logits, np.float32).tofile(f"{stem}.mtp.logits.bin")

    train_docs, held_docs = corpus.split(0)
    tok = vocab.train(train_docs, hp["n_vocab"])
    held = train.token_stream(tok, held_docs)
    scores = train.evaluate(qwen35moe, params, held, hp, window)
    scores["window"] = window
    Path(f"{stem}.mtp.json").write_text(json.dumps(scores, indent=1) + "\n")
    print(json.dumps(scores, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--window", type=int, default=256, help="the model's training context")
    a = ap.parse_args()
    main(a.model, a.window)
