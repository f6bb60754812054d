"""Plots `scripts/loadbench.py --json` results as an SVG (no plotting library needed):
output throughput, TTFT p50 and ITL p50 against concurrency, one line per model.

    python3 scripts/loadbench_plot.py RESULTS.json OUT.svg
"""

import json
import sys
from pathlib import Path

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
PANELS = [("output_tok_per_s", "output tokens/s"), ("ttft_p50_ms", "TTFT p50 (ms)"), ("itl_p50_ms", "ITL p50 (ms)")]
W, H, PAD = 300, 220, 45


def main():
    rows = json.loads(Path(sys.argv[1]).read_text())
    models = list(dict.fromkeys(r["model"] for r in rows))
    conc = sorted({r["concurrency"] for r in rows})
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W * len(PANELS)}" height="{H + 60}" '
           'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    for p, (key, title) in enumerate(PANELS):
        x0 = p * W
        top = max(r[key] for r in rows) * 1.1 or 1
        sx = lambda c: x0 + PAD + (W - PAD - 15) * conc.index(c) / max(1, len(conc) - 1)
        sy = lambda v: 20 + (H - 40) * (1 - v / top)
        out.append(f'<text x="{x0 + W / 2}" y="14" text-anchor="middle" font-weight="bold">{title}</text>')
        out.append(f'<line x1="{x0 + PAD}" y1="{sy(0)}" x2="{x0 + W - 15}" y2="{sy(0)}" stroke="black"/>')
        out.append(f'<line x1="{x0 + PAD}" y1="20" x2="{x0 + PAD}" y2="{sy(0)}" stroke="black"/>')
        for i in range(5):
            v = top * i / 4
            out.append(f'<text x="{x0 + PAD - 4}" y="{sy(v) + 4}" text-anchor="end">{v:.0f}</text>')
        for c in conc:
            out.append(f'<text x="{sx(c)}" y="{sy(0) + 14}" text-anchor="middle">{c}</text>')
        out.append(f'<text x="{x0 + W / 2}" y="{sy(0) + 28}" text-anchor="middle">concurrency</text>')
        for m, model in enumerate(models):
            pts = [(sx(r["concurrency"]), sy(r[key])) for r in rows if r["model"] == model]
            color = COLORS[m % len(COLORS)]
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                       + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
            out.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in pts)
    for m, model in enumerate(models):
        y = H + 40 + 0 * m
        x = 20 + m * 420
        out.append(f'<rect x="{x}" y="{y - 9}" width="12" height="12" fill="{COLORS[m % len(COLORS)]}"/>')
        out.append(f'<text x="{x + 18}" y="{y + 1}">{Path(model).name}</text>')
    out.append("</svg>")
    Path(sys.argv[2]).write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
