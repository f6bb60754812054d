#!/usr/bin/env python3
"""Draws prefill and decode tokens/s against prompt length from `kylin bench --prompt-tokens N
--json` outputs (one file per length, each with Kylin and, with --vs, llama.cpp) as an SVG with
two panels, and prints the table. Standard library only."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import svgchart  # noqa: E402


def load(paths):
    series = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        n = doc["prompt_tokens"]
        for r in doc.get("results", [doc]):
            series.setdefault(r["backend"], []).append((n, r["prefill_tok_s"], r["decode_tok_s"]))
    for points in series.values():
        points.sort()
    return series


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    series = load(args.files)
    width, height = 520, 400
    prefill = {name: [(n, p) for n, p, _ in pts] for name, pts in series.items()}
    decode = {name: [(n, d) for n, _, d in pts] for name, pts in series.items()}
    body = svgchart.panel(prefill, "Prefill tokens/s against prompt length", "prompt tokens", width=width, height=height)
    body += svgchart.panel(decode, "Decode tokens/s after the prompt", "prompt tokens", x0=width, width=width, height=height)
    with open(args.out, "w") as f:
        f.write(svgchart.document(body, 2 * width, height))
    print("| backend | prompt tokens | prefill tok/s | decode tok/s |")
    print("|---|---:|---:|---:|")
    for name, pts in sorted(series.items()):
        for n, prefill, decode in pts:
            print(f"| {name} | {n} | {prefill:.1f} | {decode:.2f} |")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
