"""The grouped MoE combine's Triton tail (kernels/moe/tail_kernel.py): under the interpreter against the torch
tail it replaces and a per-pair loop written here, controls that must fail, and on CUDA the combine taking it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_interp import broken_variant, child_report  # tests/kernels, on sys.path for pytest and the child

from k3verify.kernels.moe import grouped

# (T, k, D): one token; ragged columns past one 512 block; a kl-48b row width (2304) over 33 tokens
SHAPES = {"t1": (1, 8, 64), "ragged": (7, 3, 1000), "kl48b": (33, 8, 2304)}
BROKEN = {  # controls: the kernel's own source with one fault
    "route_weight_dropped": ("* tl.load(w_ptr + pair)", "* 1.0"),
    "rows_not_unsorted": ("row = tl.load(inv_ptr + pair).to(tl.int64)", "row = pair"),
    "first_route_only": ("tl.static_range(TOP_K)", "tl.static_range(1)"),
    "last_block_dropped": ("live = cols < D", "live = cols < (D // BLOCK_D) * BLOCK_D"),
}


def _case(T: int, k: int, D: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Expert outputs in sorted order, the sort (sorted position -> pair), sigmoid top-k route weights."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randn(T, 4 * k, generator=g).topk(k, dim=1).indices
    order = torch.argsort(idx.reshape(-1), stable=True)
    y = torch.randn(T * k, D, generator=g).bfloat16()
    weights = torch.randn(T, k, generator=g).sigmoid()
    return tuple(t.to(device) for t in (y, order, weights))


def loop_reference(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    T, k = weights.shape
    where = {int(p): i for i, p in enumerate(order)}  # pair -> sorted row
    out = torch.zeros(T, y.shape[1], dtype=torch.float32)
    for t in range(T):
        for j in range(k):
            out[t] += y[where[t * k + j]].float() * weights[t, j]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _poisoned(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """An output buffer of NaN: an element the kernel leaves unwritten shows."""
    return torch.full((weights.shape[0], y.shape[1]), float("nan"), device=y.device)


def _interpreter_report(tmp: str) -> dict[str, Any]:
    """Runs in the subprocess (TRITON_INTERPRET=1): the kernel and its broken variants vs the torch tail."""
    from triton_interp import patch_interpreter

    patch_interpreter()
    from k3verify.kernels.moe import tail_kernel

    report: dict[str, Any] = {"cases": {}, "broken": {}}
    for name, dims in SHAPES.items():
        case = _case(*dims, seed=len(report["cases"]))
        got = grouped.sorted_sum_triton(*case, mod=tail_kernel, out=_poisoned(case[0], case[2]))
        report["cases"][name] = {"vs_torch_tail": _rel(got, grouped.sorted_sum_torch(*case)),
                                 "vs_loop": _rel(got, loop_reference(*case))}
    case = _case(*SHAPES["ragged"], seed=99)
    for name, (old, new) in BROKEN.items():
        module = broken_variant(tail_kernel, name, old, new, tmp)
        got = grouped.sorted_sum_triton(*case, mod=module, out=_poisoned(case[0], case[2]))
        report["broken"][name] = _rel(got, grouped.sorted_sum_torch(*case))
    return report


@pytest.fixture(scope="module")
def interpreter_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("triton", reason="triton is not installed: the interpreter test needs it")
    return child_report("test_kernels_moe_tail", "_interpreter_report", str(tmp_path_factory.mktemp("moe_tail")))


def test_tail_kernel_matches_the_torch_tail_and_the_loop_under_interpreter(interpreter_report: dict[str, Any]) -> None:
    """Both sum each token's k fp32 products in route order: measured equal here (0) at every shape, into a
    NaN-filled buffer (every element written)."""
    for name, r in interpreter_report["cases"].items():
        assert r["vs_torch_tail"] <= 1e-6 and r["vs_loop"] <= 1e-6, (name, r)


def test_interpreter_comparison_catches_broken_tail_kernels(interpreter_report: dict[str, Any]) -> None:
    """Controls: the route weight dropped, rows read in sorted order instead of each pair's own, only the first
    route summed and the last (ragged) column block left unwritten (its NaN shows) all fail the same comparison
    (NaN fails `<=`)."""
    assert set(interpreter_report["broken"]) == set(BROKEN)
    for name, rel in interpreter_report["broken"].items():
        assert not rel <= 1e-2, (name, rel)


def test_cpu_tensors_take_the_torch_tail_and_refusals_name_the_operand() -> None:
    y, order, weights = _case(*SHAPES["ragged"], seed=3)
    assert torch.equal(grouped.sorted_sum(y, order, weights), grouped.sorted_sum_torch(y, order, weights))
    assert grouped.tail_refusal(y, order, weights) is None
    assert "[T*k, D]" in str(grouped.tail_refusal(y[:-1], order, weights))
    assert "[T*k, D]" in str(grouped.tail_refusal(y.t(), order, weights))
    assert "bfloat16" in str(grouped.tail_refusal(y, order, weights.bfloat16()))
    with pytest.raises(ValueError, match="tail kernel: expert outputs"):
        grouped.sorted_sum_triton(y[:-1], order, weights)


@pytest.mark.gpu
def test_cuda_tail_vs_torch_tail_and_the_combine_takes_it() -> None:
    """On CUDA at a kl-48b 8k-token prefill's size: the Triton tail against the torch tail (the compiled sum may fuse
    multiply and add: ~1e-7), and the grouped combine runs it without a refusal."""
    from k3verify.kernels.registry import REGISTRY

    case = _case(8192, 8, 2304, seed=5, device="cuda")
    assert _rel(grouped.sorted_sum_triton(*case), grouped.sorted_sum_torch(*case)) < 1e-5
    before = dict(REGISTRY.fallbacks)
    grouped.sorted_sum(*case)
    assert dict(REGISTRY.fallbacks) == before and grouped.REGISTRY.broken_inside(grouped.OP, grouped.TAIL) is None
