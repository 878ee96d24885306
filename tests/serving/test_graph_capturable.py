"""What CUDA-graph capture needs, proven on CPU: the decode step performs no host synchronisation
(.item()/.tolist()/bincount-size syncs all fail on the meta device, so a meta-device run is the
detector), and the grouped-GEMM MoE path that makes it so computes what the reference loop does."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.gates import Kind, compare
from k3verify.kernels.moe import COMBINE
from k3verify.kernels.registry import CUDA, REGISTRY
from k3verify.presets import get_preset
from k3verify.serving.batch import PackedBatch
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.model import ServingModel


def _meta_step(preset: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    model = ServingModel(get_preset(preset), dtype, "meta")
    model.allocate_caches(32, 16, 4)
    dec = GraphDecoder(model, 128, buckets=(4,), use_graphs=False)
    return dec.decode([1, 2, 3], [1, 2, 3], [[1], [2], [3]], [5, 6, 7])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny", "k3-syn-25"])
def test_decode_step_has_no_host_sync(preset: str, dtype: torch.dtype, cuda_moe_combine: None) -> None:
    """bf16 runs the grouped GEMMs, fp32 the per-pair gather: both capturable. (On the H200, fp32 on CUDA fell
    back to the reference loop, whose bincount().tolist() broke every capture of an fp32 engine.)"""
    out = _meta_step(preset, dtype)
    assert out.device.type == "meta" and out.shape == (3, get_preset(preset).vocab_size)


def test_the_meta_detector_bites_on_the_reference_moe_loop() -> None:
    """Control: the reference combine sizes its loop on the host (bincount().tolist()): it cannot run."""
    with pytest.raises((NotImplementedError, RuntimeError)):
        _meta_step("k3-tiny")


@pytest.mark.parametrize(("dtype", "bar"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_capturable_moe_matches_the_reference_loop(preset: str, dtype: torch.dtype, bar: float) -> None:
    """Logits of a packed prefill, the CUDA combine vs the loop on the same weights: bf16 runs the grouped GEMMs,
    fp32 the per-pair gather (same products, other GEMM / summation order: RMS, never bit-exact; the fp32 bar far
    below a whole model's fp32 noise). Control: other tokens."""
    cfg = get_preset(preset)
    model = ServingModel(cfg, dtype, "cpu").load(synthetic_tensors(cfg))
    ids = torch.randint(0, 4000, (40,), generator=torch.Generator().manual_seed(3))
    batch = PackedBatch.build(ids, [17, 23])
    ref = model.prefill(batch, all_logits=True).all_logits
    REGISTRY.force(COMBINE, CUDA)
    try:
        cand = model.prefill(batch, all_logits=True).all_logits
        assert REGISTRY.last_backend[COMBINE] == CUDA
    finally:
        REGISTRY.force(COMBINE, None)
    assert compare(Kind.RMS, ref, cand, bar).passed
    wrong = model.prefill(PackedBatch.build(ids.flip(0), [17, 23]), all_logits=True).all_logits
    assert not compare(Kind.RMS, ref, wrong, bar).passed


def test_gather_path_refuses_past_its_memory_budget() -> None:
    """A batch whose gathered expert weights would pass 1 GiB is refused with the numbers (then the registry
    falls back to the loop, and a graph capture of it falls back to eager: both logged)."""
    from k3verify.kernels.moe import grouped

    class Moe:
        intermediate_size = 1024

    x = torch.zeros(64, 2304)
    idx = torch.zeros(64, 8, dtype=torch.long)
    reason = grouped.accepts(Moe(), x, torch.zeros(64, 8), idx)
    assert reason is not None and "up to 37 (token, expert) pairs" in reason  # 1 GiB / (3 x 1024 x 2304 x 4 B)
    assert grouped.accepts(Moe(), x[:32], torch.zeros(32, 8), idx[:32]) == reason  # one message: warned once
    assert grouped.accepts(Moe(), x[:4], torch.zeros(4, 8), idx[:4]) is None  # 32 pairs fit


_ATOMIC_FLOAT_OPS = ("index_add", "scatter_add", "scatter_reduce", "index_reduce", "_index_put_impl_", "put_")


class _AtomicFloatOps(TorchDispatchMode):
    """Records ops that accumulate floats through atomics on CUDA (order-dependent results)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        accumulate = name != "_index_put_impl_" or bool(kwargs.get("accumulate", args[3] if len(args) > 3 else False))
        if name.rstrip("_") in {n.rstrip("_") for n in _ATOMIC_FLOAT_OPS} and accumulate:
            if isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                self.seen.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_decode_step_is_deterministic_by_construction(preset: str, cuda_moe_combine: None) -> None:
    """A graph replay must equal the same step run eagerly bit for bit, so the step may not add floats
    with atomics (their order varies run to run on a GPU). The H200 showed it: index_add_ in the MoE
    combine made replay-vs-eager differ at batch 16 and 64."""
    with _AtomicFloatOps() as mode:
        _meta_step(preset)
    assert mode.seen == []


def test_the_atomic_float_detector_bites() -> None:
    """Control: a float index_add_ (what the combine used to do) is flagged."""
    with _AtomicFloatOps() as mode:
        torch.zeros(3, 2, device="meta").index_add_(0, torch.tensor([0, 0], device="meta"),
                                                   torch.ones(2, 2, device="meta"))
    assert mode.seen == ["index_add_"]
