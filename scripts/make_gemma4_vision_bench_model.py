"""A Gemma 4 vision-language benchmark model, for timing images.

    /tmp/tvenv/bin/python scripts/make_gemma4_vision_bench_model.py MODELS_DIR

Writes MODELS_DIR/gemma4-e2b-vl-shaped: the vision tower of gemma-4-E2B (16 blocks of width
768, 12 heads of 64, MLP 3072, patches of 16 pooled 3 x 3, column and row tables of 10240,
clipped linears) and its `embed_vision`, in front of a small Gemma 4 language model (4 layers
of width 1536 as E2B's, 8 query heads and 1 KV head of 256, MLP 6144, sliding window 512, a
vocabulary of 32768, no per-layer inputs). No published Gemma 4 is this: the tower is what an
image costs whatever the language model, and the small language model keeps the file small.
Seeded random weights saved in BF16 by transformers (`Gemma4ForConditionalGeneration`, the
published layout); speed does not depend on their values. The tokenizer and chat template are
the tiny Gemma 4 fixture's (tests/fixtures/tiny-gemma4-vl-bidir: image tokens at ids
1000..1002; the tokenizer padded with fillers to the vocabulary's size), the image processor
gemma-4's defaults (patches of 16, pooling 3, at most 280 soft tokens, bicubic). Needs torch and
transformers 5.24 (the fixtures' venv).
"""
import json
import os
import shutil
import sys

import torch
import transformers as T

models = sys.argv[1]
out = os.path.join(models, "gemma4-e2b-vl-shaped")
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fixture = os.path.join(root, "tests/fixtures/tiny-gemma4-vl-bidir")

vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
              num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
              position_embedding_size=10240, use_clipped_linears=True, standardize=False,
              rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
text = dict(vocab_size=32768, vocab_size_per_layer_input=32768, hidden_size=1536, intermediate_size=6144,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
            hidden_size_per_layer_input=0, sliding_window=512, max_position_embeddings=32768,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], num_kv_shared_layers=0,
            bos_token_id=2, eos_token_id=1, pad_token_id=0)
config = T.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=1000,
                        boi_token_id=1001, eoi_token_id=1002, video_token_id=1005, audio_token_id=1006,
                        boa_token_id=1007, eoa_token_index=1008)
torch.manual_seed(45)
model = T.Gemma4ForConditionalGeneration(config)
with torch.no_grad():
    for name, b in model.named_buffers():
        # Bounds wide enough to clamp only outliers, as the published ones.
        if name.endswith(("input_min", "output_min")):
            b.fill_(-100.0)
        elif name.endswith(("input_max", "output_max")):
            b.fill_(100.0)
shutil.rmtree(out, ignore_errors=True)
model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
json.dump({"bos_token_id": 2, "eos_token_id": [1, 1004], "pad_token_id": 0},
          open(os.path.join(out, "generation_config.json"), "w"), indent=1)
shutil.copy(os.path.join(fixture, "tokenizer_config.json"), os.path.join(out, "tokenizer_config.json"))
tokenizer = json.load(open(os.path.join(fixture, "tokenizer.json")))
vocab = tokenizer["model"]["vocab"]
vocab.update({f"<filler_{i}>": i for i in range(1005, text["vocab_size"])})
json.dump(tokenizer, open(os.path.join(out, "tokenizer.json"), "w"), ensure_ascii=False)
json.dump({"image_processor_type": "Gemma4ImageProcessor", "patch_size": 16, "pooling_kernel_size": 3,
           "max_soft_tokens": 280, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
           "do_normalize": False, "do_convert_rgb": True, "do_resize": True},
          open(os.path.join(out, "preprocessor_config.json"), "w"), indent=1)
print("wrote", out)
