"""The README results table, rendered from `k3verify bench --json` output (no GPU needed)."""

from __future__ import annotations

from typing import Any


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _baseline_cells(r: dict[str, Any]) -> tuple[str, str]:
    """(baseline tok/s, ratio): the baseline's generate, else our own eager decode (K3: no baseline runs it)."""
    if r.get("baseline_tok_s") is not None:
        return f"{r['baseline_tok_s']:,.0f} tok/s", f"{r['ratio']:.2f}x"
    if r.get("eager_tok_s") is not None:
        return f"our eager decode {r['eager_tok_s']:,.0f} tok/s", f"{r['vs_eager']:.2f}x"
    return "–", "–"


def markdown_table(data: dict[str, Any]) -> str:
    """Hardware, workload, our number, the baseline's, ratio and % of the bandwidth floor per row; then the
    served rows (engine + HTTP under streaming clients) beside the bench path's decode at the same batch."""
    hw = f"{data['device_name']} (copy {data['copy_bandwidth_GBps']:,.0f} GB/s)"
    if not data.get("speeds_reported"):
        return f"No speeds for {data['preset']} on {hw}: " + "; ".join(data.get("notes", ["parity not green"]))
    baseline = data.get("baseline_name", "transformers+fla")
    rows = [f"| hardware | workload | ours | baseline ({baseline}) | ratio | % of floor |",
            "|---|---|---|---|---|---|"]
    for r in data["prefill"]:
        base, ratio = _baseline_cells(r)
        path = r.get("ours_path", "eager")
        eager = f", eager {r['ours_eager_tok_s']:,.0f}" if "ours_eager_tok_s" in r else ""
        rows.append(f"| {hw} | {data['preset']} prefill {r['tokens']:,} tokens ({path}) | {r['ours_tok_s']:,.0f} "
                    f"tok/s{eager} | {base} | {ratio} | – |")
    for r in data["decode"]:
        base, ratio = _baseline_cells(r)
        rows.append(f"| {hw} | {data['preset']} decode batch {r['batch']} | {r['ours_tok_s']:,.0f} tok/s "
                    f"({r['ours_step_ms']:.2f} ms/step) | {base} | {ratio} | {100 * r['fraction_of_floor']:.0f}% "
                    f"(floor {r['floor_step_ms']:.2f} ms) |")
    out = "\n".join(rows)
    served = data.get("served") or []
    if served:
        srows = ["| served (engine + HTTP) | tok/s | bench path tok/s | served / bench | TTFT p50 / p99 | "
                 "ITL p50 / p99 | untimed warm-up wave: wall, TTFT p99 |", "|---|---|---|---|---|---|---|"]
        for r in served:
            w = r.get("warmup")
            warm = f"{w['wall_s']:.2f} s, {w['ttft_p99_ms']:.1f} ms" if w else "none (older run)"
            procs = r.get("client_processes")
            where = f" in {procs} client process{'es' if procs > 1 else ''}" if procs else ""
            server = f", server {r['server']}" if r.get("server") else ""
            if r.get("server_layout"):
                server += " in its own process" if r["server_layout"] == "api_process" else " in the engine's process"
            srows.append(f"| {data['preset']}, {r['concurrency']} streaming clients{where}, {r['requests']} requests"
                         f"{server} | "
                         f"{r['tok_s']:,.0f} | {_num(r.get('bench_tok_s'), ',.0f')} | "
                         f"{_num(r.get('served_over_bench'), '.2f')} | {r['ttft_p50_ms']:.1f} / "
                         f"{r['ttft_p99_ms']:.1f} ms | {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} ms | {warm} |")
        out += "\n\n" + "\n".join(srows)
    passed = ", ".join(f"{p['id']} {p['status']}" for p in data["parity"])
    return out + f"\n\nParity in the same run: {passed}."
