"""qwen35moe's forward pass in JAX, as llama.cpp and the engine compute it
(`node/testkit/data/qwen35moe/README.md` is the definition followed): Gated DeltaNet layers
(causal convolution, L2-normed q/k, the delta rule with a decaying state per value head, a
gated RMSNorm), gated full-attention layers (per-head q/k norms, partial NeoX RoPE, a sigmoid
gate interleaved with the queries), and after every mixer the softmax top-k routed experts
plus a shared expert scaled by a sigmoid gate.

One MTP block (`nextn_predict_layers = 1`, the last block of the file) predicts the token after
next, as DeepSeek-V3 and Qwen3-Next define it: `eh_proj` over `[enorm(embedding of the next
token); hnorm(the last layer's residual stream)]`, one full-attention block with its own MoE and
shared expert, `shared_head_norm`, and the model's output head. Weights are in the shapes
gguf-py writes (out × in).
"""

import jax
import jax.numpy as jnp
import numpy as np

from qwen3moe import EPS, masked_attention, moe, rms, rope_neox


def silu(x):
    return x * jax.nn.sigmoid(x)


def is_recurrent(hp, l):
    """Layer `l` is a DeltaNet layer unless it closes a group of `full_attention_interval`."""
    return (l + 1) % hp["full_attention_interval"] != 0


def l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + EPS)


