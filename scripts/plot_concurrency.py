#!/usr/bin/env python3
"""Draws aggregate decode throughput against concurrency from `kylin bench --concurrency N --json`
outputs (one file per level, each with Kylin and, with --vs, llama.cpp) as an SVG line chart, and
prints the table. Standard library only, so it runs anywhere the benchmark runs."""
import argparse
import json
import sys


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


def svg(series, width=640, height=400, margin=56):
    xs = sorted({p[0] for pts in series.values() for p in pts})
    ymax = max(p[1] for pts in series.values() for p in pts) * 1.1
    colors = {"kylin": "#c0392b", "llama.cpp": "#2c3e50"}

    def x(v):
        return margin + (xs.index(v) / max(len(xs) - 1, 1)) * (width - 2 * margin)

    def y(v):
        return height - margin - v / ymax * (height - 2 * margin)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">Aggregate decode throughput against concurrency</text>',
           f'<line x1="{margin}" y1="{height - margin}" x2="{width - margin}" y2="{height - margin}" stroke="black"/>',
           f'<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{height - margin}" stroke="black"/>',
           f'<text x="{width / 2}" y="{height - 16}" text-anchor="middle">sequences decoding at once</text>',
           f'<text x="16" y="{height / 2}" text-anchor="middle" transform="rotate(-90 16 {height / 2})">tokens/s (all sequences)</text>']
    for v in xs:
        out.append(f'<text x="{x(v)}" y="{height - margin + 16}" text-anchor="middle">{v}</text>')
    for i in range(6):
        v = ymax * i / 5
        out.append(f'<text x="{margin - 6}" y="{y(v) + 4}" text-anchor="end">{v:.0f}</text>')
        out.append(f'<line x1="{margin}" y1="{y(v)}" x2="{width - margin}" y2="{y(v)}" stroke="#ddd"/>')
    for k, (name, pts) in enumerate(sorted(series.items())):
        color = colors.get(name, "#888")
        path = " ".join(f"{x(c):.1f},{y(t):.1f}" for c, t, _, _ in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for c, t, _, _ in pts:
            out.append(f'<circle cx="{x(c):.1f}" cy="{y(t):.1f}" r="3" fill="{color}"/>')
            out.append(f'<text x="{x(c):.1f}" y="{y(t) - 8:.1f}" text-anchor="middle" fill="{color}">{t:.0f}</text>')
        out.append(f'<text x="{margin + 10}" y="{margin + 16 * k}" fill="{color}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


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
