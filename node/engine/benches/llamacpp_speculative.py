"""llama.cpp's greedy generation speed on a GGUF without drafts and with its own prompt-lookup
drafts (llama-cpp-python's `LlamaPromptLookupDecoding`, the speculative decoding its Python API
has; it does not run a model's MTP block). Prints one JSON object; where llama.cpp cannot roll
back the rejected drafts (a hybrid model's recurrent state), the error instead.

Used by `cargo bench -p moeswarm-engine --bench speculation`:

    python3 llamacpp_speculative.py MODEL.gguf THREADS TOKENS DRAFT PROMPT...
"""

import json
import sys
import time

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def tokens_per_s(llm, prompts, n):
    """Tokens a second over greedy completions of `prompts` (after one warm-up), and the text."""
    llm.create_completion(prompts[0], max_tokens=n, temperature=0.0, top_k=1)
    made, secs, texts = 0, 0.0, []
    for p in prompts:
        t = time.perf_counter()
        out = llm.create_completion(p, max_tokens=n, temperature=0.0, top_k=1)
        secs += time.perf_counter() - t
        made += out["usage"]["completion_tokens"]
        texts.append(out["choices"][0]["text"])
    return made / secs, texts


def main():
    path, threads, n, draft, *prompts = sys.argv[1:]
    threads, n, draft = int(threads), int(n), int(draft)

    def model(**kw):
        return llama_cpp.Llama(
            model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512,
            verbose=False, seed=0, **kw,
        )

    plain, plain_text = tokens_per_s(model(), prompts, n)
    out = {"plain_tps": plain, "llama_cpp_python": llama_cpp.__version__}
    lookup = LlamaPromptLookupDecoding(num_pred_tokens=draft, max_ngram_size=3)
    try:
        drafted, drafted_text = tokens_per_s(model(draft_model=lookup), prompts, n)
        out |= {"prompt_lookup_tps": drafted, "same_text": plain_text == drafted_text}
    except RuntimeError as e:
        # A hybrid model's recurrent state cannot drop the rejected drafts' positions there.
        out["prompt_lookup_error"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
