"""KDA score kernels: the Triton kernels under Triton's CPU interpreter (a child process) are held to the torch
reference, the fused launch equals the unfused chain bit for bit and leaves the pool and its tickets as it found
them; the registry's gates refuse what the kernels cannot do, naming the value; on CUDA the fused path runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import k3verify
from k3verify.kernels.kda import score_launch, score_ref
from k3verify.kernels.kda.score import SCORE_FUSED, kda_score
from k3verify.kernels.norm import torch_ref as norm_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON

CHILD = Path(__file__).with_name("kda_score_interpreter_child.py")
# name: (rows, positions, heads, head dim, conv width, dtype). dk=64 runs two value blocks per head (the
# fused kernel's ticket path); dk=20 pads to a 32-wide block (masks); W=3 and N=3 vary the unrolled loops.
SHAPES = {"bf16_dk64": (1, 5, 1, 64, 4, torch.bfloat16), "fp32_dk20": (2, 3, 2, 20, 3, torch.float32)}
NUM_SLOTS = 4


def _slots(rows: int) -> list[int]:
    """One live pool slot per row, never slot 0 (NaN): rows past the live slots share them (the pool is only
    read). A list shorter than the rows made the fused gate refuse the CUDA case (`slots / keep must be [4]`)."""
    live = [3, 1, 2]
    return [live[r % len(live)] for r in range(rows)]


def _case(rows: int, n: int, h: int, dk: int, w: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    D = h * dk

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    windows = tuple(rnd(NUM_SLOTS, D, w - 1).to(dtype).float() for _ in range(3))
    state = rnd(NUM_SLOTS, h, dk, dk) * 0.3
    for t in (*windows, state):
        t[0] = float("nan")  # slot 0 is nobody's: a read of it poisons the result
    # the projections as the layer hands them over: [B, n, D] views of column slices of one wider GEMM output
    wide = rnd(rows * n, 3 * D + 5).to(dtype)
    return {"xs": tuple(wide[:, i * D:(i + 1) * D].reshape(rows, n, D) for i in range(3)),
            "weights": tuple((rnd(D, w) * 0.5).to(dtype) for _ in range(3)), "windows": windows, "state": state,
            "slots": torch.tensor(_slots(rows)), "keep": torch.ones(rows, dtype=dtype),
            "g": -torch.rand(rows, n, h, dk, generator=g) * 0.7 - 0.01, "beta": torch.rand(rows, n, h, generator=g),
            "gate": rnd(rows, n, h, dk).to(dtype), "norm_weight": 1 + 0.1 * rnd(dk), "eps": 1e-5, "scale": dk**-0.5}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    pytest.importorskip("triton")
    cases = {name: _case(*shape, seed=i) for i, (name, shape) in enumerate(SHAPES.items())}
    tmp = tmp_path_factory.mktemp("kda_verify")
    torch.save(cases, tmp / "cases.pt")
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(k3verify.__file__).parents[1])}
    proc = subprocess.run([sys.executable, str(CHILD), str(tmp / "cases.pt"), str(tmp / "out.pt")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cases, torch.load(tmp / "out.pt")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_fused_equals_unfused_bit_for_bit(name: str, interpreted: tuple[dict, dict]) -> None:
    """o, gated output, conv records, state records and the pool: same bits from one launch as from three."""
    _, out = interpreted
    unfused, fused = out[f"{name}.unfused"], out[f"{name}.fused"]
    for key in ("o", "y", "conv_records", "state_records", "pool_state", "pool_windows"):
        assert torch.equal(_bits(fused[key]), _bits(unfused[key])), f"{name}: {key} differs"
    assert torch.isfinite(fused["state_records"]).all() and torch.isfinite(fused["conv_records"]).all()
    assert fused["tickets_left"].numel() == 0, "the fused launch left head tickets set"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_launch_changes_no_bit(name: str, interpreted: tuple[dict, dict]) -> None:
    """A narrower value block (more programs per head, more tickets, fewer warps) or the positions unrolled writes
    the shipped launch's bits, fused and unfused: score_launch.Launch may be tuned per GPU without touching a
    value."""
    _, out = interpreted
    for path in ("unfused", "fused"):
        for variant in ("bv16", "unrolled"):
            shipped, other = out[f"{name}.{path}"], out[f"{name}.{path}_{variant}"]
            for key in ("o", "y", "conv_records", "state_records", "pool_state", "pool_windows"):
                assert torch.equal(_bits(other[key]), _bits(shipped[key])), f"{name} {path}: {key} differs, {variant}"
            assert other["tickets_left"].numel() == 0


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_triton_path_matches_the_torch_reference(name: str, interpreted: tuple[dict, dict]) -> None:
    """Conv records equal the reference's bits (they are copies); states and outputs agree to fp32 rounding (rel
    RMS < 1e-6) and, in bf16, to at most one rounding step on 0.5% of the outputs; the pool is only read."""
    cases, out = interpreted
    c, got = cases[name], out[f"{name}.unfused"]
    B, N, H, DK = c["g"].shape
    conv_rec = torch.full_like(got["conv_records"], float("nan"))
    state_rec = torch.full_like(got["state_records"], float("nan"))
    q, k, v = score_ref.spec_conv_qkv_torch(c["xs"], c["weights"], c["windows"], c["slots"], c["keep"], conv_rec)
    o = score_ref.kda_record_torch(q.view(B, N, H, DK), k.view(B, N, H, DK), v.view(B, N, H, DK), c["g"], c["beta"],
                                    c["state"], c["slots"], c["scale"], state_rec)
    y = norm_ref.gated_rms_norm_torch(o, c["gate"], c["norm_weight"], c["eps"])
    assert torch.equal(got["conv_records"], conv_rec)
    for key, ref in (("state_records", state_rec), ("o", o), ("y", y)):
        cand = got[key]
        rel = float((cand.double() - ref.double()).norm() / ref.double().norm())
        if ref.dtype == torch.float32:
            assert rel < 1e-6, f"{name}: {key} rel RMS {rel:.2e}"
        else:
            step = torch.ldexp(torch.ones_like(ref.double()), torch.frexp(ref.double())[1] - 8)
            off = ((cand.double() - ref.double()).abs() > step).double().mean()
            assert rel < 5e-3 and float(off) <= 0.005, f"{name}: {key} rel RMS {rel:.2e}, {float(off):.3%} off"
    assert torch.equal(_bits(got["pool_state"]), _bits(c["state"]))
    assert torch.equal(_bits(got["pool_windows"]), _bits(torch.stack(c["windows"])))


def test_gates_refuse_what_the_kernels_cannot_do() -> None:
    """Each refusal names the value; fp32 and oversized heads go to the reference."""
    c = _case(2, 5, 1, 16, 4, torch.float32, seed=3)
    B, N, H, DK = c["g"].shape
    conv_rec, state_rec = torch.empty(B, N, 3, DK, 3), torch.empty(B, N, H, DK, DK)
    reason = score_launch.accepts_fused(c["xs"], c["weights"], c["windows"], c["state"], c["slots"], c["keep"],
                                         c["g"], c["beta"], c["gate"], c["norm_weight"], c["eps"], c["scale"],
                                         conv_rec, state_rec)
    assert reason is not None and "torch.float32" in reason
    big = _case(1, 5, 1, 256, 4, torch.bfloat16, seed=4)
    reason = score_launch.accepts_record(big["g"].to(torch.bfloat16), big["g"].to(torch.bfloat16),
                                          big["g"].to(torch.bfloat16), big["g"], big["beta"], big["state"],
                                          big["slots"], 1.0, torch.empty(1, 5, 1, 256, 256))
    assert reason is not None and "256" in reason
    bad_rec = score_launch.accepts_conv(tuple(x.to(torch.bfloat16) for x in c["xs"]),
                                         tuple(w.to(torch.bfloat16) for w in c["weights"]), c["windows"], c["slots"],
                                         c["keep"].to(torch.bfloat16), torch.empty(B, N, 3, DK, 2))
    assert bad_rec is not None and "conv records" in bad_rec
    xs = tuple(x.to(torch.bfloat16) for x in c["xs"])  # contiguous copies: one row stride for all three
    mixed = (xs[0], c["xs"][1].to(torch.bfloat16), xs[2].transpose(1, 2).contiguous().transpose(1, 2))
    bad_x = score_launch.accepts_conv(mixed, tuple(w.to(torch.bfloat16) for w in c["weights"]), c["windows"],
                                       c["slots"], c["keep"].to(torch.bfloat16), torch.empty(B, N, 3, DK, 3))
    assert bad_x is not None and "row stride" in bad_x
    assert score_launch.accepts_conv(xs, tuple(w.to(torch.bfloat16) for w in c["weights"]), c["windows"], c["slots"],
                                      c["keep"].to(torch.bfloat16), torch.empty(B, N, 3, DK, 3)) == \
        "tensors are not all on CUDA"


def test_fused_request_on_cpu_runs_the_unfused_reference() -> None:
    """kda_score(fused=True) off CUDA takes the reference backend of kda.score_fused (the unfused ops), and its
    results equal fused=False's bit for bit."""
    c = _case(2, 5, 1, 16, 4, torch.float32, seed=5)
    B, N, H, DK = c["g"].shape
    outs = []
    for fused in (True, False):
        conv_rec, state_rec = torch.empty(B, N, 3, DK, 3), torch.empty(B, N, H, DK, DK)
        o, y = kda_score(c["xs"], c["weights"], c["windows"], c["state"], c["slots"], c["keep"], c["g"], c["beta"],
                          c["gate"], c["norm_weight"], c["eps"], c["scale"], conv_rec, state_rec, fused=fused)
        outs.append((o, y, conv_rec, state_rec))
        if fused:
            assert REGISTRY.last_backend[SCORE_FUSED] == TORCH
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


