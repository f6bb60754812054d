"""Write a GGUF twin of one of the real models' Hugging Face directories: the same BF16 weights,
as BF16 or as Q8_0 (gguf-py's Q8_0, llama.cpp's `quantize_row_q8_0_ref` numbers).

The real models' directories are made by testdata/models/gguf_to_hf.py from a published GGUF;
this reverses it for the weights (names, llama's Q/K row order) and copies every metadata key,
tokenizer included, from that published GGUF. llama.cpp then runs exactly the weights Kylin
runs, which the published Q4_K_M / Q4_1 files are not (the directory was dequantized from them).
Q4_K_M is made from the BF16 twin by llama.cpp's own quantizer (scripts/make_gguf_twins.sh).

Usage: python hf_to_gguf.py HF_DIR SOURCE.gguf OUT.gguf bf16|q8_0
Needs numpy and gguf (the fetch script's venv, $KYLIN_MODELS/.venv, has both).
"""
import json
import re
import struct
import sys

import gguf
import numpy as np
from gguf import GGUFReader, GGUFValueType

hf_dir, source, out, mode = sys.argv[1:5]
if mode not in ("bf16", "q8_0"):
    sys.exit(f"unknown type {mode!r}: bf16 or q8_0")
reader = GGUFReader(source)
arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
file_type = gguf.LlamaFileType.MOSTLY_BF16 if mode == "bf16" else gguf.LlamaFileType.MOSTLY_Q8_0
writer = gguf.GGUFWriter(out, arch)
for field in reader.fields.values():
    if field.name.startswith("GGUF.") or field.name == "general.architecture":
        continue  # the writer adds these itself
    value_type = field.types[0]
    sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
    value = int(file_type) if field.name == "general.file_type" else field.contents()
    writer.add_key_value(field.name, value, value_type, sub_type=sub_type)


def head_count(key):
    return int(reader.fields[f"{arch}.attention.{key}"].parts[-1][0])


raw = open(f"{hf_dir}/model.safetensors", "rb").read()
header_len = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8 : 8 + header_len])
names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
layer_names = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
for key, meta in sorted(header.items()):
    if key == "__metadata__":
        continue
    if meta["dtype"] != "BF16":
        sys.exit(f"{key} is {meta['dtype']}; this script reads BF16 directories")
    start, end = meta["data_offsets"]
    bits = np.frombuffer(raw[8 + header_len + start : 8 + header_len + end], dtype=np.uint16).reshape(meta["shape"])
    if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
        # llama.cpp's convert_hf_to_gguf permute(): rows of each head from rotate-half order to pairs.
        n_head = head_count("head_count" if "q_proj" in key else "head_count_kv")
        bits = bits.reshape(n_head, 2, bits.shape[0] // n_head // 2, bits.shape[1]).swapaxes(1, 2).reshape(bits.shape)
    f32 = (bits.astype(np.uint32) << 16).view(np.float32)
    layer = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", key)
    name = f"blk.{layer[1]}.{layer_names[layer[2]]}.{layer[3]}" if layer else names[key]
    if f32.ndim == 1:
        writer.add_tensor(name, f32)  # norms and biases stay F32, as llama.cpp's converter keeps them
    elif mode == "bf16":
        writer.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        q8 = gguf.quants.quantize(f32, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
print("wrote", out)
