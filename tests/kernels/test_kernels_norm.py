"""kernels/norm: the torch path is the old inline math bit for bit, the Triton kernels (run by Triton's
CPU interpreter in a child process) agree with it to rounding, broken variants do not, and on CUDA the
registry runs the kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import k3verify
from k3verify.kernels import norm as norm_ops
from k3verify.kernels.norm import norm_launch, torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON
from k3verify.serving.layers.norm import GatedRMSNorm, RMSNorm

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
WIDTHS = (16, 64, 72, 96, 2304, 7168)
ROWS = (1, 3, 37)
EPS = 1e-6
RMS_DTYPES = ((BF16, BF16), (F16, F16), (BF16, F32), (F32, F32))  # (x, weight)
GATED_DTYPES = (BF16, F16, F32)  # x and gate; the gated weight is fp32, as GatedRMSNorm holds it
CHILD = Path(__file__).with_name("norm_interpreter_child.py")


def _old_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward as serving/layers/norm.py wrote it inline before kernels/norm existed."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _old_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GatedRMSNorm.forward as serving/layers/norm.py wrote it inline before kernels/norm existed."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def _rows(g: torch.Generator, R: int, W: int, dtype: torch.dtype, pad: int = 5) -> torch.Tensor:
    """[R, W] with row scales over 4.5 decades (row 0 always at 10^-3.5, where eps dominates), as a
    strided view of a NaN-filled [R, W + pad] buffer: a read past a row's end poisons the output."""
    buf = torch.full((R, W + pad), float("nan"), dtype=dtype)
    scale = 10 ** (torch.rand(R, 1, generator=g) * 4.5 - 3.5)
    scale[0] = 10**-3.5
    buf[:, :W] = (torch.randn(R, W, generator=g) * scale).to(dtype)
    return buf[:, :W]


@dataclass(frozen=True)
class Agreement:
    rel_rms: float  # RMS(c - r) / RMS(r)
    within_ulp: float  # fraction of elements with |c - r| <= one ulp of r in r's dtype
    identical: float  # fraction of bit-identical elements

    @classmethod
    def of(cls, ref: torch.Tensor, cand: torch.Tensor) -> Agreement:
        if cand.dtype != ref.dtype or cand.shape != ref.shape:
            return cls(float("inf"), 0.0, 0.0)
        bits = {BF16: 8, F16: 11, F32: 24}[ref.dtype]
        r, d = ref.double(), (cand.double() - ref.double()).abs()
        ulp = torch.ldexp(torch.ones_like(r), torch.frexp(r)[1] - bits)
        return cls(float(d.norm() / r.norm()), float((d <= ulp).double().mean()),
                   float((cand == ref).double().mean()))

    def passes(self, dtype: torch.dtype) -> bool:
        """fp32: RMS 1e-6. bf16/fp16: one ulp for 99.9%, RMS 1e-3 and bit-identical for 99%: casting before or
        after the weight multiply differs by at most one ulp, so only the identical count tells them apart."""
        if dtype == F32:
            return self.rel_rms < 1e-6  # NaN compares False: a poisoned output fails
        return self.within_ulp >= 0.999 and self.rel_rms < 1e-3 and self.identical >= 0.99


