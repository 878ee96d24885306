"""The KDA short convs of a packed prefill (conv.causal_qkv): the Triton kernel under the interpreter vs the torch
gather conv (outputs and final windows; fresh and continuing sequences, sequences shorter than the window, the
fused GEMM's column slices), controls that must fail, the refusal reasons, and the layer's wiring."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_interp import broken_variant, child_report  # tests/kernels, on sys.path for pytest and the child

from k3verify.kernels import conv as conv_ops
from k3verify.kernels.conv import conv_launch, torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON
from k3verify.serving.batch import PackedBatch

LENS = [5, 1, 2, 9, 3, 17]  # 1 and 2 are shorter than a width-4 window: the final window reaches into the old one
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _case(dtype: torch.dtype, D: int, W: int, with_init: bool, seed: int = 0
          ) -> tuple[QKV, QKV, PackedBatch, QKV | None]:
    """q/k/v as column slices of one wider projection (the layer's fused GEMM), weights, the pack, initial windows."""
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    batch = PackedBatch.build(torch.zeros(T, dtype=torch.long), LENS)
    wide = torch.cat([torch.randn(T, 3 * D, generator=g), torch.full((T, 5), 1e30)], dim=1).to(dtype)
    xs = (wide[:, :D], wide[:, D:2 * D], wide[:, 2 * D:3 * D])
    weights = tuple((torch.randn(D, W, generator=g) * 0.5).to(dtype) for _ in range(3))
    inits = tuple(torch.randn(len(LENS), D, W - 1, generator=g).to(dtype) for _ in range(3)) if with_init else None
    return xs, weights, batch, inits  # type: ignore[return-value]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    bits = torch.int32 if a.element_size() == 4 else torch.int16
    big = 1 << (8 * a.element_size() - 1)

    def ordinal(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, -(i + big), i)
    return (ordinal(a) - ordinal(b)).abs()


def _compare(launch: Any, dtype: torch.dtype, W: int, D: int, with_init: bool) -> dict[str, float]:
    xs, weights, b, inits = _case(dtype, D, W, with_init, seed=W * 1000 + D + with_init)
    ry, rf = torch_ref.causal_conv_qkv_torch(xs, weights, b.seg_ids, b.local_pos, b.cu_seqlens, inits)
    ty, tf = launch(xs, weights, b.seg_ids, b.local_pos, b.cu_seqlens, inits)
    ulps = torch.stack([_ulps(a, c) for a, c in zip(ty, ry, strict=True)])
    return {"max_ulp": float(ulps.max().item()), "frac_diff": (ulps > 0).float().mean().item(),
            "windows_equal": float(all(torch.equal(a, c) for a, c in zip(tf, rf, strict=True)))}


INTERP_CASES = [(dt, W, D, init) for dt in ("bfloat16", "float32") for W in (3, 4) for D in (16, 72)
                for init in (False, True)]
BROKEN = {  # controls: the kernel's own source with one fault, compared the same way
    "leaks_across_sequences": ("inside = pos >= shift", "inside = t >= shift"),
    "initial_window_ignored": ("tap = tl.where(inside, tap, old)", "tap = tl.where(inside, tap, old * 0.0)"),
    "final_window_off_by_one": ("rel = tl.zeros_like(d) + (length - (W - 1) + j)",
                                "rel = tl.zeros_like(d) + (length - W + j)"),
}


def _interpreter_report(tmp: str) -> dict[str, Any]:
    """Runs in the subprocess (TRITON_INTERPRET=1): the kernel and its broken variants vs the torch reference."""
    from triton_interp import patch_interpreter

    patch_interpreter()
    from k3verify.kernels.conv import prefill_kernel

    report: dict[str, Any] = {"cases": {}, "broken": {}}
    for dt, W, D, init in INTERP_CASES:
        report["cases"][f"{dt}-W{W}-D{D}-init{int(init)}"] = _compare(prefill_kernel.causal_conv_qkv_triton,
                                                                     getattr(torch, dt), W, D, init)
    for name, (old, new) in BROKEN.items():
        module = broken_variant(prefill_kernel, name, old, new, tmp)
        report["broken"][name] = _compare(module.causal_conv_qkv_triton, torch.bfloat16, 4, 72, True)
    return report


@pytest.fixture(scope="module")
def interpreter_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("triton", reason="triton is not installed: the interpreter test needs it")
    return child_report("test_kernels_conv_prefill", "_interpreter_report",
                        str(tmp_path_factory.mktemp("conv_prefill_interp")))


def test_triton_prefill_conv_matches_torch_under_interpreter(interpreter_report: dict[str, Any]) -> None:
    """Measured here: bf16 bit-exact (0 ulp) in every case, fresh and continuing; fp32 within 2 ulps (silu's
    exp); final windows bit-exact, including sequences of 1 and 2 tokens whose window reaches into the old one."""
    for name, r in interpreter_report["cases"].items():
        assert r["windows_equal"] == 1.0, (name, r)
        if name.startswith("bfloat16"):
            assert r["max_ulp"] <= 1 and r["frac_diff"] < 1e-3, (name, r)
        else:
            assert r["max_ulp"] <= 8, (name, r)


def test_interpreter_comparison_catches_broken_prefill_kernels(interpreter_report: dict[str, Any]) -> None:
    """Controls: a conv reaching into the previous sequence, an ignored initial window and a final window one
    token off all fail the same comparison."""
    broken = interpreter_report["broken"]
    assert broken["leaks_across_sequences"]["frac_diff"] > 1e-2, broken
    assert broken["initial_window_ignored"]["frac_diff"] > 1e-2, broken
    assert broken["final_window_off_by_one"]["windows_equal"] == 0.0, broken


def test_prefill_refusals_name_the_reason() -> None:
    """The registry's gate: fp32, a width past the unroll, mismatched windows and CPU tensors are refused, each with
    its reason (the registry logs it and runs the torch path)."""
    xs, weights, b, inits = _case(torch.bfloat16, 16, 4, True)
    assert "float32" in str(conv_launch.accepts_prefill(
        tuple(x.float() for x in xs), weights, b.seg_ids, b.local_pos, b.cu_seqlens, inits))
    wide = tuple(torch.zeros(16, 9, dtype=torch.bfloat16) for _ in range(3))
    assert "width 9" in str(conv_launch.accepts_prefill(xs, wide, b.seg_ids, b.local_pos, b.cu_seqlens, None))
    short = tuple(t[:2] for t in inits)  # type: ignore[index]
    assert "initial windows" in str(conv_launch.accepts_prefill(xs, weights, b.seg_ids, b.local_pos, b.cu_seqlens,
                                                                short))
    assert "CUDA" in str(conv_launch.accepts_prefill(xs, weights, b.seg_ids, b.local_pos, b.cu_seqlens, inits))


def test_cpu_prefill_runs_the_torch_convs() -> None:
    """On CPU the op routes to the torch reference, which is causal_conv_varlen_torch on each of q, k, v."""
    xs, weights, b, inits = _case(torch.bfloat16, 16, 4, True)
    ys, finals = conv_ops.causal_conv_qkv(xs, weights, b.seg_ids, b.local_pos, b.cu_seqlens, inits)
    assert REGISTRY.last_backend[conv_ops.CAUSAL_QKV] == TORCH
    for x, w, init, y, f in zip(xs, weights, inits, ys, finals, strict=True):  # type: ignore[arg-type]
        ry, rf = torch_ref.causal_conv_varlen_torch(x, w, b.seg_ids, b.local_pos, b.cu_seqlens, init)
        assert torch.equal(y, ry) and torch.equal(f, rf)


@pytest.mark.gpu
def test_cuda_routes_prefill_conv_to_triton() -> None:
    """On CUDA the registry runs the Triton prefill conv for bf16: at most 1 ulp on < 0.1% of the outputs against
    the torch reference, final windows exact."""
    xs, weights, b, inits = _case(torch.bfloat16, 4096, 4, True)
    xs, weights = tuple(x.cuda() for x in xs), tuple(w.cuda() for w in weights)
    inits = tuple(t.cuda() for t in inits)  # type: ignore[union-attr]
    seg, pos, cu = b.seg_ids.cuda(), b.local_pos.cuda(), b.cu_seqlens.cuda()
    ys, fs = conv_ops.causal_conv_qkv(xs, weights, seg, pos, cu, inits)
    assert REGISTRY.last_backend[conv_ops.CAUSAL_QKV] == TRITON, REGISTRY.fallbacks[-1:]
    REGISTRY.force(conv_ops.CAUSAL_QKV, TORCH)
    try:
        ry, rf = conv_ops.causal_conv_qkv(xs, weights, seg, pos, cu, inits)
    finally:
        REGISTRY.force(conv_ops.CAUSAL_QKV, None)
    for a, c in zip(ys, ry, strict=True):
        ulps = _ulps(a, c)
        assert ulps.max().item() <= 1 and (ulps > 0).float().mean().item() < 1e-3
    assert all(torch.equal(a, c) for a, c in zip(fs, rf, strict=True))
