"""`k3verify bench --context`: on the CPU a tiny preset runs the whole logic (engine-chunked prefill, decode steps,
parity against the streamed fp32 gold, the table and --json); a plan too big for the card is refused in sizes before
anything is allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3verify.bench import long_context
from k3verify.bench.long_context import LongContextPlan, parity_row, require_long_context_fits
from k3verify.cli import main
from k3verify.plan.device_fit import DoesNotFit
from k3verify.presets import get_preset

ARGV = ["bench", "--preset", "kl-tiny", "--context", "256", "--segment", "128", "--decode-steps", "2",
        "--parity-base", "64", "--device", "cpu"]


def test_long_context_on_cpu_prints_its_table_and_writes_json(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Two chunks of 128 as the engine's scheduler cuts them, parity within 2x the 64-token distance, its control
    (one row off) far outside; the CUDA-only parts say so."""
    assert main([*ARGV, "--json", str(tmp_path / "lc.json")]) == 0
    out = capsys.readouterr().out
    assert "| 256 |" in out and "memory audit per layer kind: CUDA-only" in out
    data = json.loads((tmp_path / "lc.json").read_text())
    assert data["passed"] and [r["context"] for r in data["rows"]] == [64, 256]
    row = data["rows"][1]
    assert row["prefill_chunks"] == 2 and row["parity"]["positions"] == 2 + 2
    assert row["parity"]["status"] == "pass" and row["parity"]["control_metric"] > 10 * row["parity"]["bar"]
    assert "peak_bytes" not in row and "streamed gold" in row["gold"]


def test_long_context_parity_fails_when_our_prefill_chunks_lose_their_offset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The detector bites: each chunk after the first prefilled as a fresh sequence (its cached prefix dropped)."""
    real = long_context.engine_prefill

    def restarting(runner, ids, segment, extra, on_chunk=lambda: None):  # type: ignore[no-untyped-def]
        out = {}
        for a in range(0, len(ids), segment):
            runner.release(long_context.SEQ) if a else None
            out.update({a + p: v for p, v in real(runner, ids[a:a + segment], segment, extra).items()})
        return out
    monkeypatch.setattr(long_context, "engine_prefill", restarting)
    assert main(ARGV) == 1


def test_parity_row_needs_its_control_to_fail() -> None:
    """Rows that do not differ from one position to the next cannot show a position mix-up: vacuous, not pass."""
    gold = torch.randn(4, 32)
    assert parity_row(gold + 1e-3 * torch.randn(4, 32), gold, 0.01)["status"] == "pass"
    same = torch.randn(1, 32).expand(4, 32).clone()
    assert parity_row(same, same, 0.01)["status"] == "vacuous"


def test_long_context_is_refused_in_sizes_before_allocating() -> None:
    """kl-48b-8l at 128K needs about 34 GiB: fits an 80 GB H100 (79.1 GiB), not a 30 GiB card, which is told in
    sizes before anything runs."""
    plan = LongContextPlan("kl-48b-8l", (32768, 131072))
    with pytest.raises(DoesNotFit, match=r"bench --context 131072 .* needs (3\d\.\d) GiB, this card has 30\.0 GiB; "
                                         r"try a shorter --context") as err:
        require_long_context_fits(get_preset("kl-48b-8l"), plan, torch.device("cpu"), 30.0)
    assert float(str(err.value).split(" needs ")[1].split(" GiB")[0]) < 79.1