def _kernel_cases() -> tuple[dict[str, dict[str, Any]], dict[str, torch.Tensor]]:
    """(cases for the child, torch reference per case). Every width x row count x dtype pair, plus a
    [2, 3, 72] input, plus broken variants ("control.*") built from the real kernel with altered inputs."""
    g = torch.Generator().manual_seed(0)
    cases: dict[str, dict[str, Any]] = {}
    refs: dict[str, torch.Tensor] = {}
    for W in WIDTHS:
        for R in ROWS:
            for xd, wd in RMS_DTYPES:
                x, w = _rows(g, R, W, xd), torch.randn(W, generator=g).to(wd)
                name = f"rms.W{W}.R{R}.{xd}.{wd}"
                cases[name] = {"op": "rms", "x": x, "weight": w, "eps": EPS}
                refs[name] = torch_ref.rms_norm_torch(x, w, EPS)
                if R == ROWS[-1]:
                    cases[f"control.eps_omitted.{name}"] = {"op": "rms", "x": x, "weight": w, "eps": 0.0}
                    refs[f"control.eps_omitted.{name}"] = refs[name]
                    if xd == wd != F32:  # fp32 math, one cast at the end: the weight applied before the cast
                        cases[f"control.weight_before_cast.{name}"] = {"op": "rms", "x": x.float(),
                                                                       "weight": w.float(), "eps": EPS}
                        refs[f"control.weight_before_cast.{name}"] = refs[name]
            for xd in GATED_DTYPES:
                x, w = _rows(g, R, W, xd), torch.randn(W, generator=g)
                gate = (_rows(g, R, W, xd, pad=W + 3) * 1e3).clamp(-12, 12).to(xd)  # other row stride than x
                name = f"gated.W{W}.R{R}.{xd}"
                cases[name] = {"op": "gated", "x": x, "gate": gate, "weight": w, "eps": EPS}
                refs[name] = torch_ref.gated_rms_norm_torch(x, gate, w, EPS)
                if R == ROWS[-1]:
                    cases[f"control.eps_omitted.{name}"] = {**cases[name], "eps": 0.0}
                    refs[f"control.eps_omitted.{name}"] = refs[name]
    x3, w3 = torch.randn(2, 3, 72, generator=g).to(BF16), torch.randn(72, generator=g).to(BF16)
    cases["rms.leading_2x3.W72"] = {"op": "rms", "x": x3, "weight": w3, "eps": EPS}
    refs["rms.leading_2x3.W72"] = torch_ref.rms_norm_torch(x3, w3, EPS)
    return cases, refs


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{case: (torch reference, Triton output under TRITON_INTERPRET=1)}."""
    cases, refs = _kernel_cases()
    folder = tmp_path_factory.mktemp("norm_interpreter")
    torch.save(cases, folder / "cases.pt")
    root = str(Path(k3verify.__file__).resolve().parents[1])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(CHILD), str(folder / "cases.pt"), str(folder / "out.pt")],
                          env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    out = torch.load(folder / "out.pt")
    return {name: (refs[name], out[name].to(refs[name].dtype) if name.startswith("control.weight_before_cast")
                   else out[name]) for name in cases}


@pytest.mark.parametrize(("x_dtype", "w_dtype"), RMS_DTYPES)
def test_torch_path_is_the_old_inline_math_bit_for_bit(x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    """RMSNorm / GatedRMSNorm through the registry on CPU equal the formulas they replaced, bit for bit."""
    g = torch.Generator().manual_seed(1)
    for W in (7, 72, 2304):
        norm = RMSNorm(W, EPS, w_dtype)
        norm.weight.copy_(torch.randn(W, generator=g))
        x = _rows(g, 37, W, x_dtype).view(37, 1, W).expand(37, 2, W)  # 3-D, a stride-0 dim
        y = norm(x)
        assert REGISTRY.last_backend[norm_ops.RMS] == TORCH
        old = _old_rms_norm(x, norm.weight, EPS)
        assert y.dtype == old.dtype and torch.equal(y, old)
        gated = GatedRMSNorm(W, EPS)
        gated.weight.copy_(torch.randn(W, generator=g))
        gate = torch.randn(37, 2, W, generator=g).to(x_dtype) * 4
        y = gated(x, gate)
        assert REGISTRY.last_backend[norm_ops.GATED_RMS] == TORCH
        assert torch.equal(y, _old_gated_rms_norm(x, gate, gated.weight, EPS))


def test_triton_kernels_match_torch_under_the_interpreter(
        interpreted: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every width x row count x dtype: the Triton output agrees with the torch reference (see Agreement)."""
    checked = {k: v for k, v in interpreted.items() if not k.startswith("control.")}
    assert len(checked) == len(WIDTHS) * len(ROWS) * (len(RMS_DTYPES) + len(GATED_DTYPES)) + 1
    bad = {k: Agreement.of(r, c) for k, (r, c) in checked.items() if not Agreement.of(r, c).passes(r.dtype)}
    assert not bad, f"{len(bad)} of {len(checked)} cases disagree: {bad}"


