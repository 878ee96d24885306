"""The bounds on the rounding near-tie excuse, each shown to bite by switching it off: the window's absolute cap,
windows measured only before the oracle's two runs diverge, candidates nearest their boundary first, and the
plausibility count (oracle/rounding.py, gates/shared/endpoint_oracle.py). Synthetic ledgers: no model runs."""

from __future__ import annotations

import math

import pytest
import torch

from k3verify.gates.shared.endpoint_oracle import IMPLAUSIBLE, plausible
from k3verify.oracle import rounding
from k3verify.oracle.rounding import DOWN, INPUT, WINDOW_CAP, Ledger, clean_rows, expected_flips, near_ties

FACTOR = 5.1


def _ledgers(rows: dict[tuple[int, int, str, int], tuple[list[float], list[float]]]) -> tuple[Ledger, Ledger]:
    """(base, gold) ledgers holding these (base values, gold values) rows, each coded as it rounds."""
    base, gold = Ledger(), Ledger()
    for key, (b, g) in rows.items():
        base.rows[key], gold.rows[key] = torch.tensor(b, dtype=torch.float64), torch.tensor(g, dtype=torch.float64)
        base.codes[key], gold.codes[key] = base.rows[key].round().float(), gold.rows[key].round().float()
    return base, gold


@pytest.mark.parametrize("cap", [WINDOW_CAP, math.inf], ids=["capped", "mutant-uncapped"])
def test_no_window_reaches_past_a_thousandth_of_a_step(cap: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs 0.05 of a step apart (as where they diverged) would make a 0.26-step window: every value 0.1 from a
    boundary a "near-tie". Capped, only the value 5e-4 from its boundary is one; the uncapped mutant lists both."""
    monkeypatch.setattr(rounding, "WINDOW_CAP", cap)
    gold = [17.5005, 3.4, -9.0, 20.0]
    base, gold_ledger = _ledgers({(1, 0, INPUT, -1): ([v + (0.05 if i % 2 else -0.05) for i, v in enumerate(gold)],
                                                       gold)})
    ties = near_ties(base, gold_ledger, FACTOR)
    assert all(t.window <= WINDOW_CAP for t in ties) == (cap == WINDOW_CAP)
    assert [t.site.element for t in ties] == ([0] if cap == WINDOW_CAP else [0, 1])


def test_windows_are_measured_before_the_runs_first_diverge(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs take different codes at layer 1, token 2: from layer 1's down input on, tokens from 2 on are left
    out of the windows (their distance is a whole code step's consequence, not the arithmetic's)."""
    rows = {(1, t, INPUT, -1): ([0.2 + 1e-6 * t, 5.0], [0.2, 5.0]) for t in range(4)}
    rows[(1, 2, INPUT, -1)] = ([0.2, 5.51], [0.2, 5.49])  # codes 6 vs 5: the runs diverge here
    for t in range(4):
        far = 0.3 if t >= 2 else 1e-5  # after the divergence the runs sit far apart
        rows[(2, t, INPUT, -1)] = ([7.1 + far, 11.4996 + far], [7.1, 11.4996])
        rows[(1, t, DOWN, 0)] = ([2.1 + far, 1.0], [2.1, 1.0])
    base, gold = _ledgers(rows)
    kept = clean_rows(base, gold)
    assert sorted(k for k in kept if k[0] == 2 or k[2] == DOWN) == [(1, 0, DOWN, 0), (1, 1, DOWN, 0),
                                                                      (2, 0, INPUT, -1), (2, 1, INPUT, -1)]
    assert not any(t.site.layer == 2 for t in near_ties(base, gold, FACTOR))  # 4e-4 away, window ~5e-5
    monkeypatch.setattr(rounding, "clean_rows", lambda b, g: [k for k in g.rows if k in b.rows])  # the mutant
    assert any(t.site.layer == 2 for t in near_ties(base, gold, FACTOR))  # the runaway window lists it


def test_candidates_are_ranked_by_their_distance_from_the_boundary() -> None:
    """A value 5e-5 from its boundary under a narrow window comes before one 1e-4 away under a wide one (ranked
    by distance / window, the wide window's would come first)."""
    base, gold = _ledgers({
        (1, 0, INPUT, -1): ([3.5001 + 2e-4, 7.0 - 2e-4], [3.5001, 7.0]),  # window 5.1 x 2e-4 (capped 1e-3)
        (2, 0, INPUT, -1): ([4.50005 + 1e-5, 8.0 - 1e-5], [4.50005, 8.0]),  # window 5.1e-5
    })
    ties = near_ties(base, gold, FACTOR)
    assert [t.site.layer for t in ties] == [2, 1]
    assert ties[0].distance / ties[0].window > ties[1].distance / ties[1].window


def test_expected_flips_is_twice_the_granted_displacement_summed_over_every_rounding() -> None:
    values = [0.3 + 0.1 * i for i in range(8)]
    base, gold = _ledgers({(1, t, INPUT, -1): ([v + 1e-5 for v in values], values) for t in range(3)})
    assert expected_flips(base, gold, FACTOR) == pytest.approx(2 * FACTOR * 1e-5 * 24, rel=1e-6)
    far = {(1, t, INPUT, -1): ([v + 0.2 for v in values], values) for t in range(3)}
    assert expected_flips(*_ledgers(far), FACTOR) == pytest.approx(2 * WINDOW_CAP * 24)  # capped like the window


def test_plausible_is_the_poisson_count_a_correct_implementation_exceeds_rarely() -> None:
    assert plausible(0.0) == 0 and plausible(1e-4) == 0  # one excused rounding would already be implausible
    assert plausible(0.01) == 1 and plausible(1.0) == 5
    for expected in (0.01, 0.3, 1.0, 5.7):
        k = plausible(expected)
        tail = 1.0 - sum(math.exp(-expected) * expected ** i / math.factorial(i) for i in range(k + 1))
        below = 1.0 - sum(math.exp(-expected) * expected ** i / math.factorial(i) for i in range(k))
        assert tail <= IMPLAUSIBLE < below
