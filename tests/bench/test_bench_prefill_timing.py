"""time_prefill: both sides warmed up, then timed in alternation (drift of the machine lands on both), medians
compared, the spread of each side reported."""

from __future__ import annotations

from k3verify.bench.speeds import time_prefill


def test_prefill_sides_alternate_and_ratios_come_from_medians() -> None:
    calls: list[str] = []

    def side(name: str) -> object:
        return lambda: calls.append(name)

    row = time_prefill(side("ours"), side("theirs"), 1024, rounds=5)
    warm, timed = calls[:6], calls[6:]
    assert warm == ["ours"] * 3 + ["theirs"] * 3, warm  # two warm-ups and one untimed call per side
    assert timed == ["ours", "theirs"] * 5, timed
    assert row["rounds"] == 5 and row["ratio"] > 0 and row["ours_spread"] >= 0 and row["baseline_spread"] >= 0
    assert abs(row["baseline_tok_s"] / row["ours_tok_s"] * row["ratio"] - 1) < 1e-9


def test_prefill_without_a_baseline_times_ours_alone() -> None:
    calls: list[str] = []
    row = time_prefill(lambda: calls.append("ours"), None, 512, rounds=3)
    assert calls == ["ours"] * 6 and "ratio" not in row and row["tokens"] == 512
