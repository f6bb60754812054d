"""Line charts as SVG, standard library only: shared by the benchmark plot scripts."""

COLORS = {"kylin": "#c0392b", "llama.cpp": "#2c3e50"}


def panel(series, title, xlabel, ylabel="", x0=0, width=640, height=400, margin=56):
    """One chart of `series` ({name: [(x, y), ...]}) with categorical x positions, at
    horizontal offset `x0`: axes, grid, labelled points and a legend. Returns SVG elements."""
    xs = sorted({p[0] for pts in series.values() for p in pts})
    ymax = max(p[1] for pts in series.values() for p in pts) * 1.15

    def x(v):
        return x0 + margin + (xs.index(v) / max(len(xs) - 1, 1)) * (width - 2 * margin)

    def y(v):
        return height - margin - v / ymax * (height - 2 * margin)

    out = [f'<text x="{x0 + width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{x0 + margin}" y1="{height - margin}" x2="{x0 + width - margin}" y2="{height - margin}" stroke="black"/>',
           f'<line x1="{x0 + margin}" y1="{margin}" x2="{x0 + margin}" y2="{height - margin}" stroke="black"/>',
           f'<text x="{x0 + width / 2}" y="{height - 16}" text-anchor="middle">{xlabel}</text>']
    if ylabel:
        out.append(f'<text x="{x0 + 16}" y="{height / 2}" text-anchor="middle" transform="rotate(-90 {x0 + 16} {height / 2})">{ylabel}</text>')
    for v in xs:
        out.append(f'<text x="{x(v)}" y="{height - margin + 16}" text-anchor="middle">{v}</text>')
    for i in range(6):
        v = ymax * i / 5
        out.append(f'<text x="{x0 + margin - 6}" y="{y(v) + 4}" text-anchor="end">{v:.0f}</text>')
        out.append(f'<line x1="{x0 + margin}" y1="{y(v)}" x2="{x0 + width - margin}" y2="{y(v)}" stroke="#ddd"/>')
    for k, (name, pts) in enumerate(sorted(series.items())):
        color = COLORS.get(name, "#888")
        path = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for a, b in pts:
            out.append(f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="3" fill="{color}"/>')
            out.append(f'<text x="{x(a):.1f}" y="{y(b) - 8:.1f}" text-anchor="middle" fill="{color}">{b:.0f}</text>')
        out.append(f'<text x="{x0 + margin + 10}" y="{margin + 16 * k}" fill="{color}">{name}</text>')
    return out


def document(elements, width, height):
    """A whole SVG document around `elements`, on a white background."""
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
                      f'<rect width="{width}" height="{height}" fill="white"/>', *elements, "</svg>"])
