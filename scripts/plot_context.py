#!/usr/bin/env python3
"""Draws prefill and decode tokens/s against prompt length from `kylin bench --prompt-tokens N
--json` outputs (one file per length, each with Kylin and, with --vs, llama.cpp) as an SVG with
two panels, and prints the table. Standard library only."""
import argparse
import json
import sys


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


def panel(series, index, title, x0, width, height, margin):
    xs = sorted({p[0] for pts in series.values() for p in pts})
    ymax = max(p[index] for pts in series.values() for p in pts) * 1.15
    colors = {"kylin": "#c0392b", "llama.cpp": "#2c3e50"}

    def x(v):
        return x0 + margin + (xs.index(v) / max(len(xs) - 1, 1)) * (width - 2 * margin)

    def y(v):
        return height - margin - v / ymax * (height - 2 * margin)

    out = [f'<text x="{x0 + width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{x0 + margin}" y1="{height - margin}" x2="{x0 + width - margin}" y2="{height - margin}" stroke="black"/>',
           f'<line x1="{x0 + margin}" y1="{margin}" x2="{x0 + margin}" y2="{height - margin}" stroke="black"/>',
           f'<text x="{x0 + width / 2}" y="{height - 16}" text-anchor="middle">prompt tokens</text>']
    for v in xs:
        out.append(f'<text x="{x(v)}" y="{height - margin + 16}" text-anchor="middle">{v}</text>')
    for i in range(6):
        v = ymax * i / 5
        out.append(f'<text x="{x0 + margin - 6}" y="{y(v) + 4}" text-anchor="end">{v:.0f}</text>')
        out.append(f'<line x1="{x0 + margin}" y1="{y(v)}" x2="{x0 + width - margin}" y2="{y(v)}" stroke="#ddd"/>')
    for k, (name, pts) in enumerate(sorted(series.items())):
        color = colors.get(name, "#888")
        path = " ".join(f"{x(p[0]):.1f},{y(p[index]):.1f}" for p in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for p in pts:
            out.append(f'<circle cx="{x(p[0]):.1f}" cy="{y(p[index]):.1f}" r="3" fill="{color}"/>')
            out.append(f'<text x="{x(p[0]):.1f}" y="{y(p[index]) - 8:.1f}" text-anchor="middle" fill="{color}">{p[index]:.0f}</text>')
        out.append(f'<text x="{x0 + width - margin - 70}" y="{margin + 16 * k}" fill="{color}">{name}</text>')
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    series = load(args.files)
    width, height, margin = 520, 400, 56
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" height="{height}" font-family="sans-serif" font-size="12">',
            f'<rect width="{2 * width}" height="{height}" fill="white"/>']
    body += panel(series, 1, "Prefill tokens/s against prompt length", 0, width, height, margin)
    body += panel(series, 2, "Decode tokens/s after the prompt", width, width, height, margin)
    body.append("</svg>")
    with open(args.out, "w") as f:
        f.write("\n".join(body))
    print("| backend | prompt tokens | prefill tok/s | decode tok/s |")
    print("|---|---:|---:|---:|")
    for name, pts in sorted(series.items()):
        for n, prefill, decode in pts:
            print(f"| {name} | {n} | {prefill:.1f} | {decode:.2f} |")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