def test_broken_variants_fail_the_same_comparison(interpreted: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The comparison bites: eps omitted (rows below sqrt(eps)) and the weight applied before the cast to
    x's dtype both fail it, in every width and dtype they are built for."""
    controls = {k: v for k, v in interpreted.items() if k.startswith("control.")}
    assert sum(k.startswith("control.weight_before_cast") for k in controls) == 2 * len(WIDTHS)
    survived = {k: Agreement.of(r, c) for k, (r, c) in controls.items() if Agreement.of(r, c).passes(r.dtype)}
    assert not survived, f"{len(survived)} of {len(controls)} broken variants pass the comparison: {survived}"


def test_fast_path_refusals_name_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton path refuses fp32 activations, a strided last dim, a mismatched gate or weight and a
    missing CUDA / triton, each with a reason that names the value."""
    x, w = torch.randn(4, 8, dtype=BF16), torch.ones(8, dtype=BF16)
    assert "float32 activations" in str(norm_launch.accepts_rms(x.float(), w, EPS))
    assert "last dim is not contiguous (stride 8)" in str(norm_launch.accepts_rms(x.t(), torch.ones(4), EPS))
    assert "weight must be contiguous [8]" in str(norm_launch.accepts_rms(x, torch.ones(9), EPS))
    assert "gate shape (4, 1)" in str(norm_launch.accepts_gated(x, x[:, :1], torch.ones(8), EPS))
    assert "not one CUDA device" in str(norm_launch.accepts_rms(x, w, EPS))
    if not torch.cuda.is_available():
        assert norm_launch.available() == "CUDA is not available"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(norm_launch, "_kernels", lambda: "triton norm kernels unavailable: ImportError: no triton")
    assert norm_launch.available() == "triton norm kernels unavailable: ImportError: no triton"


@pytest.mark.gpu
def test_cuda_runs_the_triton_norms() -> None:
    """On CUDA, bf16/fp16 norms route to the Triton kernels and agree with the torch path; fp32 runs torch
    with a logged reason (the fp32 gates are bit-exact against the torch path)."""
    g = torch.Generator().manual_seed(2)
    for xd, wd in ((BF16, BF16), (F16, F16), (BF16, F32)):
        for W in (72, 7168):
            x, w = _rows(g, 37, W, xd).cuda(), torch.randn(W, generator=g).to(wd).cuda()
            gate, gw = (torch.randn(37, W, generator=g) * 4).to(xd).cuda(), torch.randn(W, generator=g).cuda()
            y, yg = norm_ops.rms_norm(x, w, EPS), norm_ops.gated_rms_norm(x, gate, gw, EPS)
            assert REGISTRY.last_backend[norm_ops.RMS] == TRITON, REGISTRY.fallbacks
            assert REGISTRY.last_backend[norm_ops.GATED_RMS] == TRITON, REGISTRY.fallbacks
            for got, ref in ((y, torch_ref.rms_norm_torch(x, w, EPS)),
                             (yg, torch_ref.gated_rms_norm_torch(x, gate, gw, EPS))):
                a = Agreement.of(ref.cpu(), got.cpu())
                assert a.passes(ref.dtype), (xd, wd, W, a)
    norm_ops.rms_norm(torch.randn(3, 64, device="cuda"), torch.ones(64, device="cuda"), EPS)
    assert REGISTRY.last_backend[norm_ops.RMS] == TORCH and "float32 activations" in REGISTRY.fallbacks[-1][1]
