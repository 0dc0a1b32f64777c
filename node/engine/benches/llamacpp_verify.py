"""llama.cpp's time for one pass over 1-5 positions of one sequence from the same position,
as a verification pass of speculative decoding runs: the reference for
`cargo bench -p moeswarm-engine --bench speculation` on the same file and threads. Prints
one JSON object: the best time of `REPS` for each count of positions, in seconds.

    python3 llamacpp_verify.py MODEL.gguf THREADS REPS
"""

import json
import sys
import time

import llama_cpp


def main():
    path, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = llama_cpp.Llama(
        model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=256,
        n_batch=64, n_ubatch=64, verbose=False,
    )
    vocab = llm.n_vocab()
    prompt = [(i * 37 + 11) % vocab for i in range(64)]
    llm.eval(prompt)
    best = {}
    for rows in range(1, 6):
        tokens = [(i * 101 + 7) % vocab for i in range(rows)]
        times = []
        for _ in range(reps + 1):
            llm.n_tokens = len(prompt)  # the next eval drops what came after the prompt
            t = time.perf_counter()
            llm.eval(tokens)
            times.append(time.perf_counter() - t)
        best[rows] = min(times[1:])
    print(json.dumps({"seconds": best, "llama_cpp_python": llama_cpp.__version__}))


if __name__ == "__main__":
    main()
