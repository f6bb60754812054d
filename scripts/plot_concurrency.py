#!/usr/bin/env python3
"""Draws aggregate decode throughput against concurrency from `kylin bench --concurrency N --json`
outputs (one file per level, each with Kylin and, with --vs, llama.cpp) as an SVG line chart, and
prints the table. Standard library only, so it runs anywhere the benchmark runs."""
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
        for r in doc.get("results", [doc]):
            name = r["backend"]
            series.setdefault(name, []).append(
                (r["concurrency"], r["aggregate_decode_tok_s"], r["itl_ms_p99"], r["ttft_ms_p50"]))
    for points in series.values():
        points.sort()
    return series


def svg(series, width=640, height=400):
    points = {name: [(c, t) for c, t, _, _ in pts] for name, pts in series.items()}
    chart = svgchart.panel(points, "Aggregate decode throughput against concurrency", "sequences decoding at once",
                           "tokens/s (all sequences)", width=width, height=height)
    return svgchart.document(chart, width, height)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    series = load(args.files)
    with open(args.out, "w") as f:
        f.write(svg(series))
    print("| backend | sequences | aggregate decode tok/s | itl p99 ms | ttft p50 ms |")
    print("|---|---:|---:|---:|---:|")
    for name, pts in sorted(series.items()):
        for c, t, itl, ttft in pts:
            print(f"| {name} | {c} | {t:.1f} | {itl:.1f} | {ttft:.0f} |")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
