#!/usr/bin/env python3
"""Makes the quantized copies of the Qwen3-0.6B-shaped benchmark model (compressed-tensors, by
llm-compressor, data-free).

From a Hugging Face model directory (default /root/.cache/kylin-models/qwen3-0.6b-shaped: the
Qwen3-0.6B-shaped random BF16 model) this writes, next to it under OUT_ROOT (default
/root/.cache/kylin-models):

- `<name>-w8a8`:  scheme W8A8 (int-quantized: int8 weights, per-channel `weight_scale`;
  dynamic per-token int8 activations);
- `<name>-w4a16`: scheme W4A16 (pack-quantized: 4-bit weights packed eight to an int32
  `weight_packed`, group-128 `weight_scale`, `weight_shape`).

`<name>` is the source directory's name. Quantization is llm-compressor's `QuantizationModifier`
run through `oneshot` without a data set (round to nearest, no calibration), on every `Linear`
except `lm_head`, which stays BF16 as in the published RedHatAI checkpoints; the embedding and the
norms stay BF16 too. Each output is a complete model directory: `config.json` (with its
`quantization_config`), `model.safetensors`, the tokenizer files (`tokenizer.json`,
`tokenizer_config.json`) and `generation_config.json`; any of these that `save_pretrained` did not
write is copied from the source. Each output is built in a temporary `.tmp` sibling and renamed
into place at the end, replacing an older copy. save_pretrained also writes `recipe.yaml` (the
llm-compressor recipe) and, with transformers 5, `chat_template.jinja` (the chat template moved
out of `tokenizer_config.json`). The source's embeddings are tied (`tie_word_embeddings: true`),
so the output keeps a single BF16 `model.embed_tokens.weight` and no `lm_head.weight`.

The model is loaded in bfloat16 on the CPU; both schemes take about a minute on 2 cores and peak
at about 5.5 GB of memory for this model. Run with a Python that has torch, transformers, compressed-tensors and llmcompressor:

    python scripts/make_bench_quantized.py [SRC_DIR [OUT_ROOT]] [--schemes W8A8,W4A16]

Any llm-compressor preset scheme works with `--schemes` (BENCHMARKS.md also uses `FP8_BLOCK`,
written to `<name>-fp8-block`, and runs the script on qwen2.5-coder-0.5b-instruct for the
accuracy figures on real text).
"""

import argparse
import gc
import shutil
import time
from pathlib import Path

import torch

DEFAULT_SRC = Path("/root/.cache/kylin-models/qwen3-0.6b-shaped")
DEFAULT_OUT_ROOT = Path("/root/.cache/kylin-models")
SCHEMES = ("W8A8", "W4A16")
# Files a complete output directory must have; copied from the source when save_pretrained
# (of the model or the tokenizer) did not write them.
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json")
OPTIONAL = ("special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def quantize(src, out, scheme, tok):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.time()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, low_cpu_mem_usage=True)
    model.eval()
    oneshot(model=model, tokenizer=tok,
            recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
    model.save_pretrained(tmp, save_compressed=True)
    tok.save_pretrained(tmp)
    del model
    gc.collect()

    for name in REQUIRED + OPTIONAL:
        if not (tmp / name).exists() and (src / name).exists():
            shutil.copy2(src / name, tmp / name)
            print(f"{out.name}: copied {name} from the source")
    missing = [name for name in REQUIRED if not (tmp / name).exists()]
    if missing:
        raise SystemExit(f"{out.name}: incomplete output, missing {missing}")

    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"{out.name}: written in {time.time() - start:.1f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", nargs="?", type=Path, default=DEFAULT_SRC, help="source model directory")
    parser.add_argument("out_root", nargs="?", type=Path, default=DEFAULT_OUT_ROOT, help="where the copies go")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated llm-compressor schemes")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    src = args.src.resolve()
    args.out_root.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    for scheme in [s.strip() for s in args.schemes.split(",") if s.strip()]:
        quantize(src, args.out_root / f"{src.name}-{scheme.lower().replace('_', '-')}", scheme, tok)


if __name__ == "__main__":
    main()
