#!/usr/bin/env python3
"""Writes the split reference models in data/split/ with gguf-py (llama.cpp's own GGUF writer).

Reads a GGUF and writes it again as llama.cpp's gguf-split would: parts named
NAME-0000i-of-0000n.gguf carrying split.no / split.count / split.tensors.count, the model's
metadata in the first. Run from node/testkit (pinned: pip install gguf==0.19.0):

    python3 scripts/split_reference.py
"""
import os
import sys

import gguf
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data")


def copy(src_path, out_path, **split):
    r = gguf.GGUFReader(src_path)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out_path, arch, **split)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        data = np.asarray(t.data)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    out = os.path.join(DATA, "split")
    os.makedirs(out, exist_ok=True)
    src = os.path.join(DATA, "tiny-f32.gguf")
    # Three parts of at most 12 tensors each, two parts by size, and a part of another model.
    copy(src, os.path.join(out, "tiny-f32-by-count.gguf"), split_max_tensors=12)
    copy(src, os.path.join(out, "tiny-f32-by-size.gguf"), split_max_size=400_000)
    other = os.path.join(DATA, "qwen35moe", "tiny-f32.gguf")
    n_other = len(gguf.GGUFReader(other).tensors)
    copy(other, os.path.join(out, "other-by-count.gguf"), split_max_tensors=-(-n_other // 3))
    for name in sorted(os.listdir(out)):
        print(name, os.path.getsize(os.path.join(out, name)))


if __name__ == "__main__":
    sys.exit(main())
