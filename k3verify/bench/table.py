"""The README results table, rendered from `k3verify bench --json` output (no GPU needed)."""

from __future__ import annotations

from typing import Any


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown_table(data: dict[str, Any]) -> str:
    """Hardware, workload, our number, the baseline's, ratio and % of the bandwidth floor per row."""
    hw = f"{data['device_name']} (copy {data['copy_bandwidth_GBps']:,.0f} GB/s)"
    if not data.get("speeds_reported"):
        return f"No speeds for {data['preset']} on {hw}: " + "; ".join(data.get("notes", ["parity not green"]))
    rows = ["| hardware | workload | ours | baseline (transformers+fla) | ratio | % of floor |",
            "|---|---|---|---|---|---|"]
    for r in data["prefill"]:
        rows.append(f"| {hw} | {data['preset']} prefill {r['tokens']:,} tokens | {r['ours_tok_s']:,.0f} tok/s | "
                    f"{_num(r.get('baseline_tok_s'), ',.0f')} tok/s | {_num(r.get('ratio'), '.2f')}x | – |")
    for r in data["decode"]:
        rows.append(f"| {hw} | {data['preset']} decode batch {r['batch']} | {r['ours_tok_s']:,.0f} tok/s "
                    f"({r['ours_step_ms']:.2f} ms/step) | {_num(r.get('baseline_tok_s'), ',.0f')} tok/s | "
                    f"{_num(r.get('ratio'), '.2f')}x | {100 * r['fraction_of_floor']:.0f}% "
                    f"(floor {r['floor_step_ms']:.2f} ms) |")
    passed = ", ".join(f"{p['id']} {p['status']}" for p in data["parity"])
    return "\n".join(rows) + f"\n\nParity in the same run: {passed}."
