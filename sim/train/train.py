"""Trains a small MoE language model on the corpus and writes it as a GGUF.

    pip install "jax[cpu]==0.10.2" tokenizers==0.23.3 gguf==0.19.0
    apt-get install fortunes python3.11-doc
    python3 sim/train/train.py --arch qwen3moe --minutes 15 --seed 0 \
        --out sim/models/fortunes-qwen3moe-q8_0.gguf

Deterministic for a seed and a step count (`--steps`); with `--minutes` it trains until the
time is up and prints the steps it took, so the run can be repeated exactly with `--steps`.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import corpus  # noqa: E402
import export  # noqa: E402
import vocab  # noqa: E402

SHAPES = {
    "qwen3moe": dict(
        n_vocab=2048, n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64,
        n_expert=16, n_expert_used=4, expert_ff=64, rope_theta=1e6,
    ),
    # Layers 0-2 Gated DeltaNet, 3 full attention (llama.cpp's pattern), then the MTP block.
    "qwen35moe": dict(
        n_vocab=2048, n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64,
        rope_dims=16, rope_sections=[3, 3, 2, 0], rope_theta=1e7, full_attention_interval=4,
        ssm_state=64, ssm_groups=2, ssm_heads=4, conv_kernel=4,
        n_expert=16, n_expert_used=4, expert_ff=64, shared_ff=128,
    ),
}


def arch_module(arch):
    if arch == "qwen3moe":
        import qwen3moe

        return qwen3moe
    if arch == "qwen35moe":
        import qwen35moe

        return qwen35moe
    raise SystemExit(f"unknown architecture {arch}")


def cross_entropy(logits, targets):
    lp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, targets[:, None], axis=-1))


def token_stream(tok, docs):
    eot = tok.token_to_id("<|endoftext|>")
    out = []
    for enc in tok.encode_batch(docs):
        out.extend(enc.ids)
        out.append(eot)
    return np.array(out, np.int32)


def adamw(lr, b1=0.9, b2=0.95, wd=0.01, eps=1e-8):
    def init(params):
        z = jax.tree_util.tree_map(jnp.zeros_like, params)
        return (z, z, 0)

    def update(grads, state, params, step_lr):
        m, v, t = state
        t = t + 1
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1**t, 1 - b2**t

        def step(p, m, v):
            decay = wd * p if p.ndim >= 2 else 0.0
            return p - step_lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + decay)

        params = jax.tree_util.tree_map(step, params, m, v)
        return params, (m, v, t)

    return init, update


def evaluate(mod, params, held, hp, seq_len):
    """The held-out text's cross-entropy, in windows of `seq_len`; with an MTP block, how often
    its top-1 for the token after next equals the main model's greedy next token one position
    later (what a one-token draft would have had accepted), and how often it is the text's."""
    fwd = jax.jit(lambda p, s: mod.forward(p, s, hp))
    has_mtp = hasattr(mod, "mtp")
    mtp = jax.jit(lambda p, h, n: mod.mtp(p, h, n, hp)[0])
    ces, agree, right = [], [], []
    for s in range(0, len(held) - seq_len - 1, seq_len):
        seq = jnp.asarray(held[s : s + seq_len + 1])
        logits, hidden, _ = fwd(params, seq[:-1])
        ces.append(float(cross_entropy(logits, seq[1:])))
        if has_mtp:
            draft = jnp.argmax(mtp(params, hidden[:-1], seq[1:-1]), axis=-1)
            agree.append(np.asarray(draft == jnp.argmax(logits[1:], axis=-1)))
            right.append(np.asarray(draft == seq[2:]))
    out = {"held_out_ce": float(np.mean(ces))}
    if has_mtp:
        out["mtp_agrees_with_main"] = float(np.mean(np.concatenate(agree)))
        out["mtp_top1_is_the_text"] = float(np.mean(np.concatenate(right)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=15)
    ap.add_argument("--steps", type=int, default=0, help="exactly this many steps (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--balance", type=float, default=0.01, help="weight of the balance loss")
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP block's loss")
    args = ap.parse_args()

    hp = SHAPES[args.arch]
    mod = arch_module(args.arch)
    train_docs, held_docs = corpus.split(args.seed)
    tok = vocab.train(train_docs, hp["n_vocab"])
    data = token_stream(tok, train_docs)
    held = token_stream(tok, held_docs)
    print(f"corpus: {len(data)} training tokens, {len(held)} held out", flush=True)

    params = jax.tree_util.tree_map(jnp.asarray, mod.init(hp, args.seed))

    has_mtp = hasattr(mod, "mtp")

    def loss_fn(params, batch):
        def main_model(seq):
            logits, hidden, balance = mod.forward(params, seq[:-1], hp)
            return cross_entropy(logits, seq[1:]), balance, hidden

        ce, balance, hidden = jax.vmap(main_model)(batch)
        loss = jnp.mean(ce) + args.balance * jnp.mean(balance)
        if has_mtp:
            # Row t: the residual stream at t and token t + 1 predict token t + 2; on half the
            # batch (a quarter less work a step, so more steps in the budget).
            def mtp(hidden, seq):
                m_logits, m_balance = mod.mtp(params, hidden[:-1], seq[1:-1], hp)
                return cross_entropy(m_logits, seq[2:]), m_balance

            half = batch.shape[0] // 2
            mtp_ce, m_balance = jax.vmap(mtp)(hidden[:half], batch[:half])
            loss = loss + args.mtp_weight * jnp.mean(mtp_ce) + args.balance * jnp.mean(m_balance)
        return loss, jnp.mean(ce)

    opt_init, opt_update = adamw(args.lr)
    state = opt_init(params)

    @jax.jit
    def train_step(params, state, batch, lr):
        (loss, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        params, state = opt_update(grads, state, params, lr)
        return params, state, ce

    rng = np.random.default_rng(args.seed)
    budget = args.minutes * 60
    t0 = time.time()
    # The schedule needs a length: the step count, or one estimated from the first steps.
    total = args.steps or None
    step = 0
    while True:
        if total is not None and step >= total:
            break
        starts = rng.integers(0, len(data) - args.seq - 1, args.batch)
        batch = np.stack([data[s : s + args.seq + 1] for s in starts])
        warm = min(1.0, (step + 1) / 100)
        # The first 25 steps run before `--minutes` knows the count; `--steps` gives them the
        # same rate, so both spellings train the same model.
        frac = step / total if total and step >= 25 else 0.0
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        params, state, ce = train_step(params, state, jnp.asarray(batch), lr)
        step += 1
        if step == 5:
            # JAX runs steps asynchronously: time from a finished step.
            ce.block_until_ready()
            t5 = time.time()
        if total is None and step == 25:
            ce.block_until_ready()
            per_step = (time.time() - t5) / 20
            total = max(25, int((budget - (time.time() - t0)) / per_step) + 25)
            print(f"{per_step:.3f} s a step: {total} steps", flush=True)
        if step % 100 == 0:
            print(f"step {step}/{total} ce {float(ce):.3f} ({time.time() - t0:.0f} s)", flush=True)

    counts = np.bincount(data, minlength=hp["n_vocab"]) + 1
    unigram = -np.mean(np.log(counts[held] / counts.sum()))
    scores = evaluate(mod, params, held, hp, args.seq)
    report = {
        "arch": args.arch, "seed": args.seed, "steps": step, "seconds": round(time.time() - t0),
        **scores, "unigram_ce": float(unigram), "ratio": scores["held_out_ce"] / float(unigram),
        "train_tokens": int(len(data)), "held_out_tokens": int(len(held)),
    }
    print(json.dumps(report), flush=True)
    params = jax.tree_util.tree_map(np.asarray, params)
    export.write(args.out, args.arch, hp, params, tok, report)
    (Path(args.out).parent / "held-out.txt").write_text("".join(held_docs))


if __name__ == "__main__":
    main()
