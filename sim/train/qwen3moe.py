"""qwen3moe's forward pass in JAX, as llama.cpp and the engine compute it: RMSNorm, grouped
query attention with per-head q/k RMSNorm and NeoX RoPE, and a softmax top-k router over SwiGLU
experts whose chosen weights are normalized to sum to one. Weights are kept in the shapes
gguf-py writes (out × in), so the export is a plain copy.

Training computes every expert for every row and weighs them by the router (zero off the
top-k): the same function, dense, for small models.
"""

import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-6


def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def rope_neox(x, pos, theta, dims):
    """x: [T, H, D]; rotates the first `dims` of D in NeoX pairs (i, i + dims/2)."""
    half = dims // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / dims)
    ang = pos[:, None].astype(jnp.float32) * freqs[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def attention(p, h, hp, pos):
    T = h.shape[0]
    H, K, D = hp["n_head"], hp["n_head_kv"], hp["head_dim"]
    q = (h @ p["attn_q"].T).reshape(T, H, D)
    k = (h @ p["attn_k"].T).reshape(T, K, D)
    v = (h @ p["attn_v"].T).reshape(T, K, D)
    q = rope_neox(rms(q, p["attn_q_norm"]), pos, hp["rope_theta"], D)
    k = rope_neox(rms(k, p["attn_k_norm"]), pos, hp["rope_theta"], D)
    return causal_attention(q, k, v).reshape(T, H * D) @ p["attn_output"].T


def causal_attention(q, k, v):
    """Grouped-query causal softmax attention: q [T, H, D], k and v [T, K, D] → [T, H, D]."""
    T = q.shape[0]
    return masked_attention(q, k, v, jnp.tril(jnp.ones((T, T), bool)))


def masked_attention(q, k, v, allowed):
    """Grouped-query softmax attention where query t sees key s when `allowed[t, s]`:
    q [T, H, D], k and v [S, K, D] → [T, H, D]."""
    H, D = q.shape[1], q.shape[2]
    k = jnp.repeat(k, H // k.shape[1], axis=1)
    v = jnp.repeat(v, H // v.shape[1], axis=1)
    s = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(D)
    s = jnp.where(allowed[None], s, -1e30)
    return jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1), v)


def moe(p, h, hp):
    """The routed experts; also the router's probabilities (for the balance loss)."""
    logits = h @ p["ffn_gate_inp"].T  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    top, idx = jax.lax.top_k(probs, hp["n_expert_used"])
    top = top / jnp.sum(top, axis=-1, keepdims=True)
    gates = jnp.zeros_like(probs).at[jnp.arange(h.shape[0])[:, None], idx].set(top)
    g = jnp.einsum("td,efd->tef", h, p["ffn_gate_exps"])
    u = jnp.einsum("td,efd->tef", h, p["ffn_up_exps"])
    y = jnp.einsum("tef,edf->ted", jax.nn.silu(g) * u, p["ffn_down_exps"])
    return jnp.einsum("ted,te->td", y, gates), probs, gates


def forward(params, tokens, hp):
    """Logits [T, vocab] of one sequence, the residual stream after the last layer, and the
    balance loss."""
    T = tokens.shape[0]
    pos = jnp.arange(T)
    x = params["token_embd"][tokens]
    balance = 0.0
    for p in params["layers"]:
        x = x + attention(p, rms(x, p["attn_norm"]), hp, pos)
        y, probs, gates = moe(p, rms(x, p["ffn_norm"]), hp)
        x = x + y
        # Switch-style: experts' share of rows × their mean probability, times E.
        frac = jnp.mean((gates > 0).astype(jnp.float32), axis=0)
        balance = balance + hp["n_expert"] * jnp.sum(frac * jnp.mean(probs, axis=0))
    logits = rms(x, params["output_norm"]) @ params["output"].T
    return logits, x, balance / len(params["layers"])


def init(hp, seed):
    rng = np.random.default_rng(seed)
    e, f, E = hp["n_embd"], hp["expert_ff"], hp["n_expert"]
    H, K, D = hp["n_head"], hp["n_head_kv"], hp["head_dim"]

    def w(*shape, fan_in=None):
        fan_in = fan_in or shape[-1]
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    layers = []
    for _ in range(hp["n_layer"]):
        layers.append(
            {
                "attn_norm": np.ones(e, np.float32),
                "attn_q": w(H * D, e),
                "attn_k": w(K * D, e),
                "attn_v": w(K * D, e),
                "attn_output": w(e, H * D) / np.sqrt(2 * hp["n_layer"]),
                "attn_q_norm": np.ones(D, np.float32),
                "attn_k_norm": np.ones(D, np.float32),
                "ffn_norm": np.ones(e, np.float32),
                "ffn_gate_inp": w(E, e) * 0.1,
                "ffn_gate_exps": w(E, f, e),
                "ffn_up_exps": w(E, f, e),
                "ffn_down_exps": w(E, e, f) / np.sqrt(2 * hp["n_layer"]),
            }
        )
    return {
        "token_embd": w(hp["n_vocab"], e, fan_in=1) * 0.02,
        "output_norm": np.ones(e, np.float32),
        "output": w(hp["n_vocab"], e),
        "layers": layers,
    }