CUDA_CASE = (4, 5, 4, 128, 4, torch.bfloat16)  # rows, positions, heads, dk, width, dtype of the GPU test


def _records(c: dict[str, Any], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    B, N, H, DK = c["g"].shape
    W1 = c["windows"][0].shape[-1]
    return (torch.full((B, N, 3, H * DK, W1), float("nan"), device=device),
            torch.full((B, N, H, DK, DK), float("nan"), device=device))


def _accept_args(c: dict[str, Any], device: str) -> tuple[Any, ...]:
    return (c["xs"], c["weights"], c["windows"], c["state"], c["slots"], c["keep"], c["g"], c["beta"], c["gate"],
            c["norm_weight"], c["eps"], c["scale"], *_records(c, device))


def test_cuda_case_passes_every_gate_but_the_device() -> None:
    """The GPU test's inputs, built on CPU: the fused gate's only objection is the device, so on CUDA the fused
    launch runs (the H200 run of 2026-12-01 fell back to torch here: two slots for four rows)."""
    c = _case(*CUDA_CASE, seed=6)
    assert score_launch.accepts_fused(*_accept_args(c, "cpu")) == "tensors are not all on CUDA"


@pytest.mark.gpu
def test_fused_path_runs_on_cuda() -> None:
    """The fused Triton launch runs (no fallback) and equals the unfused Triton chain bit for bit."""
    c = {k: (tuple(t.cuda() for t in v) if isinstance(v, tuple) else v.cuda() if isinstance(v, torch.Tensor) else v)
         for k, v in _case(*CUDA_CASE, seed=6).items()}
    reason = score_launch.accepts_fused(*_accept_args(c, "cuda"))
    assert reason is None, f"the fused gate refused the CUDA case: {reason}"
    outs = []
    for fused in (True, False):
        args = _accept_args(c, "cuda")
        o, y = kda_score(*args, fused=fused)
        if fused:
            assert REGISTRY.last_backend[SCORE_FUSED] == TRITON
        outs.append({"o": o, "y": y, "conv_records": args[-2], "state_records": args[-1]})
    for key in outs[0]:
        assert torch.equal(_bits(outs[0][key]), _bits(outs[1][key])), f"fused vs unfused: {key} differs"
    assert torch.isfinite(outs[0]["state_records"]).all()
