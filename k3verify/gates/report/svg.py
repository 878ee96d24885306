"""Inline SVG line charts with a log-scale y axis (error over depth / over position) and margin bars.
No JavaScript, no external assets: the report must render from a file on an air-gapped machine."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

_W, _H = 640, 220
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 28, 44
COLORS = ("#1f6feb", "#d1242f", "#8250df", "#1a7f37")


def as_float(value: object) -> float:
    # report.json stores non-finite numbers as "nan" / "inf" / "-inf", which float() reads back.
    if isinstance(value, int | float | str):
        return float(value)
    raise TypeError(f"chart value {value!r} ({type(value).__name__}) is neither a number nor 'nan'/'inf'")


def _log_range(values: Sequence[float], bar: float | None) -> tuple[float, float, float]:
    """(floor, lo, hi) in log10. Zeros are drawn at `floor` (one decade under the smallest positive
    value): an exact match is real information and must stay visible on a log axis."""
    positive = [v for v in values if math.isfinite(v) and v > 0]
    if bar is not None and bar > 0:
        positive.append(bar)
    if not positive:
        return 1e-12, -12.0, -11.0
    lo = math.floor(math.log10(min(positive))) - 1
    hi = math.ceil(math.log10(max(positive)))
    if hi <= lo:
        hi = lo + 1
    return 10.0**lo, float(lo), float(hi)


def line_chart(
    title: str,
    x_labels: Sequence[str],
    series: Sequence[tuple[str, Sequence[object]]],
    *,
    y_label: str,
    bar: float | None = None,
    highlight: int | None = None,
) -> str:
    """One SVG chart. `series` values may be numbers or the report's "nan"/"inf" strings; non-finite
    points are drawn as red crosses at the top edge. `highlight` marks an x (first divergent layer)."""
    parsed = [(name, [as_float(v) for v in values]) for name, values in series]
    floor, lo, hi = _log_range([v for _, vals in parsed for v in vals], bar)
    n = max((len(vals) for _, vals in parsed), default=0)
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def x_at(i: int) -> float:
        return _LEFT + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    def y_at(v: float) -> float:
        v = max(v, floor)
        return _TOP + plot_h * (1 - (math.log10(v) - lo) / (hi - lo))

    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
             f'viewBox="0 0 {_W} {_H}" role="img" aria-label="{escape(title)}">',
             f'<text x="{_LEFT}" y="16" class="ct">{escape(title)}</text>',
             f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#bbb"/>']
    for decade in range(int(lo), int(hi) + 1):
        y = y_at(10.0**decade)
        parts.append(f'<line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" class="ax" text-anchor="end">1e{decade}</text>')
    if bar is not None and bar > 0:
        y = y_at(bar)
        parts.append(f'<line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d1242f" '
                     f'stroke-dasharray="5,4"/><text x="{_LEFT + plot_w - 4}" y="{y - 4:.1f}" class="ax" '
                     f'text-anchor="end" fill="#d1242f">bar {bar:g}</text>')
    if highlight is not None and 0 <= highlight < n:
        x = x_at(highlight)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP}" y2="{_TOP + plot_h}" stroke="#d1242f" '
                     f'stroke-width="2" opacity="0.4"/>')
    step = max(1, math.ceil(n / 12))
    for i in range(0, n, step):
        label = x_labels[i] if i < len(x_labels) else str(i)
        parts.append(f'<text x="{x_at(i):.1f}" y="{_TOP + plot_h + 14}" class="ax" text-anchor="middle">'
                     f'{escape(label[-14:])}</text>')
    parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{_H - 6}" class="ax" text-anchor="middle">'
                 f'{escape(y_label)}</text>')
    for k, (name, vals) in enumerate(parsed):
        color = COLORS[k % len(COLORS)]
        finite = [(x_at(i), y_at(v)) for i, v in enumerate(vals) if math.isfinite(v)]
        if finite:
            points = " ".join(f"{x:.1f},{y:.1f}" for x, y in finite)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{points}"/>')
            parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.2" fill="{color}"/>' for x, y in finite)
        for i, v in enumerate(vals):
            if not math.isfinite(v):
                x = x_at(i)
                parts.append(f'<text x="{x:.1f}" y="{_TOP + 10}" text-anchor="middle" fill="#d1242f">×</text>')
        parts.append(f'<text x="{_LEFT + 8 + 150 * k}" y="{_TOP + 14}" class="ax" fill="{color}">'
                     f'■ {escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def margin_bar(margin: object, passed: bool, thin_at: float = 0.8) -> str:
    """A 120-px bar: fill = margin (metric/bar) capped at 1, tick at the thin threshold."""
    if margin is None:
        return ""
    value = as_float(margin)
    frac = min(value, 1.0) if math.isfinite(value) else 1.0
    color = "#d1242f" if not passed else ("#bf8700" if value > thin_at else "#1a7f37")
    width = max(frac * 120, 1.0)
    return (f'<svg class="mbar" xmlns="http://www.w3.org/2000/svg" width="124" height="12" viewBox="0 0 124 12">'
            f'<rect x="1" y="1" width="120" height="10" fill="#f0f0f0" stroke="#ccc"/>'
            f'<rect x="1" y="1" width="{width:.1f}" height="10" fill="{color}"/>'
            f'<line x1="{1 + 120 * thin_at:.1f}" x2="{1 + 120 * thin_at:.1f}" y1="0" y2="12" stroke="#555"/></svg>')
