#!/usr/bin/env python3
"""A vision tower's time per image, Kylin beside llama.cpp's `llama-mtmd-cli`, alternating.

Kylin: `kylin run MODEL --image IMAGE -p TEXT --json` (`timings.encode_ms`, the engine's own
count of the encoding). llama.cpp: `llama-mtmd-cli -m TEXT_GGUF --mmproj MMPROJ --image IMAGE`
("mtmd batch encoding done in N ms") on the same weights converted by llama.cpp's
`convert_hf_to_gguf.py` (`--mmproj` for the tower). Both with the same threads; each row is
one run, Kylin and every projector file taking turns. Give both engines the same number of
image tokens (llama.cpp keeps an image near its own size within its pixel range, where
transformers' Gemma 4 processor fills its budget of soft tokens: pass
`--mm-processor-kwargs '{"max_soft_tokens": 140}'` to match a 640 x 488 photograph's 130).

Usage:
  python3 scripts/bench_tower_vs_llamacpp.py MODEL IMAGE --llama-mtmd-cli PATH \
      --text-gguf FILE --mmproj FILE [--mmproj FILE ...] [--mm-processor-kwargs JSON] \
      [--threads 2] [--repetitions 2] [--chat-template chatml]
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kylin_once(args):
    cmd = [str(args.kylin), "run", str(args.model), "--image", str(args.image), "-p", args.prompt,
           "--max-tokens", "4", "--ignore-eos", "--json", "--threads", str(args.threads)]
    if args.mm_processor_kwargs:
        cmd += ["--mm-processor-kwargs", args.mm_processor_kwargs]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    return r["image_tokens"], r["timings"]["encode_ms"]


def llama_once(args, mmproj):
    cmd = [str(args.llama_mtmd_cli), "-m", str(args.text_gguf), "--mmproj", str(mmproj), "--image",
           str(args.image), "-p", args.prompt, "-n", "4", "-t", str(args.threads), "--temp", "0", "-v"]
    cmd += ["--chat-template", args.chat_template] if args.chat_template else ["--jinja"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    ms = re.search(r"mtmd batch encoding done in (\d+) ms", log)
    tokens = re.search(r"encoding batch with 1 entries and total (\d+) tokens", log)
    if not ms:
        sys.exit(f"no encoding time in llama-mtmd-cli's output:\n{log[-2000:]}")
    return int(tokens.group(1)) if tokens else None, float(ms.group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("image", type=Path)
    p.add_argument("--llama-mtmd-cli", type=Path, required=True)
    p.add_argument("--text-gguf", type=Path, required=True)
    p.add_argument("--mmproj", type=Path, action="append", required=True)
    p.add_argument("--mm-processor-kwargs")
    p.add_argument("--chat-template", help="llama.cpp's built-in template, for a GGUF without one (chatml)")
    p.add_argument("--kylin", type=Path, default=ROOT / "target/release/kylin")
    p.add_argument("--prompt", default="Describe this image.")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repetitions", type=int, default=2)
    args = p.parse_args()
    print("| run | engine | weights | image tokens | tower ms |")
    print("|---:|---|---|---:|---:|")
    for rep in range(1, args.repetitions + 1):
        tokens, ms = kylin_once(args)
        print(f"| {rep} | kylin | {args.model.name} (as stored) | {tokens} | {ms:.0f} |", flush=True)
        for mmproj in args.mmproj:
            tokens, ms = llama_once(args, mmproj)
            print(f"| {rep} | llama.cpp | {mmproj.name} | {tokens} | {ms:.0f} |", flush=True)


if __name__ == "__main__":
    main()
