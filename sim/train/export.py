"""Writes a trained model as a GGUF with gguf-py: llama.cpp's tensor names and metadata, the
corpus-trained byte-level BPE vocabulary (`tokenizer.ggml.*`, split as qwen2's), a ChatML chat
template, Q8_0 experts and attention weights, F16 embeddings and head, F32 norms and router.
"""

import json

import gguf
import numpy as np

import vocab

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

Q8 = gguf.GGMLQuantizationType.Q8_0


def _tensor(w, name, arr, qtype=None):
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype is None:
        w.add_tensor(name, arr)
    elif qtype == gguf.GGMLQuantizationType.F16:
        w.add_tensor(name, arr.astype(np.float16))
    else:
        q = gguf.quants.quantize(arr, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)


def write(path, arch, hp, params, tok, report):
    w = gguf.GGUFWriter(path, arch)
    a = arch
    w.add_name(f"fortunes-{arch}")
    w.add_string("general.description", "trained here on fortunes and the Python tutorial: " + json.dumps(report))
    w.add_uint32(f"{a}.block_count", hp["n_layer"])
    w.add_uint32(f"{a}.context_length", 4096)
    w.add_uint32(f"{a}.embedding_length", hp["n_embd"])
    w.add_uint32(f"{a}.feed_forward_length", hp["expert_ff"] * hp["n_expert_used"])
    w.add_uint32(f"{a}.expert_feed_forward_length", hp["expert_ff"])
    w.add_uint32(f"{a}.attention.head_count", hp["n_head"])
    w.add_uint32(f"{a}.attention.head_count_kv", hp["n_head_kv"])
    w.add_uint32(f"{a}.attention.key_length", hp["head_dim"])
    w.add_uint32(f"{a}.attention.value_length", hp["head_dim"])
    w.add_uint32(f"{a}.rope.dimension_count", hp["head_dim"])
    w.add_float32(f"{a}.rope.freq_base", hp["rope_theta"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{a}.expert_count", hp["n_expert"])
    w.add_uint32(f"{a}.expert_used_count", hp["n_expert_used"])
    w.add_uint32("general.file_type", 7)
    tokens, types, merges = vocab.gguf_fields(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_eos_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    _tensor(w, "token_embd.weight", params["token_embd"], gguf.GGMLQuantizationType.F16)
    _tensor(w, "output_norm.weight", params["output_norm"])
    _tensor(w, "output.weight", params["output"], gguf.GGMLQuantizationType.F16)
    for l, p in enumerate(params["layers"]):
        for name, arr in p.items():
            full = f"blk.{l}.{name}.weight"
            big = arr.ndim >= 2 and name != "ffn_gate_inp"
            _tensor(w, full, arr, Q8 if big else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