def deltanet(p, h, hp):
    T = h.shape[0]
    S, Hk, Hv, Kc = hp["ssm_state"], hp["ssm_groups"], hp["ssm_heads"], hp["conv_kernel"]
    C = 2 * Hk * S + Hv * S
    m = h @ p["attn_qkv"].T
    z = (h @ p["attn_gate"].T).reshape(T, Hv, S)
    beta = jax.nn.sigmoid(h @ p["ssm_beta"].T)
    g = p["ssm_a"] * jax.nn.softplus(h @ p["ssm_alpha"].T + p["ssm_dt.bias"])
    # Causal depthwise convolution; ssm_conv1d is [C][Kc], the last tap for the current token.
    mp = jnp.concatenate([jnp.zeros((Kc - 1, C), m.dtype), m], axis=0)
    c = sum(mp[i : i + T] * p["ssm_conv1d"][:, i] for i in range(Kc))
    u = silu(c)
    q = l2norm(u[:, : Hk * S].reshape(T, Hk, S))
    k = l2norm(u[:, Hk * S : 2 * Hk * S].reshape(T, Hk, S))
    v = u[:, 2 * Hk * S :].reshape(T, Hv, S)
    # Value head h reads q/k head h mod Hk (tiled).
    q, k = jnp.tile(q, (1, Hv // Hk, 1)), jnp.tile(k, (1, Hv // Hk, 1))
    o = delta_rule_chunked(q / jnp.sqrt(S), k, v, beta, g)
    y = rms(o, p["ssm_norm"]) * silu(z)
    return y.reshape(T, Hv * S) @ p["ssm_out"].T


def delta_rule_chunked(q, k, v, beta, g, chunk=32):
    """The gated delta rule over all tokens, `[T, heads, S]` each (beta, g `[T, heads]`), in
    chunks: within a chunk the rule is solved as one triangular system, across chunks the state
    carries over. The same outputs as the recurrence, token after token (state `M`, zero at
    first, M ← exp(g)·M; δ = β·(v − M·k); M ← M + δ ⊗ k; o = M·q), with matrix products
    instead of a step per token.
    """
    T, H, S = v.shape
    n = -(-T // chunk)
    pad = n * chunk - T

    def chunks(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return jnp.moveaxis(x.reshape(n, chunk, *x.shape[1:]), 2, 1)  # [n, H, chunk, ...]

    q, k, v, beta, g = map(chunks, (q, k, v, beta, g))
    g = jnp.cumsum(g, axis=-1)  # log decay from the chunk's start to each token
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, g[..., :, None] - g[..., None, :], 0.0)), 0.0)
    kb = k * beta[..., None]
    # (I + strictly lower(diag(β) K Kᵀ ⊙ decay))⁻¹ turns the chunk's writes into independent ones.
    a = jnp.where(lower & ~jnp.eye(chunk, dtype=bool), (kb @ jnp.swapaxes(k, -1, -2)) * decay, 0.0)
    eye = jnp.broadcast_to(jnp.eye(chunk, dtype=v.dtype), a.shape)
    t = jax.scipy.linalg.solve_triangular(eye + a, eye, lower=True)
    u = t @ (v * beta[..., None])
    w = t @ (kb * jnp.exp(g)[..., None])
    qk = jnp.where(lower, (q @ jnp.swapaxes(k, -1, -2)) * decay, 0.0)

    def step(m, x):  # m: [H, S(value), S(key)]
        q, k, u, w, qk, g = x
        fresh = u - jnp.einsum("hcj,hij->hci", w, m)  # the writes the state did not predict
        o = jnp.einsum("hcj,hij->hci", q * jnp.exp(g)[..., None], m) + qk @ fresh
        last = g[:, -1]
        carried = jnp.exp(last[:, None] - g)[..., None] * k  # [H, c, S]
        m = m * jnp.exp(last)[:, None, None] + jnp.einsum("hci,hcj->hij", fresh, carried)
        return m, o

    _, o = jax.lax.scan(step, jnp.zeros((H, S, S), v.dtype), (q, k, u, w, qk, g))
    return jnp.moveaxis(o, 1, 2).reshape(n * chunk, H, S)[:T]


def gated_attention(p, h, hp, pos, context=None):
    """Causal gated attention over `h`; with `context = (h_kv, pos_kv, allowed)`, the queries
    of `h` attend instead to the keys and values of `h_kv` that `allowed` lets them."""
    T = h.shape[0]
    H, K, D, R = hp["n_head"], hp["n_head_kv"], hp["head_dim"], hp["rope_dims"]
    h_kv, pos_kv, allowed = context or (h, pos, jnp.tril(jnp.ones((T, T), bool)))
    r = (h @ p["attn_q"].T).reshape(T, H, 2, D)
    q, gate = r[:, :, 0], r[:, :, 1]
    k = (h_kv @ p["attn_k"].T).reshape(h_kv.shape[0], K, D)
    v = (h_kv @ p["attn_v"].T).reshape(h_kv.shape[0], K, D)
    q = rope_neox(rms(q, p["attn_q_norm"]), pos, hp["rope_theta"], R)
    k = rope_neox(rms(k, p["attn_k_norm"]), pos_kv, hp["rope_theta"], R)
    o = masked_attention(q, k, v, allowed) * jax.nn.sigmoid(gate)
    return o.reshape(T, H * D) @ p["attn_output"].T


def ffn(p, h2, hp):
    """Routed experts plus the gated shared expert; the balance term of the router."""
    y, probs, gates = moe(p, h2, hp)
    shared = (silu(h2 @ p["ffn_gate_shexp"].T) * (h2 @ p["ffn_up_shexp"].T)) @ p["ffn_down_shexp"].T
    y = y + jax.nn.sigmoid(h2 @ p["ffn_gate_inp_shexp"])[:, None] * shared
    frac = jnp.mean((gates > 0).astype(jnp.float32), axis=0)
    return y, hp["n_expert"] * jnp.sum(frac * jnp.mean(probs, axis=0))


def block(p, x, hp, pos, recurrent):
    h = rms(x, p["attn_norm"])
    x = x + (deltanet(p, h, hp) if recurrent else gated_attention(p, h, hp, pos))
    y, balance = ffn(p, rms(x, p["post_attention_norm"]), hp)
    return x + y, balance


def forward(params, tokens, hp):
    """Logits [T, vocab] of the main model, the residual stream after its last layer, and the
    balance loss."""
    pos = jnp.arange(tokens.shape[0])
    x = params["token_embd"][tokens]
    balance = 0.0
    for l, p in enumerate(params["layers"]):
        x, b = block(p, x, hp, pos, is_recurrent(hp, l))
        balance = balance + b
    logits = rms(x, params["output_norm"]) @ params["output"].T
    return logits, x, balance / len(params["layers"])


def mtp(params, hidden, next_tokens, hp):
    """The MTP block's logits for the token after next: row t combines the main model's
    residual stream at t with the embedding of token t + 1."""
    p = params["mtp"]
    pos = jnp.arange(hidden.shape[0])
    x, balance = block(p, mtp_input(params, hidden, next_tokens), hp, pos, recurrent=False)
    return mtp_head(params, x), balance


def mtp_input(params, hidden, next_tokens):
    """The MTP block's input rows: `eh_proj` over the normed embeddings of `next_tokens` and
    the normed streams `hidden`."""
    p = params["mtp"]
    e = rms(params["token_embd"][next_tokens], p["nextn.enorm"])
    return jnp.concatenate([e, rms(hidden, p["nextn.hnorm"])], axis=-1) @ p["nextn.eh_proj"].T


def mtp_head(params, x):
    """The logits of the MTP block's output stream `x`."""
    return rms(x, params["mtp"]["nextn.shared_head_norm"]) @ params["output"].T


def init(hp, seed):
    rng = np.random.default_rng(seed)
    e, f, E, fs = hp["n_embd"], hp["expert_ff"], hp["n_expert"], hp["shared_ff"]
    H, K, D = hp["n_head"], hp["n_head_kv"], hp["head_dim"]
    S, Hk, Hv, Kc = hp["ssm_state"], hp["ssm_groups"], hp["ssm_heads"], hp["conv_kernel"]
    C = 2 * Hk * S + Hv * S
    depth = 2 * (hp["n_layer"] + 1)

    def w(*shape, fan_in=None):
        fan_in = fan_in or shape[-1]
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    def ones(n):
        return np.ones(n, np.float32)

    def ffn_params():
        return {
            "post_attention_norm": ones(e),
            "ffn_gate_inp": w(E, e) * 0.1,
            "ffn_gate_exps": w(E, f, e),
            "ffn_up_exps": w(E, f, e),
            "ffn_down_exps": w(E, e, f) / np.sqrt(depth),
            "ffn_gate_inp_shexp": w(e),
            "ffn_gate_shexp": w(fs, e),
            "ffn_up_shexp": w(fs, e),
            "ffn_down_shexp": w(e, fs) / np.sqrt(depth),
        }

    def attention_params():
        return {
            "attn_norm": ones(e),
            "attn_q": w(2 * H * D, e),
            "attn_k": w(K * D, e),
            "attn_v": w(K * D, e),
            "attn_output": w(e, H * D) / np.sqrt(depth),
            "attn_q_norm": ones(D),
            "attn_k_norm": ones(D),
        }

    def deltanet_params():
        return {
            "attn_norm": ones(e),
            "attn_qkv": w(C, e),
            "attn_gate": w(Hv * S, e),
            "ssm_conv1d": w(C, Kc) * 0.5,
            "ssm_beta": w(Hv, e),
            "ssm_alpha": w(Hv, e),
            "ssm_dt.bias": ones(Hv),
            # Stored negative, as the converter writes -exp(A_log); decay rates spread out.
            "ssm_a": -np.exp(rng.uniform(np.log(0.05), np.log(1.0), Hv)).astype(np.float32),
            "ssm_norm": ones(S),
            "ssm_out": w(e, Hv * S) / np.sqrt(depth),
        }

    layers = []
    for l in range(hp["n_layer"]):
        mixer = deltanet_params() if is_recurrent(hp, l) else attention_params()
        layers.append({**mixer, **ffn_params()})
    mtp_block = {
        "nextn.enorm": ones(e),
        "nextn.hnorm": ones(e),
        "nextn.eh_proj": w(e, 2 * e),
        "nextn.shared_head_norm": ones(e),
        **attention_params(),
        **ffn_params(),
    }
    return {
        "token_embd": w(hp["n_vocab"], e, fan_in=1) * 0.02,
        "output_norm": ones(e),
        "output": w(hp["n_vocab"], e),
        "layers": layers,
        "mtp": mtp_block,
    }
