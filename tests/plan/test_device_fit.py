"""GPU workflows say what does not fit before allocating: the message names both sizes and what to try; `plan`
reads the card's memory from the device and, where there is none, asks for it instead of assuming an H200."""

from __future__ import annotations

import pytest
import torch

from k3verify.cli import main
from k3verify.plan import device_fit


def test_require_fit_names_need_card_and_hint() -> None:
    device_fit.require_fit("a serving model", 79 * device_fit.GIB, 79.1, "more GPUs")
    with pytest.raises(device_fit.DoesNotFit, match=r"a serving model needs 80\.0 GiB, this card has 79\.1 GiB; "
                                                    r"try more GPUs"):
        device_fit.require_fit("a serving model", 80 * device_fit.GIB, 79.1, "more GPUs")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a CUDA device")
def test_plan_without_a_card_asks_for_its_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "kl-tiny", "--context", "4096"]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert main(["plan", "--preset", "kl-tiny", "--context", "4096", "--gpu-memory-gib", "79.1"]) == 0
    assert "fits 79.1 GiB" in capsys.readouterr().out


def test_the_card_cap_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """K3V_CARD_GIB runs a larger card as a smaller one: a positive number of GiB, else an error naming the value."""
    monkeypatch.delenv(device_fit.CARD_ENV, raising=False)
    assert device_fit.card_cap_gib() is None
    monkeypatch.setenv(device_fit.CARD_ENV, "79.1")
    assert device_fit.card_cap_gib() == 79.1
    for bad in ("80GB", "0", "-1"):
        monkeypatch.setenv(device_fit.CARD_ENV, bad)
        with pytest.raises(ValueError, match=repr(bad)):
            device_fit.card_cap_gib()
