"""Routing: which implementation of an op ran, and a logged reason whenever a fast path refuses."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from k3verify.kernels import kda as kda_ops
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON, KernelRegistry


def _kda_args(device: str, T: int = 70, h: int = 2, dk: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, dk, generator=g) for _ in range(3))
    gate = -torch.rand(T, h, dk, generator=g)
    beta = torch.rand(T, h, generator=g)
    state = torch.zeros(2, h, dk, dk)
    return tuple(t.to(device) for t in (q, k, v, gate, beta)) + ([0, 30, T], state.to(device), dk**-0.5)


def test_cpu_runs_the_torch_kda_paths() -> None:
    kda_ops.kda_prefill(*_kda_args("cpu"))
    assert REGISTRY.last_backend[kda_ops.PREFILL] == TORCH
    q, k, v, g, b, _, state, scale = _kda_args("cpu", T=2)
    kda_ops.kda_decode_slots(q, k, v, g, b, state, torch.tensor([1, 0]), scale)
    assert REGISTRY.last_backend[kda_ops.DECODE_SLOTS] == TORCH


def test_refused_fast_path_logs_the_reason_and_runs_torch(caplog: pytest.LogCaptureFixture) -> None:
    reg = KernelRegistry()
    ran: list[str] = []
    reg.register("op", TORCH, lambda x: ran.append("torch"))
    reg.register("op", TRITON, lambda x: ran.append("triton"), accepts=lambda x: "head dim 300 exceeds 256",
                 available=lambda: None)
    with caplog.at_level(logging.WARNING, logger="k3verify.kernels"):
        reg.call("op", 1, device=torch.device("cuda"))
    assert ran == ["torch"] and reg.last_backend["op"] == TORCH
    assert "head dim 300 exceeds 256" in caplog.text and reg.fallbacks == [("op", "head dim 300 exceeds 256")]


def test_unavailable_fast_path_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    reg = KernelRegistry()
    reg.register("op", TORCH, lambda: "torch")
    reg.register("op", TRITON, lambda: "triton", available=lambda: "fla is not installed")
    with caplog.at_level(logging.WARNING, logger="k3verify.kernels"):
        assert reg.call("op", device=torch.device("cuda")) == "torch"
    assert "fla is not installed" in caplog.text


def test_a_refusal_is_logged_once_but_counted_every_time(caplog: pytest.LogCaptureFixture) -> None:
    reg = KernelRegistry()
    reg.register("op", TORCH, lambda: "torch")
    reg.register("op", TRITON, lambda: "triton", accepts=lambda: "fp32 activations", available=lambda: None)
    with caplog.at_level(logging.WARNING, logger="k3verify.kernels"):
        for _ in range(3):
            reg.call("op", device=torch.device("cuda"))
    assert caplog.text.count("fp32 activations") == 1 and len(reg.fallbacks) == 3


def test_a_fast_path_that_raises_is_disabled_with_a_logged_reason(caplog: pytest.LogCaptureFixture) -> None:
    """A kernel that fails to compile on the GPU's toolchain must not take the run down, nor pass silently."""
    reg = KernelRegistry()
    calls: list[str] = []

    def broken() -> str:
        calls.append("triton")
        raise RuntimeError("PassManager::run failed")

    reg.register("op", TORCH, lambda: "torch")
    reg.register("op", TRITON, broken, accepts=lambda: None, available=lambda: None)
    with caplog.at_level(logging.WARNING, logger="k3verify.kernels"):
        assert reg.call("op", device=torch.device("cuda")) == "torch"
        assert reg.call("op", device=torch.device("cuda")) == "torch"
    assert calls == ["triton"] and reg.last_backend["op"] == TORCH  # tried once, then disabled
    assert "PassManager::run failed" in caplog.text and "disabled" in reg.fallbacks[-1][1]


def test_accepted_fast_path_runs_on_cuda_device_kind() -> None:
    reg = KernelRegistry()
    reg.register("op", TORCH, lambda: "torch")
    reg.register("op", TRITON, lambda: "triton", accepts=lambda: None, available=lambda: None)
    assert reg.call("op", device=torch.device("cuda")) == "triton" and reg.counts[("op", TRITON)] == 1
    assert reg.call("op", device=torch.device("cpu")) == "torch"


def test_registry_refuses_unknowns() -> None:
    reg = KernelRegistry()
    with pytest.raises(ValueError, match="unknown backend"):
        reg.register("op", "cuda-magic", lambda: None)
    with pytest.raises(KeyError, match="not registered"):
        reg.call("nope", device=torch.device("cpu"))
    reg.register("op", TORCH, lambda: None)
    with pytest.raises(ValueError, match="no 'triton'"):
        reg.force("op", TRITON)


