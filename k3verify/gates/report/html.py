"""report.html: one self-contained file rendered from the report dict. No scripts, no network:
verdict banner, checks grouped by component with margin bars, error-over-depth and over-position
charts (inline SVG), the mutation kill matrix, and the environment the run ran in."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from html import escape
from itertools import groupby
from typing import Any

from k3verify.gates.core.excused import status_label
from k3verify.gates.report.html_endpoint import (
    accepted_section,
    endpoint_section,
    explanation_section,
    quantization_section,
)
from k3verify.gates.report.svg import line_chart, margin_bar

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#1f2328}
main{padding:0 24px 40px}
h2{margin:28px 0 8px;border-bottom:1px solid #d0d7de}
h3{margin:18px 0 6px;font-size:15px}
.verdict{padding:18px 24px;color:#fff;font-size:18px}
.verdict.pass{background:#1a7f37}.verdict.fail{background:#cf222e}.verdict.error{background:#9a6700}
.verdict.inconclusive{background:#6e4b00}.verdict .why{display:block;font-size:15px;margin-top:6px}
.verdict .word{font-size:34px;font-weight:700;letter-spacing:2px;margin-right:16px}
table{border-collapse:collapse;margin:4px 0 10px}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}
tr.grp th{background:#eaeef2;font-size:15px;padding-top:8px}
td.num{font-family:ui-monospace,Menlo,Consolas,monospace;text-align:right;white-space:nowrap}
table.checks{width:100%}
.st{font-weight:700;padding:1px 6px;border-radius:4px;color:#fff;white-space:nowrap}
.st.pass,.st.killed{background:#1a7f37}.st.fail,.st.survived{background:#cf222e}
.st.vacuous{background:#8250df}.st.excused{background:#9a6700}.st.error{background:#9a6700}
.st.skipped,.st.equivalent{background:#6e7781}
.thin{color:#9a6700;font-weight:700}
.small{color:#57606a;font-size:12px}
.chart{margin:6px 12px 6px 0;border:1px solid #eee}.chart .ct{font-weight:700;font-size:12px}
.chart .ax{font-size:10px;fill:#57606a}
pre{background:#f6f8fa;padding:6px;font-size:12px;white-space:pre-wrap;word-break:break-all}
td:last-child{max-width:420px}
td code{white-space:nowrap}
.km td{text-align:center}.km td.mid{text-align:left}
"""


def _e(value: Any) -> str:
    return escape("" if value is None else str(value))


def _num(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    return _e(value)


def _status(status: str, metrics: Mapping[str, Any] | None = None) -> str:
    return f'<span class="st {_e(status)}">{_e(status_label(status, metrics or {}).upper())}</span>'


def _banner(data: Mapping[str, Any]) -> str:
    summary = data["summary"]
    verdict = summary["verdict"]
    counts = ", ".join(f"{n} {s}" for s, n in summary["counts"].items() if n)
    run = data["run"]
    target = run["preset"] or run["checkpoint"] or "no model"
    return (f'<header id="verdict" class="verdict {_e(verdict)}"><span class="word">{_e(verdict.upper())}</span>'
            f'{_e(counts) or "no checks"} &middot; suite {_e(run["suite"])} &middot; {_e(target)} '
            f'&middot; {_e(run["device"])}{_why(summary)}</header>')


def _why(summary: Mapping[str, Any]) -> str:
    reasons = summary.get("missing_evidence") or []
    return "".join(f'<span class="why">not verified: {_e(r)}</span>' for r in reasons)


def _run_table(run: Mapping[str, Any]) -> str:
    keys = ("k3verify_version", "git_sha", "git_dirty", "preset", "checkpoint", "checkpoint_digest", "device",
            "device_name", "suite", "only", "seed", "started_at", "wall_time_s", "python", "torch",
            "transformers", "fla")
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_num(run.get(k))}</td></tr>" for k in keys)
    return f'<section id="run"><h2>Run</h2><table>{rows}</table></section>'


def _notes_cell(r: Mapping[str, Any]) -> str:
    bits = []
    if r["bar_reason"]:
        bits.append(f'<div class="small">bar {_num(r["bar"])}: {_e(r["bar_reason"])}</div>')
    if r["reason"]:
        bits.append(f"<div>{_e(r['reason'])}</div>")
    if r.get("worst"):
        w = r["worst"]
        key = f"[{_e(w['key'])}] " if w.get("key") else ""
        bits.append(f'<div class="small">worst {key}at {_e(tuple(w["index"]))}: ref {_num(w["reference"])}, '
                    f'cand {_num(w["candidate"])}</div>')
    if r.get("instrument"):
        i = r["instrument"]
        flag = "<b>INSTRUMENT SUSPECT</b>: " if i["flag"] else ""
        bits.append(f'<div class="small">{flag}to fp64: ref {_num(i["ref_to_gold"])}, '
                    f'cand {_num(i["cand_to_gold"])}</div>')
    loc = r.get("localization") or {}
    if loc.get("first_divergent_layer"):
        bits.append(f'<div class="small">first divergent layer: <b>{_e(loc["first_divergent_layer"])}</b></div>')
    bits.extend(f'<div class="small">{_e(n)}</div>' for n in r["notes"])
    if r["thin"]:
        bits.append('<div class="thin">thin margin (&gt; 0.8 of the bar)</div>')
    if r.get("traceback"):
        bits.append(f"<pre>{_e(r['traceback'][-2000:])}</pre>")
    return "".join(bits)


