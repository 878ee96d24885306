"""builders.make_room on a card short of memory: cached models dropped oldest first, the served model last, until
the new model fits with its headroom; the running check's result says which (the card's memory faked: CPU only)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from k3verify.gates.core.check import CheckContext
from k3verify.gates.shared import builders, card_room
from k3verify.target import resolve_target

GIB = 1 << 30


def _ctx(cache: dict[str, Any]) -> CheckContext:
    return CheckContext(resolve_target("kl-tiny"), torch.device("cuda"), 0, torch.Generator(), "quick", cache, None,
                        dtype=torch.bfloat16)


@pytest.mark.parametrize("need_gib, dropped", [(0, ["oracle.k3.float32"]),
                                               (9, ["oracle.k3.float32", "oracle.hf.float32",
                                                    "serving.model.bfloat16.cached"])])
def test_cached_models_are_dropped_oldest_first_and_the_served_one_last(
        monkeypatch: pytest.MonkeyPatch, need_gib: int, dropped: list[str]) -> None:
    cache: dict[str, Any] = {"serving.model.bfloat16.cached": nn.Linear(1, 1), "oracle.k3.float32": nn.Linear(1, 1),
                             "tensors": {"a": torch.zeros(1)}, "oracle.hf.float32": nn.Linear(1, 1)}
    models = ["serving.model.bfloat16.cached", "oracle.k3.float32", "oracle.hf.float32"]
    # each cached model holds 2 GiB of a card with 2 GiB free besides them; the new model needs 4 GiB more
    monkeypatch.setattr(card_room, "free_bytes", lambda device: (2 + 2 * (3 - sum(k in cache for k in models))) * GIB)
    ctx = _ctx(cache)
    builders.make_room(ctx, need_gib * GIB, "a model")
    assert [k for k in models if k not in cache] == sorted(dropped, key=models.index)
    assert "tensors" in cache
    assert ctx.run_notes == [f"dropped cached {', '.join(dropped)} to build a model ({need_gib:.1f} GiB; "
                             f"{2 + 2 * len(dropped):.1f} GiB free after)"]


def test_nothing_is_dropped_where_the_model_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    cache: dict[str, Any] = {"oracle.k3.float32": nn.Linear(1, 1)}
    monkeypatch.setattr(card_room, "free_bytes", lambda device: 20 * GIB)
    ctx = _ctx(cache)
    builders.make_room(ctx, 8 * GIB, "a model")
    assert "oracle.k3.float32" in cache and ctx.run_notes == []
