"""A decode bucket whose CUDA-graph capture fails decodes eagerly, with one logged warning naming the reason,
instead of ending the engine. Shown on CPU by a recorder that raises as torch does when a captured op copies
from pageable host memory (the H200 error of an fp32 engine before its MoE got a capturable path)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving import graphs as graphs_mod
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.model import ServingModel

CAPTURE_ERROR = "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned."


def _decode(dec: GraphDecoder) -> torch.Tensor:
    """One decode step of 3 sequences from zeroed caches (each call starts from the same state)."""
    kv, pool = dec.model.kv_cache, dec.model.state_pool
    assert kv is not None and pool is not None
    kv.data.zero_()
    for t in pool.tensors().values():
        t.zero_()
    return dec.decode([1, 2, 3], [1, 2, 3], [[1], [2], [3]], [5, 6, 7])


def test_failed_capture_decodes_eagerly_and_warns_once(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    cfg = get_preset("k3-tiny")
    model = ServingModel(cfg, torch.float32, "cpu").load(synthetic_tensors(cfg))
    model.allocate_caches(32, 16, 4)
    want = _decode(GraphDecoder(model, 128, buckets=(4,), use_graphs=False))
    calls = []

    def failing_recorder(step: object) -> object:
        calls.append(step)
        raise RuntimeError(CAPTURE_ERROR)

    monkeypatch.setattr(graphs_mod, "cuda_graph_recorder", failing_recorder)
    dec = GraphDecoder(model, 128, buckets=(4,), use_graphs=False)
    dec.use_graphs = True  # as on a CUDA model: the capture is attempted (and fails)
    with caplog.at_level(logging.WARNING, logger="k3verify.graphs"):
        first, second = _decode(dec), _decode(dec)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert len(calls) == 1, "a bucket whose capture failed must not be re-captured every step"
    assert dec.captures == 0 and dec.eager_buckets == {4: f"RuntimeError: {CAPTURE_ERROR}"}
    warned = [r.getMessage() for r in caplog.records if "capture of decode bucket 4 failed" in r.getMessage()]
    assert len(warned) == 1 and CAPTURE_ERROR in warned[0]
    assert dec.replay_stale(3) is None  # no graph: the stale-replay control has nothing to replay


def test_a_capture_that_works_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: with a recorder that succeeds, the bucket is captured and never marked eager."""
    cfg = get_preset("k3-tiny")
    model = ServingModel(cfg, torch.float32, "cpu").load(synthetic_tensors(cfg))
    model.allocate_caches(32, 16, 4)

    class Replay:
        def __init__(self, step: Callable[[], torch.Tensor]) -> None:
            self.step, self.out = step, step()

        def replay(self) -> None:
            self.out.copy_(self.step())

    def recorder(step: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        r = Replay(step)
        return r, r.out

    monkeypatch.setattr(graphs_mod, "cuda_graph_recorder", recorder)
    dec = GraphDecoder(model, 128, buckets=(4,), use_graphs=False)
    dec.use_graphs = True
    _decode(dec)
    assert dec.captures == 1 and dec.eager_buckets == {}