def _control_cell(control: Mapping[str, Any] | None) -> str:
    if not control:
        return "—"
    # A control is supposed to fail: say "caught" rather than show a red FAIL next to a green check.
    badge = ('<span class="st pass">caught</span>' if control["status"] == "fail"
             else '<span class="st vacuous">NOT caught</span>')
    where = (f' <span class="small">at {_e(control["first_divergent_layer"])}</span>'
             if control.get("first_divergent_layer") else "")
    return f'{badge}{where}<div class="small">{_e(control["description"])}</div>'


_SOURCE_WORD = {"noise": "from noise", "fixed": "fixed", "measured": "measured, capped", "format": "bf16 format",
                "none": "bit for bit"}


def _bar_cell(r: Mapping[str, Any]) -> str:
    """The bar and where it comes from (the full derivation is in the Bars section)."""
    source, n = r.get("bar_source", "none"), r.get("noise")
    word = _SOURCE_WORD.get(source, source)
    if source == "noise" and n:
        word = f'{_num(n["factor"])}x noise {_num(n["value"])} ({_e(n["source"])})'
    return f'{_num(r["bar"])}<div class="small"><a href="#bar-{_e(r["id"])}">{word}</a></div>'


def _bars_section(results: Sequence[Mapping[str, Any]]) -> str:
    """Every RMS bar with its noise and derivation (BF16 and bit-exact bars are fixed by their kind)."""
    rows = []
    for r in sorted(results, key=lambda r: r["id"]):
        if r["kind"] != "rms" or r["bar"] is None:
            continue
        n = r.get("noise") or {}
        derivation = n.get("derivation") or r.get("bar_reason") or ""
        extra = " ".join(_e(n[k]) for k in ("why_measured", "note") if n.get(k))
        rows.append(f'<tr id="bar-{_e(r["id"])}"><td><code>{_e(r["id"])}</code></td><td class="num">{_num(r["bar"])}'
                    f'</td><td>{_e(r.get("bar_source"))}</td><td class="num">{_num(n.get("value"))}</td>'
                    f'<td>{_e(n.get("source"))}</td><td class="small">{_e(n.get("pair"))}</td>'
                    f'<td class="small">{_e(derivation)} {extra}</td></tr>')
    rule = ("An RMS bar derives from measured noise: the relative RMS distance between the same reference at the "
            "check's precision and in fp64, on the check's inputs (module checks: the oracle's module; whole models: "
            "the oracle under the candidate's route pinning); bar = max(factor x noise, floor). No serving code "
            "takes part, so a bug cannot widen its own bar. A fixed bar states its reason. BF16 checks hold every "
            "element to |c-r| <= 1e-5 + 1.6e-2|r| (two bf16 ulps); bit-exact checks have no bar.")
    return (f'<section id="bars"><h2>Bars</h2><p class="small">{rule}</p><table><tr><th>check</th><th>bar</th>'
            f'<th>source</th><th>noise</th><th>noise from</th><th>pair</th><th>derivation</th></tr>{"".join(rows)}'
            "</table></section>")


def _margin_cell(r: Mapping[str, Any]) -> str:
    if r["margin"] is None:
        return '<span class="small">exact</span>' if r["kind"] == "bitexact" and r["status"] == "pass" else ""
    return f'{margin_bar(r["margin"], r["status"] == "pass")} <span class="small">{_num(r["margin"])}</span>'


def _results_section(results: Sequence[Mapping[str, Any]]) -> str:
    out = ['<section id="results"><h2>Checks</h2><table class="checks"><tr><th>check</th><th>level</th><th>status</th>'
           "<th>kind</th><th>metric</th><th>bar</th><th>margin</th><th>control</th><th>time s</th>"
           "<th>notes</th></tr>"]
    ordered = sorted(results, key=lambda r: (r["component"], r["id"]))
    for component, group in groupby(ordered, key=lambda r: r["component"]):
        out.append(f'<tr class="grp"><th colspan="10">{_e(component)}</th></tr>')
        for r in group:
            out.append(f'<tr id="check-{_e(r["id"])}"><td><code>{_e(r["id"])}</code></td><td>{_e(r["level"])}</td>'
                       f'<td>{_status(r["status"], r["metrics"])}</td><td>{_e(r["kind"])}</td>'
                       f'<td class="num">{_num(r["metric"])}</td><td class="num">{_bar_cell(r)}</td>'
                       f'<td>{_margin_cell(r)}</td>'
                       f'<td>{_control_cell(r.get("control"))}</td><td class="num">{r["duration_s"]:.2f}</td>'
                       f"<td>{_notes_cell(r)}</td></tr>")
    out.append("</table></section>")
    return "".join(out)


