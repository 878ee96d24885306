"""The dist.* controls fit the layout they run under: a mis-sliced load moves split tensors' rows under tensor
parallelism and deals every rank the wrong experts under expert parallelism, so that no layout's control equals
its candidate; a layout that splits nothing has no such control (the checks that need one skip)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from k3verify.gates.shared.dist_session import mis_sliced_read, splits_anything
from k3verify.presets import get_preset
from k3verify.serving.parallel import Comm, ParallelLayout, ParallelServingModel
from k3verify.serving.parallel.shards import load_rank
from k3verify.target import resolve_target


def _loaded(layout: ParallelLayout, mis_sliced: bool) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The rank's parameters, and the names of those its layout cuts along a dim."""
    target = resolve_target("kl-tiny")
    model = ParallelServingModel(target.cfg, Comm(layout, planning=True), torch.float32)
    read = mis_sliced_read(target.cfg, layout) if mis_sliced else None
    specs = load_rank(model, target.cfg, layout, target.weights(), **({"read": read} if read else {}))
    return model.state_dict(), {name for name, spec in specs.items() if spec.dim is not None}


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 1), (2, 2)])
def test_a_mis_sliced_load_differs_where_the_layout_splits(tp: int, ep: int) -> None:
    """Every routed expert's weights differ from the right load exactly when experts are split, and every
    tensor-split parameter's exactly when heads/columns are; a parameter neither splits loads as it should."""
    for rank in range(2):
        layout = ParallelLayout(tp, ep, rank)
        (right, split), (wrong, _) = _loaded(layout, False), _loaded(layout, True)
        for name, value in right.items():
            expert = ".experts." in name
            moved = (expert and ep > 1) or name in split
            assert moved != torch.equal(value, wrong[name]), f"{name} at tp={tp} ep={ep} rank {rank}"
        assert any(".experts." in n for n in right) and (tp == 1 or split)


def test_only_a_layout_that_splits_something_can_be_mis_sliced() -> None:
    """tp > 1 always cuts the vocabulary; ep > 1 deals experts out only when the model has MoE layers."""
    cfg = get_preset("kl-tiny")
    dense = replace(cfg, first_k_dense_replace=cfg.num_hidden_layers)
    assert splits_anything(cfg, ParallelLayout(2, 1)) and splits_anything(cfg, ParallelLayout(1, 2))
    assert splits_anything(dense, ParallelLayout(2, 2)) and not splits_anything(dense, ParallelLayout(1, 2))
