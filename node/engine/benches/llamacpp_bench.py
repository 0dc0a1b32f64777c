"""llama.cpp's prompt-processing and generation speed on a GGUF, measured like `moeswarm bench`.

Used by `cargo bench -p moeswarm-engine --bench engine_vs_llamacpp`; llama.cpp comes from the
`llama-cpp-python` package (`pip install llama-cpp-python`). Prints one JSON object.

    python3 llamacpp_bench.py MODEL.gguf THREADS PROMPT GENERATE REPETITIONS
"""

import json
import statistics
import sys
import time

import llama_cpp


def main():
    path, threads, p, n, reps = sys.argv[1], *map(int, sys.argv[2:6])
    llm = llama_cpp.Llama(
        model_path=path,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=max(512, p + n + 8),
        n_batch=max(p, 32),
        n_ubatch=max(p, 32),
        verbose=False,
    )
    vocab = llm.n_vocab()
    prompt = [(i * 37 + 11) % vocab for i in range(p)]

    def run():
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        pp = time.perf_counter() - t
        nxt = prompt[-1]
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([nxt])
            nxt = (nxt * 7 + 3) % vocab
        return pp, time.perf_counter() - t

    run()  # warm-up
    pps, tgs = [], []
    for _ in range(reps):
        pp, tg = run()
        pps.append(p / pp)
        tgs.append(n / tg)
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0
    print(json.dumps({
        "pp_tps": statistics.mean(pps), "pp_sd": sd(pps),
        "tg_tps": statistics.mean(tgs), "tg_sd": sd(tgs),
        "llama_cpp_python": llama_cpp.__version__,
    }))


if __name__ == "__main__":
    main()
