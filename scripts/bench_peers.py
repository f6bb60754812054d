#!/usr/bin/env python3
"""Kylin against ik_llama.cpp on the same weights, alternating, in one run (issue 36).

ik_llama.cpp is built for this CPU by scripts/build_ik_llama.sh (from the sources PyPI's
ik-llama-cpp-python 0.1.5 ships). For each workload, each round runs `kylin bench` and
ik_llama.cpp's `llama-bench` (flash attention on; run-time repacking off and on, the faster
kept, as its users would choose), the order alternating from round to round; 2 threads each.
Each engine gets two measured runs per round, each after a warm-up, and keeps its faster one:
ik_llama.cpp one with repacking and one without, Kylin two repetitions (on a noisy machine,
the best of two against one run would favour the peer).
Prefill is 512 prompt tokens; decode is 64 tokens after a 512-token prompt (`kylin bench`
decodes after its prompt; `llama-bench -gp 512,64` does the same).

Workloads (the table of issue 36), where the weights exist in KYLIN_MODELS:
* qwen3-0.6b-shaped BF16 (Kylin's default precision here) against its BF16 GGUF twin, and its
  prefill of 3584 tokens (the issue's second prompt length; prefill only);
* qwen3-0.6b-shaped `--quantize q8_0` against its Q8_0 twin;
* Qwen2.5-Coder-0.5B-Instruct `--quantize q4_k` against the published Q4_K_M.

Usage: python3 scripts/bench_peers.py [--rounds 3] [--only NAME] [--prompt N]
`--prompt N` replaces the 512-token prompt (and so the depth decode is measured at) with N, to
see decode where attention over the context costs more. Prints every measurement and a table
of the figures (medians over the rounds), the ratios of each round and their median, and for each decode the share of the machine's
read bandwidth that Kylin's decode used in each round (`kylin bench`'s
`decode_bandwidth_fraction`: the weights one token reads times tokens/s, over the probe
measured just before; issue 36 asks for 85%), and the same share counting the KV cache the
token's attention reads as well (`decode_with_kv_gb_s`: weights plus the cache's bytes per
position times the mean depth of the decoded tokens).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("KYLIN_MODELS", Path.home() / ".cache" / "kylin-models"))
KYLIN = os.environ.get("KYLIN_BIN", str(ROOT / "target/release/kylin"))
PROMPT, GEN, THREADS = 512, 64, 2

# (name, Kylin's model, Kylin's flags, the peer's GGUF, prompt tokens, whether decode is measured)
WORKLOADS = [
    ("qwen3-0.6b-shaped BF16", MODELS / "qwen3-0.6b-shaped", [],
     MODELS / "qwen3-0.6b-shaped/gguf/qwen3-0.6b-shaped-bf16.gguf", PROMPT, True),
    ("qwen3-0.6b-shaped BF16", MODELS / "qwen3-0.6b-shaped", [],
     MODELS / "qwen3-0.6b-shaped/gguf/qwen3-0.6b-shaped-bf16.gguf", 3584, False),
    ("qwen3-0.6b-shaped q8_0", MODELS / "qwen3-0.6b-shaped", ["--quantize", "q8_0"],
     MODELS / "qwen3-0.6b-shaped/gguf/qwen3-0.6b-shaped-q8_0.gguf", PROMPT, True),
    ("Qwen2.5-Coder-0.5B q4_k vs Q4_K_M", MODELS / "qwen2.5-coder-0.5b-instruct", ["--quantize", "q4_k"],
     MODELS / "gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", PROMPT, True),
]


def ik_bench_path():
    out = subprocess.run(["bash", str(ROOT / "scripts/build_ik_llama.sh")], check=True, capture_output=True,
                         text=True)
    return out.stdout.strip().splitlines()[-1]


def kylin(model, extra, prompt, with_decode):
    gen = GEN if with_decode else 1
    out = subprocess.run([KYLIN, "bench", str(model), *extra, "--threads", str(THREADS), "--prompt-tokens",
                          str(prompt), "--gen-tokens", str(gen), "--repetitions", "2", "--json"],
                         check=True, capture_output=True, text=True, timeout=1800)
    r = json.loads(out.stdout)
    samples = r["results"][0]["samples"]
    prefill = max(s["prefill_tok_s"] for s in samples)
    best = max(samples, key=lambda s: s["decode_tok_s"])
    read = r.get("machine_read_gb_s") if with_decode else None
    share = best["decode_gb_s"] / read if read else None
    with_kv = best.get("decode_with_kv_gb_s")
    share_kv = with_kv / read if read and with_kv else None
    return prefill, best["decode_tok_s"], share, share_kv


def ik(bench, gguf, prompt, with_decode):
    best = [0.0, 0.0]
    depth = ["-gp", f"{prompt},{GEN}"] if with_decode else []
    for rtr in ("0", "1"):
        out = subprocess.run([bench, "-m", str(gguf), "-p", str(prompt), "-n", "0", *depth,
                              "-t", str(THREADS), "-r", "1", "-fa", "1", "-rtr", rtr, "-o", "json"],
                             check=True, capture_output=True, text=True, timeout=1800)
        for row in json.loads(out.stdout):
            kind = 1 if row["n_gen"] > 0 else 0
            best[kind] = max(best[kind], row["avg_ts"])
    return best[0], best[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only")
    ap.add_argument("--prompt", type=int, help="prompt tokens instead of 512 (the decode depth)")
    args = ap.parse_args()
    bench = ik_bench_path()
    rows = []
    for name, model, extra, gguf, prompt, with_decode in WORKLOADS:
        if args.only and args.only not in name:
            continue
        if args.prompt and prompt == PROMPT:
            prompt = args.prompt
        if not (model / "config.json").is_file() or not gguf.is_file():
            print(f"{name}: skipped ({model} or {gguf} missing; run testdata/models/fetch.sh --bench)")
            continue
        ours, theirs = [], []
        for r in range(args.rounds):
            order = [("kylin", lambda: kylin(model, extra, prompt, with_decode)),
                     ("ik_llama.cpp", lambda: ik(bench, gguf, prompt, with_decode))]
            if r % 2:
                order.reverse()
            for label, run in order:
                prefill, decode, *share = run()
                (ours if label == "kylin" else theirs).append((prefill, decode, *share))
                of_peak = ""
                if share and share[0] is not None:
                    with_kv = f"; {share[1]:.0%} with the KV cache" if share[1] is not None else ""
                    of_peak = f" ({share[0]:.0%} of the read bandwidth{with_kv})"
                print(f"{name} round {r + 1} {label:12}: prefill {prompt} {prefill:.1f} tok/s, "
                      f"decode {decode:.1f} tok/s{of_peak}", flush=True)
        rows.append((name, prompt, with_decode, ours, theirs))
    print()
    print("| workload | Kylin | ik_llama.cpp | ratio per round | median ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, prompt, with_decode, ours, theirs in rows:
        for i, what in enumerate((f"prefill {prompt}", f"decode after {prompt}")[:2 if with_decode else 1]):
            k = statistics.median(o[i] for o in ours)
            t = statistics.median(o[i] for o in theirs)
            ratios = [o[i] / x[i] for o, x in zip(ours, theirs)]
            per_round = ", ".join(f"{r:.2f}×" for r in ratios)
            print(f"| {name}, {what} | {k:.1f} | {t:.1f} | {per_round} | {statistics.median(ratios):.2f}× |")
        for i, what in ((2, "weights"), (3, "weights and KV cache")):
            if with_decode and all(o[i] is not None for o in ours):
                shares = ", ".join(f"{o[i]:.0%}" for o in ours)
                median = statistics.median(o[i] for o in ours)
                print(f"| {name}, Kylin's decode, share of the read bandwidth ({what}) | | | {shares} | {median:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