def _charts_section(results: Sequence[Mapping[str, Any]]) -> str:
    charts = []
    for r in results:
        loc = r.get("localization")
        if not loc or not (loc["per_layer"] or loc["per_position"]):
            continue
        rms_bar = r["bar"] if r["kind"] == "rms" else None
        parts = [f"<h3><code>{_e(r['id'])}</code> {_status(r['status'], r['metrics'])}</h3>"]
        if loc["per_layer"]:
            names = [e["name"] for e in loc["per_layer"]]
            first = loc["first_divergent_layer"]
            parts.append(line_chart(
                "error over depth: RMS(c-r)/RMS(r) per layer", names,
                [("rel RMS", [e["rel_rms"] for e in loc["per_layer"]]),
                 ("max |c-r|", [e["max_abs"] for e in loc["per_layer"]])],
                y_label="layer", bar=rms_bar, highlight=names.index(first) if first in names else None))
        if loc["per_position"]:
            pos = loc["per_position"]
            parts.append(line_chart(
                "error over position", [str(p["position"]) for p in pos],
                [("rel RMS", [p["rel_rms"] for p in pos]), ("max |c-r|", [p["max_abs"] for p in pos])],
                y_label="token position", bar=rms_bar))
        charts.append("".join(parts))
    if not charts:
        return ""
    return '<section id="localization"><h2>Localization</h2>' + "".join(charts) + "</section>"


def _kill_matrix(mutations: Sequence[Mapping[str, Any]]) -> str:
    if not mutations:
        return ""
    checks = sorted({c for m in mutations for c in (*m["killers"], *m["expected_killers"])})
    head = "".join(f'<th class="small">{_e(c)}</th>' for c in checks)
    rows = []
    for m in mutations:
        cells = []
        for c in checks:
            killed, expected = c in m["killers"], c in m["expected_killers"]
            # ● expected and killed, ○ expected but stayed green, + killed though not listed.
            mark = "●" if killed and expected else ("○" if expected else ("+" if killed else ""))
            cells.append(f'<td title="{_e(c)}">{mark}</td>')
        preset = f' <span class="small">({_e(m["preset"])})</span>' if m.get("preset") else ""
        rows.append(f'<tr><td class="mid"><code>{_e(m["id"])}</code>{preset}'
                    f'<div class="small">{_e(m["fault"])}</div></td>'
                    f'<td class="mid small">{_e(m["target"])}</td><td>{_status(m["status"])}</td>{"".join(cells)}</tr>')
    legend = '<p class="small">● expected killer went red · ○ expected killer stayed green · + unexpected killer</p>'
    return (f'<section id="mutations"><h2>Kill matrix</h2>{legend}<table class="km"><tr><th>mutant</th><th>target'
            f'</th><th>status</th>{head}</tr>{"".join(rows)}</table></section>')


def _environment(run: Mapping[str, Any]) -> str:
    env = run["environment"]
    env_rows = "".join(f"<tr><th>{_e(k)}</th><td><code>{_e(v)}</code></td></tr>" for k, v in env.items())
    env_table = f"<table>{env_rows}</table>" if env else '<p class="small">no K3V_ variables were set</p>'
    oracle = json.dumps(run["oracle"], indent=2, sort_keys=True) if run["oracle"] else "(none recorded)"
    return (f'<section id="environment"><h2>Environment</h2><h3>K3V_ variables</h3>{env_table}'
            f"<h3>Oracle pins</h3><pre>{_e(oracle)}</pre></section>")


def render_html(data: Mapping[str, Any]) -> str:
    """The whole report as one HTML string (data is a validated report dict)."""
    verdict = data["summary"]["verdict"].upper()
    body = "".join([
        _banner(data), "<main>", accepted_section(data["run"]), explanation_section(data["run"]),
        _results_section(data["results"]), _bars_section(data["results"]),
        _charts_section(data["results"]), quantization_section(data["run"]),
        _kill_matrix(data.get("mutations") or []), endpoint_section(data["run"]), _run_table(data["run"]),
        _environment(data["run"]),
        "</main>",
    ])
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>k3verify {verdict}</title>'
            f'<meta name="viewport" content="width=device-width"><style>{_CSS}</style></head>'
            f"<body>{body}</body></html>\n")
