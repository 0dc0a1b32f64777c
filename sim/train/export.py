"""Writes a trained model as a GGUF with gguf-py: llama.cpp's tensor names and metadata, the
corpus-trained byte-level BPE vocabulary (`tokenizer.ggml.*`, split as qwen2's), a ChatML chat
template, Q8_0 experts and projections, F16 embeddings and head, F32 norms, router, gates and
DeltaNet convolution. qwen35moe's MTP block is written as the last block
(`nextn_predict_layers = 1`).
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
# Kept in f32 though 2-D: the router (llama.cpp keeps it so) and the convolution (always f32).
KEPT_F32 = {"ffn_gate_inp", "ssm_conv1d"}


def gguf_name(l, name):
    """The GGUF tensor name of block `l`'s parameter `name`."""
    if name in ("ssm_a", "ssm_dt.bias"):
        return f"blk.{l}.{name}"
    return f"blk.{l}.{name}.weight"


def _qwen35_metadata(w, hp):
    a = "qwen35moe"
    w.add_uint32(f"{a}.nextn_predict_layers", 1)
    w.add_uint32(f"{a}.full_attention_interval", hp["full_attention_interval"])
    w.add_array(f"{a}.rope.dimension_sections", hp["rope_sections"])
    w.add_uint32(f"{a}.ssm.state_size", hp["ssm_state"])
    w.add_uint32(f"{a}.ssm.group_count", hp["ssm_groups"])
    w.add_uint32(f"{a}.ssm.time_step_rank", hp["ssm_heads"])
    w.add_uint32(f"{a}.ssm.inner_size", hp["ssm_heads"] * hp["ssm_state"])
    w.add_uint32(f"{a}.ssm.conv_kernel", hp["conv_kernel"])
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", hp["shared_ff"])


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
    w.add_uint32(f"{a}.block_count", hp["n_layer"] + ("mtp" in params))
    w.add_uint32(f"{a}.context_length", 4096)
    w.add_uint32(f"{a}.embedding_length", hp["n_embd"])
    w.add_uint32(f"{a}.feed_forward_length", hp["expert_ff"] * hp["n_expert_used"])
    w.add_uint32(f"{a}.expert_feed_forward_length", hp["expert_ff"])
    w.add_uint32(f"{a}.attention.head_count", hp["n_head"])
    w.add_uint32(f"{a}.attention.head_count_kv", hp["n_head_kv"])
    w.add_uint32(f"{a}.attention.key_length", hp["head_dim"])
    w.add_uint32(f"{a}.attention.value_length", hp["head_dim"])
    w.add_uint32(f"{a}.rope.dimension_count", hp.get("rope_dims", hp["head_dim"]))
    w.add_float32(f"{a}.rope.freq_base", hp["rope_theta"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{a}.expert_count", hp["n_expert"])
    w.add_uint32(f"{a}.expert_used_count", hp["n_expert_used"])
    w.add_uint32("general.file_type", 7)
    if arch == "qwen35moe":
        _qwen35_metadata(w, hp)
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
    blocks = list(params["layers"]) + ([params["mtp"]] if "mtp" in params else [])
    for l, p in enumerate(blocks):
        for name, arr in p.items():
            _tensor(w, gguf_name(l, name), arr, Q8 if name not in KEPT_F32 and arr.ndim >= 2 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
