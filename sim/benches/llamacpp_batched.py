"""llama.cpp's aggregate decode speed with several sequences decoded in one batch per step.

The reference for `cargo bench -p moeswarm-sim --bench batching`: the same GGUF, the same
threads, N sequences each prefilled with a short prompt of its own and then decoded TOKENS
tokens, one token per sequence per `llama_decode` (as llama.cpp's server batches them). Tokens
per second count the generated tokens over the whole run (prefill included), as the moeswarm
side does. Token ids are pseudo-random and distinct per sequence (no sampling cost); on the
synthetic benchmark models routing does not depend on them in any way that matters.
Prints one JSON object: {"sequences": [1, 4, 16], "tps": [...], "llama_cpp_python": "..."}.

    python3 llamacpp_batched.py MODEL.gguf THREADS TOKENS N [N ...]
"""

import json
import sys
import time

import llama_cpp

PROMPT = 5


def main():
    path, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    counts = [int(n) for n in sys.argv[4:]]
    most = max(counts)
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    if not model:
        sys.exit(f"llama.cpp could not load {path}")
    cp = llama_cpp.llama_context_default_params()
    cp.n_seq_max = most
    cp.n_ctx = most * 128
    cp.n_batch = cp.n_ubatch = max(most * PROMPT, 32)
    cp.n_threads = cp.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cp)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(cp.n_batch, 0, most)

    def decode(entries):
        batch.n_tokens = 0
        for tok, pos, seq, logits in entries:
            i = batch.n_tokens
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
            batch.n_tokens += 1
        if llama_cpp.llama_decode(ctx, batch) != 0:
            sys.exit("llama_decode failed")

    def run(n):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        t = time.perf_counter()
        # Logits only where a token is sampled: each prompt's last position.
        decode([
            ((s * 7919 + p * 31 + 11) % vocab, p, s, int(p == PROMPT - 1))
            for s in range(n)
            for p in range(PROMPT)
        ])
        for step in range(tokens):
            pos = PROMPT + step
            decode([((s * 104729 + step * 613 + 5) % vocab, pos, s, 1) for s in range(n)])
        return n * tokens / (time.perf_counter() - t)

    run(min(counts))  # warm-up
    tps = [run(n) for n in counts]
    print(json.dumps({
        "sequences": counts,
        "tps": tps,
        "llama_cpp_python": llama_cpp.__version__,
    }))


if __name__ == "__main__":
    main()
