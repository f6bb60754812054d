"""A Gemma 3 vision-language benchmark model, for timing images.

    python make_gemma3_vision_bench_model.py MODELS_DIR

Writes MODELS_DIR/gemma3-270m-vl-shaped: the vision tower and projector of Gemma 3 4B (the
published gemma-3-4b-it's SigLIP So400m: 27 blocks of width 1152, 16 heads, MLP 4304, 896 x 896
images in patches of 14, 4096 patches pooled 4 x 4 into 256 tokens) in front of the language
model of Gemma 3 270M's shape (18 layers of width 640, 4 query heads and 1 KV head of 256, MLP
2048, sliding window 512, vocabulary 262144). No published Gemma 3 pairs these; the tower is
what an image costs whatever the language model, and a small language model keeps the file
small (1.4 GB). Seeded random BF16 weights in the published layout (`vision_tower.vision_model.*`,
`multi_modal_projector.*`, `language_model.model.*`); speed does not depend on their values.
The tokenizer, chat template and image processor configuration are the tiny Gemma 3 fixture's
(tests/fixtures/tiny-gemma3-vl-pooled: image tokens at ids 1000..1002; its tokenizer padded with
fillers to the vocabulary's size) with the processor at 896 x 896, as gemma-3-4b-it's. Needs numpy (the fetch script's venv has it).
"""
import json
import os
import shutil
import struct
import sys

import numpy as np

models = sys.argv[1]
out = os.path.join(models, "gemma3-270m-vl-shaped")
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fixture = os.path.join(root, "tests/fixtures/tiny-gemma3-vl-pooled")

V = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896,
         patch_size=14, model_type="siglip_vision_model", vision_use_head=False, layer_norm_eps=1e-6,
         hidden_act="gelu_pytorch_tanh")
T = dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
         num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144, query_pre_attn_scalar=256,
         max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
         layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
         bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True, attn_logit_softcapping=None,
         final_logit_softcapping=None, attention_bias=False)
config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
          "boi_token_index": 1000, "eoi_token_index": 1001, "image_token_index": 1002, "tie_word_embeddings": True,
          "text_config": T, "vision_config": V}

H, I, P, side = V["hidden_size"], V["intermediate_size"], V["patch_size"], V["image_size"] // V["patch_size"]
D, F, hd, L = T["hidden_size"], T["intermediate_size"], T["head_dim"], T["num_hidden_layers"]
q, kv = T["num_attention_heads"] * hd, T["num_key_value_heads"] * hd
shapes = {
    "vision_tower.vision_model.embeddings.patch_embedding.weight": (H, 3, P, P),
    "vision_tower.vision_model.embeddings.patch_embedding.bias": (H,),
    "vision_tower.vision_model.embeddings.position_embedding.weight": (side * side, H),
    "vision_tower.vision_model.post_layernorm.weight": (H,),
    "vision_tower.vision_model.post_layernorm.bias": (H,),
    "multi_modal_projector.mm_soft_emb_norm.weight": (H,),
    "multi_modal_projector.mm_input_projection_weight": (H, D),
}
for b in range(V["num_hidden_layers"]):
    at = f"vision_tower.vision_model.encoder.layers.{b}."
    for role, shape in [("layer_norm1.weight", (H,)), ("layer_norm1.bias", (H,)), ("layer_norm2.weight", (H,)),
                        ("layer_norm2.bias", (H,)), ("mlp.fc1.weight", (I, H)), ("mlp.fc1.bias", (I,)),
                        ("mlp.fc2.weight", (H, I)), ("mlp.fc2.bias", (H,))] + \
                       [(f"self_attn.{p}_proj.{k}", (H, H) if k == "weight" else (H,))
                        for p in ("q", "k", "v", "out") for k in ("weight", "bias")]:
        shapes[at + role] = shape
shapes["language_model.model.embed_tokens.weight"] = (T["vocab_size"], D)
shapes["language_model.model.norm.weight"] = (D,)
for l in range(L):
    at = f"language_model.model.layers.{l}."
    for role, shape in [("input_layernorm.weight", (D,)), ("post_attention_layernorm.weight", (D,)),
                        ("pre_feedforward_layernorm.weight", (D,)), ("post_feedforward_layernorm.weight", (D,)),
                        ("self_attn.q_proj.weight", (q, D)), ("self_attn.k_proj.weight", (kv, D)),
                        ("self_attn.v_proj.weight", (kv, D)), ("self_attn.o_proj.weight", (D, q)),
                        ("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,)),
                        ("mlp.gate_proj.weight", (F, D)), ("mlp.up_proj.weight", (F, D)),
                        ("mlp.down_proj.weight", (D, F))]:
        shapes[at + role] = shape

os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(43)
header, offset = {}, 0
for name, shape in shapes.items():
    n = int(np.prod(shape))
    header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + 2 * n]}
    offset += 2 * n
head = json.dumps(header).encode()
head += b" " * (-len(head) % 8)
with open(os.path.join(out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(head)))
    f.write(head)
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        values = rng.standard_normal(n, dtype=np.float32) * (1.0 / np.sqrt(shape[-1] if len(shape) > 1 else 1.0))
        if "norm" in name and name.endswith("weight") and "layer_norm" not in name and "layernorm" not in name:
            values = 0.1 * values  # Gemma's (1 + w) norms.
        elif "layer_norm" in name or "layernorm" in name:
            values = (1.0 + 0.1 * values) if name.endswith("weight") else 0.1 * values
        u = values.astype(np.float32).view(np.uint32)
        f.write(((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes())
json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=1)
json.dump({"bos_token_id": 2, "eos_token_id": [1, 1004], "pad_token_id": 0},
          open(os.path.join(out, "generation_config.json"), "w"), indent=1)
shutil.copy(os.path.join(fixture, "tokenizer_config.json"), os.path.join(out, "tokenizer_config.json"))
# The fixture's tokenizer covers ids 0..1004; fillers up to the vocabulary's 262144 (each decodes
# as its name) so that whatever the random model generates is text a stream carries.
tokenizer = json.load(open(os.path.join(fixture, "tokenizer.json")))
vocab = tokenizer["model"]["vocab"]
vocab.update({f"<filler_{i}>": i for i in range(1005, T["vocab_size"])})
json.dump(tokenizer, open(os.path.join(out, "tokenizer.json"), "w"), ensure_ascii=False)
pre = json.load(open(os.path.join(fixture, "preprocessor_config.json")))
pre["size"] = {"height": 896, "width": 896}
json.dump(pre, open(os.path.join(out, "preprocessor_config.json"), "w"), indent=1)
print("wrote", out)
