"""`k3verify parity --tp N --ep M`: the flags select the dist.* checks, a bad layout is a usage error, and a
layout the model cannot take skips them with the reason (no world is spawned)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3verify.cli import main
from k3verify.commands.parity import choose_checks


def test_tp_ep_flags_add_the_dist_checks_to_the_quick_suite() -> None:
    ids = [c.id for c in choose_checks("quick", [], (2, 2))]
    assert {"dist.tp.logits", "dist.ep.logits", "dist.layout.logits", "dist.greedy", "dist.ep.empty_rank",
            "dist.weights.slices"} <= set(ids)
    assert any(not i.startswith("dist.") for i in ids), "the quick suite itself still runs"
    assert not any(c.id.startswith("dist.") for c in choose_checks("quick", [], None))
    only = [c.id for c in choose_checks("quick", ["dist.greedy"], (2, 2))]
    assert only == ["dist.greedy"]


@pytest.mark.parametrize(("flags", "message"), [(["--tp", "2", "--ep", "3"], "each degree must be 1 or the world"),
                                                (["--tp", "0"], "--tp must be >= 1"),
                                                (["--tp", "1"], "a world of one rank")])
def test_a_bad_layout_is_a_usage_error(flags: list[str], message: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", *flags, "--report-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_a_layout_the_model_cannot_take_skips_with_the_reason(tmp_path: Path) -> None:
    """k3-tiny has 3 KDA heads: world 4 cannot split them, so every dist.* check is skipped naming that."""
    rc = main(["parity", "--preset", "k3-tiny", "--tp", "4", "--ep", "4", "--only", "dist",
               "--report-dir", str(tmp_path)])
    results = json.loads((tmp_path / "report.json").read_text())["results"]
    assert rc == 4  # an all-skipped run proves nothing: verdict inconclusive
    assert {r["status"] for r in results} == {"skipped"}
    assert all("KDA heads) = 3 cannot be split over 4 ranks" in r["reason"] for r in results)