def test_importing_the_registry_alone_registers_every_op() -> None:
    """A fresh process that imports only the registry finds every op there: importing the op packages afterwards
    adds none (the registry imports no op; k3verify/kernels/__init__.py registers them all)."""
    code = ("from k3verify.kernels.registry import REGISTRY\n"
            "first = REGISTRY.ops()\n"
            "from k3verify.kernels import attn, conv, kda, moe, mxfp4, norm, router\n"
            "print(len(first), sorted(set(REGISTRY.ops()) - set(first)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    count, missing = done.stdout.split(" ", 1)
    assert missing.strip() == "[]", f"ops registered only after their package was imported: {missing}"
    assert int(count) >= 7, f"expected at least one op per op package; found {count}"


@pytest.mark.gpu
def test_cuda_runs_fla_triton_kda() -> None:
    """On CUDA with fla installed, prefill and decode go through fla's Triton kernels and agree with torch."""
    q, k, v, g, b, cu, state, scale = _kda_args("cuda")
    o, s = kda_ops.kda_prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, b, cu, state, scale)
    assert REGISTRY.last_backend[kda_ops.PREFILL] == TRITON, REGISTRY.fallbacks
    REGISTRY.force(kda_ops.PREFILL, TORCH)
    try:
        o_ref, s_ref = kda_ops.kda_prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, b, cu, state, scale)
    finally:
        REGISTRY.force(kda_ops.PREFILL, None)
    assert ((o.float() - o_ref.float()).norm() / o_ref.float().norm()).item() < 5e-3
    assert ((s - s_ref).norm() / s_ref.norm()).item() < 5e-3
    d = _kda_args("cuda", T=2)
    d = (*d[:6], torch.randn_like(d[6]), d[7])  # random initial states
    slots = torch.tensor([1, 0], device="cuda")
    pool, ref_pool = d[6].clone(), d[6].clone()
    o_slots = kda_ops.kda_decode_slots(d[0].bfloat16(), d[1].bfloat16(), d[2].bfloat16(), d[3], d[4], pool, slots,
                                       d[7])
    assert REGISTRY.last_backend[kda_ops.DECODE_SLOTS] == TRITON, REGISTRY.fallbacks
    REGISTRY.force(kda_ops.DECODE_SLOTS, TORCH)
    try:
        o_ref = kda_ops.kda_decode_slots(d[0].bfloat16(), d[1].bfloat16(), d[2].bfloat16(), d[3], d[4], ref_pool,
                                         slots, d[7])
    finally:
        REGISTRY.force(kda_ops.DECODE_SLOTS, None)
    assert ((o_slots.float() - o_ref.float()).norm() / o_ref.float().norm()).item() < 1e-3
    assert ((pool - ref_pool).norm() / ref_pool.norm()).item() < 1e-3
    kda_ops.kda_decode_slots(d[0], d[1], d[2], d[3], d[4], d[6].clone(), slots, d[7])  # fp32: torch, logged reason
    assert REGISTRY.last_backend[kda_ops.DECODE_SLOTS] == TORCH and "TF32" in REGISTRY.fallbacks[-1][1]


def test_fast_path_check_helpers_skip_with_reason_and_refuse_an_unrouted_run() -> None:
    """The CUDA kernel checks use these two: no fast path -> a skip that prints why; a run the registry
    did not route to the fast path -> an error (comparing torch with torch would pass vacuously)."""
    from k3verify.gates import SkipCheck
    from k3verify.gates.shared import builders

    with pytest.raises(SkipCheck, match="the Triton KDA path is not available here: CUDA is not available"):
        builders.require_fast_path("Triton KDA path", "CUDA is not available")
    builders.require_fast_path("Triton KDA path", None)
    kda_ops.kda_prefill(*_kda_args("cpu"))  # CPU: the torch reference ran
    builders.assert_routed(kda_ops.PREFILL, backend=TORCH)
    with pytest.raises(RuntimeError, match="not triton"):
        builders.assert_routed(kda_ops.PREFILL, backend=TRITON)


def test_run_inside_refuses_runs_and_disables_a_raising_path(caplog: pytest.LogCaptureFixture) -> None:
    """A fast path's own kernel choice (the MoE combine's decode kernels and Triton tail): a refusal and a raise
    each fall back with the reason logged once and counted; after a raise the path stays off for the process."""
    reg = KernelRegistry()
    assert reg.run_inside("op.x", "inner", "too wide", lambda: 1, "the other kernels") is None
    assert reg.fallbacks == [("op.x", "inner: too wide")] and "falling back to the other kernels" in caplog.text
    assert reg.run_inside("op.x", "inner", None, lambda: 2, "the other kernels") == 2

    def boom() -> int:
        raise RuntimeError("bad launch")

    assert reg.run_inside("op.x", "inner", None, boom, "the other kernels") is None
    reason = reg.broken_inside("op.x", "inner")
    assert reason is not None and "bad launch" in reason and "disabled" in reason
    assert reg.run_inside("op.x", "inner", None, lambda: 3, "the other kernels") is None, "stays disabled"
    assert reg.fallbacks[-1] == ("op.x", f"inner: {reason}") and caplog.text.count("bad launch") == 1
