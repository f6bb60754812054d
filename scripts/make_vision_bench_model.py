"""The Qwen3.5-0.8B-shaped benchmark model with its vision tower, for timing images.

    python make_vision_bench_model.py MODELS_DIR

MODELS_DIR/qwen3.5-0.8b-shaped (testdata/models/fetch.sh --bench writes it) holds the language
model only. This writes MODELS_DIR/qwen3.5-0.8b-vl-shaped: the same config.json, the text
weights linked from it, the vision tower of Qwen3.5-0.8B's shape (12 blocks of width 768, 12
heads, MLP 3072, patches of 16, merged 2 x 2 into the language model's 1024) as seeded random
BF16 weights in a second shard, Qwen3.5's preprocessor_config.json (patches 16, merge 2, 65536
to 16777216 pixels, mean and std 0.5) and the Qwen3.5 tokenizer (setup.sh builds it) with the
published chat template's shape (tests/fixtures/qwen3.5/chat_template.jinja). Speed does not
depend on the weights' values. Needs numpy (the fetch script's venv has it).
"""
import json
import os
import struct
import sys

import numpy as np

models = sys.argv[1]
text = os.path.join(models, "qwen3.5-0.8b-shaped")
out = os.path.join(models, "qwen3.5-0.8b-vl-shaped")
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
config = json.load(open(os.path.join(text, "config.json")))
v = config["vision_config"]
H, I, P, T, M, OUT = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["temporal_patch_size"], \
    v["spatial_merge_size"], v["out_hidden_size"]
W = H * M * M
shapes = {"patch_embed.proj.weight": (H, 3, T, P, P), "patch_embed.proj.bias": (H,),
          "pos_embed.weight": (v["num_position_embeddings"], H), "merger.norm.weight": (H,), "merger.norm.bias": (H,),
          "merger.linear_fc1.weight": (W, W), "merger.linear_fc1.bias": (W,),
          "merger.linear_fc2.weight": (OUT, W), "merger.linear_fc2.bias": (OUT,)}
for b in range(v["depth"]):
    for role, shape in [("norm1.weight", (H,)), ("norm1.bias", (H,)), ("norm2.weight", (H,)), ("norm2.bias", (H,)),
                        ("attn.qkv.weight", (3 * H, H)), ("attn.qkv.bias", (3 * H,)), ("attn.proj.weight", (H, H)),
                        ("attn.proj.bias", (H,)), ("mlp.linear_fc1.weight", (I, H)), ("mlp.linear_fc1.bias", (I,)),
                        ("mlp.linear_fc2.weight", (H, I)), ("mlp.linear_fc2.bias", (H,))]:
        shapes[f"blocks.{b}.{role}"] = shape

rng = np.random.default_rng(35)
header, blobs, offset = {}, [], 0
for role, shape in shapes.items():
    n = int(np.prod(shape))
    values = rng.standard_normal(n, dtype=np.float32) * (1.0 / np.sqrt(shape[-1] if len(shape) > 1 else 1.0))
    if role.endswith("norm1.weight") or role.endswith("norm2.weight") or role.endswith("norm.weight"):
        values = 1.0 + 0.1 * values
    u = values.astype(np.float32).view(np.uint32)
    blob = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
    header["model.visual." + role] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
    blobs.append(blob)
    offset += len(blob)
os.makedirs(out, exist_ok=True)
encoded = json.dumps(header).encode()
encoded += b" " * (-len(encoded) % 8)
with open(os.path.join(out, "model-vision.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(encoded)) + encoded)
    for blob in blobs:
        f.write(blob)

# The text shard is the language model's own file, linked; the index names both.
link = os.path.join(out, "model-text.safetensors")
if os.path.lexists(link):
    os.remove(link)
os.symlink(os.path.join(text, "model.safetensors"), link)
with open(os.path.join(text, "model.safetensors"), "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    text_names = [k for k in json.loads(f.read(n)) if k != "__metadata__"]
weight_map = {k: "model-text.safetensors" for k in text_names}
weight_map.update({k: "model-vision.safetensors" for k in header})
json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(out, "model.safetensors.index.json"), "w"))
json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=2)
for name in ["generation_config.json"]:
    json.dump(json.load(open(os.path.join(text, name))), open(os.path.join(out, name), "w"), indent=2)
json.dump({"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": P, "temporal_patch_size": T,
           "merge_size": M, "size": {"shortest_edge": 65536, "longest_edge": 16777216},
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
          open(os.path.join(out, "preprocessor_config.json"), "w"), indent=2)
tokenizer = os.path.join(models, "qwen3.5-tokenizer")
tok_config = json.load(open(os.path.join(tokenizer, "tokenizer_config.json")))
tok_config["chat_template"] = open(os.path.join(root, "tests/fixtures/qwen3.5/chat_template.jinja")).read()
json.dump(tok_config, open(os.path.join(out, "tokenizer_config.json"), "w"), indent=1)
link = os.path.join(out, "tokenizer.json")
if os.path.lexists(link):
    os.remove(link)
os.symlink(os.path.join(tokenizer, "tokenizer.json"), link)
print("wrote", out, f"({offset / 1e6:.0f} MB of vision weights)")
