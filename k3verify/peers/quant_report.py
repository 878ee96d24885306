"""The quantization report of a GGUF (peers/quant_cost.py says what is measured): the two fp64 oracles it needs,
run on token sequences, and the report written as JSON and a small HTML page with the plots (by layer, by
position). Used by `k3verify quant-report` and, with the server's answers, by `parity --endpoint --weights-from`.
"""

from __future__ import annotations

import html
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from k3verify.checkpoint.loader import load_into
from k3verify.gates.report.svg import as_float
from k3verify.oracle.conventions import Assignment, applied
from k3verify.oracle.k3_reference import K3Reference
from k3verify.oracle.precision import get_precision
from k3verify.peers import quant_cost
from k3verify.peers.gguf_target import GgufTarget, tag_model
from k3verify.target import Target

ARITHMETIC = "w-gguf-a8"


def _model(target: Target) -> K3Reference:
    model = K3Reference(target.cfg, torch.float64)
    load_into(model, target.cfg, target.weights())
    tag_model(model, target)
    return model


def _rows(model: K3Reference, seq: Sequence[int], first: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor(list(seq))).logits[first - 1: len(seq) - 1]
    return torch.log_softmax(logits.double(), dim=-1)


def quant_report(checkpoint: Target, gguf: GgufTarget, sequences: Sequence[tuple[Sequence[int], int]],
                 server: Sequence[tuple[Sequence[Mapping[int, float]], Sequence[int]]] | None = None,
                 accepted: Sequence[Assignment] = ()) -> dict[str, Any]:
    """Weight errors; the checkpoint's oracle (exact) against the GGUF's (its llama.cpp arithmetic), both fp64,
    on `sequences` ((ids, first): rows predicting ids[first:]); with `server` ((top-k per position, greedy ids)
    per sequence) the server against both. `accepted` conventions apply to both oracles."""
    errors = quant_cost.weight_errors(checkpoint.weights(), gguf.weights(), _types_by_name(gguf))
    reference, quantized = _model(checkpoint), _model(gguf)
    ref_rows, quant_rows = [], []
    with applied(accepted):
        for seq, first in sequences:
            ref_rows.append(_rows(reference, seq, first))
        with get_precision(ARITHMETIC).emulated():
            for seq, first in sequences:
                quant_rows.append(_rows(quantized, seq, first))
    model = quant_cost.model_cost(ref_rows, quant_rows)
    served = None
    if server is not None:
        tops = [list(t) for t, _ in server]
        tokens = [list(ids) for _, ids in server]
        served = quant_cost.server_cost([r[: len(t)] for r, t in zip(ref_rows, tops, strict=True)],
                                        [q[: len(t)] for q, t in zip(quant_rows, tops, strict=True)], tops, tokens)
    return {"gguf": gguf.describe(), "arithmetic": ARITHMETIC, "headline": quant_cost.headline(model, served),
            "weights": quant_cost.summarize_errors(errors), "model": model, "server": served}


def _types_by_name(gguf: GgufTarget) -> dict[str, Any]:
    return dict(gguf.weight_types())


def write_quant_report(report: Mapping[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """quant.json and quant.html in `out_dir`, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = json.dumps(report, indent=2, default=_jsonable)
    return _atomic(out_dir / "quant.json", data), _atomic(out_dir / "quant.html", render_html(report))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def _atomic(path: Path, text: str) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _finite(value: object) -> float | None:
    """A plotted value: a number, or None for a gap (None, NaN, an infinity, or report.json's "nan"/"inf" strings,
    as a report read back from disk holds them)."""
    if value is None:
        return None
    number = as_float(value)
    return number if math.isfinite(number) else None


def _bars(title: str, labels: Sequence[str], series: Mapping[str, Sequence[Any]], unit: str) -> str:
    """A small inline SVG: one polyline per series over the labels (log scale when every value is positive); a
    value that is not a finite number is a gap, and the title says how many there are."""
    series = {name: [_finite(v) for v in s] for name, s in series.items()}
    values = [v for s in series.values() for v in s if v is not None]
    gaps = sum(v is None for s in series.values() for v in s)
    if not values or not labels:
        return f"<p>{html.escape(title)}: no data</p>"
    log = all(v > 0 for v in values)
    f = (lambda v: math.log10(v)) if log else (lambda v: v)
    lo, hi = min(f(v) for v in values), max(f(v) for v in values)
    span = (hi - lo) or 1.0
    w, h, pad = 520, 180, 36
    step = (w - 2 * pad) / max(len(labels) - 1, 1)
    colours = ("#1f77b4", "#d62728", "#2ca02c")
    parts = [f'<svg width="{w}" height="{h + 30}" role="img" aria-label="{html.escape(title)}">']
    for i, (name, s) in enumerate(series.items()):
        pts = [f"{pad + j * step:.1f},{h - pad - (f(v) - lo) / span * (h - 2 * pad):.1f}" for j, v in enumerate(s)
               if v is not None]
        parts.append(f'<polyline fill="none" stroke="{colours[i % 3]}" stroke-width="2" points="{" ".join(pts)}"/>')
        parts.append(f'<text x="{pad + 150 * i}" y="{h + 20}" fill="{colours[i % 3]}">{html.escape(name)}</text>')
    parts.append(f'<text x="{pad}" y="14">{html.escape(title)} ({unit}{", log scale" if log else ""}: '
                 f'{min(values):.3g} .. {max(values):.3g}{f"; {gaps} not finite, left out" if gaps else ""})'
                 '</text></svg>')
    return "".join(parts)


def render_html(report: Mapping[str, Any]) -> str:
    """quant.html: the report's headline, plots and weight-error table on a page of its own."""
    return ("<!doctype html><meta charset='utf-8'><title>quantization report</title>"
            f"<h1>{html.escape(str(report['gguf']['gguf']))}</h1>" + render_plots(report))


def render_plots(report: Mapping[str, Any]) -> str:
    """The headline, the plots (weight error by layer, KL divergence by position) and the weight-error table of a
    quantization report (as quant_report returns it, or as report.json keeps it): quant.html's body, and the
    quantization section of the parity report's HTML."""
    layers = report["weights"]["by_layer"]
    model = report["model"]
    position: dict[str, Sequence[float]] = {"quantization (checkpoint vs GGUF oracle)": model["kl_by_position"]}
    if report.get("server"):
        position["server vs GGUF oracle (top-k)"] = report["server"]["vs_gguf"]["kl_by_position"]
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{', '.join(v['types'])}</td><td>{v['tensors']}</td>"
                   f"<td>{v['rel_rms']:.3g}</td><td>{v['rel_rms_max']:.3g}</td><td>{v['max_abs']:.3g}</td></tr>"
                   for k, v in report["weights"]["by_kind"].items())
    longest = max(len(s) for s in position.values())
    return (f"<p>{html.escape(report['headline'])}</p>"
            + _bars("weight error by layer", list(layers), {"relative RMS": [v["rel_rms"] for v in layers.values()]},
                    "relative RMS")
            + _bars("KL divergence by position", [str(i) for i in range(longest)], position, "nats")
            + "<table><tr><th>tensor kind</th><th>types</th><th>tensors</th><th>rel RMS</th><th>rel RMS max</th>"
            f"<th>max abs</th></tr>{rows}</table>")
