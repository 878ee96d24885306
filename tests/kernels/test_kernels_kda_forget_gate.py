"""kda.gate_beta: the KDA forget gate and beta of a prefill or score pass. Its torch path is the layer's old two
calls (kda_forget_gate, kda_beta) bit for bit; the one-launch Triton kernel (run by Triton's CPU interpreter in a child
process) agrees with it to rounding on strided inputs, broken variants of the kernel do not; refusals name the
value; the layer's prefill and score route through the op."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_interp import broken_variant, child_report  # tests/kernels, on sys.path for pytest and the child

from k3verify.kernels import kda as kda_ops
from k3verify.kernels.kda import forget_gate_launch, torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH

T, H, DK = 5, 3, 16
BOUNDS = (None, -5.0)  # the plain gate (Kimi-Linear) and a safe gate (K3)
WIDTH = 2 * H * DK + H + 7  # the fused projection GEMM's row: f and b are column slices of it


def _case(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    row = (torch.randn(T, WIDTH, generator=g) * 3.0).to(dtype)  # softplus / sigmoid over their whole range
    row[0, :H * DK] = torch.linspace(-30.0, 30.0, H * DK).to(dtype)  # past softplus' threshold both ways
    return {"f": row[:, :H * DK], "b": row[:, 2 * H * DK:2 * H * DK + H],
            "dt_bias": torch.randn(H * DK, generator=g), "A": (torch.randn(H, generator=g) * 0.5).exp()[:, None]}


@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_is_the_old_gate_and_beta_bit_for_bit(dtype: torch.dtype, bound: float | None) -> None:
    c = _case(dtype)
    g, beta = kda_ops.kda_forget_gate_beta(c["f"], c["dt_bias"], c["A"], c["b"], H, bound)
    assert REGISTRY.last_backend[kda_ops.FORGET_GATE_BETA] == TORCH
    assert torch.equal(g, torch_ref.kda_forget_gate(c["f"], c["dt_bias"], c["A"], H, bound))
    assert torch.equal(beta, torch_ref.kda_beta(c["b"]))
    # the comparison can fail: a gate without dt_bias moves it
    assert not torch.equal(g, torch_ref.kda_forget_gate(c["f"], 0 * c["dt_bias"], c["A"], H, bound))


def test_gate_refuses_what_the_kernel_cannot_do() -> None:
    c = _case(torch.bfloat16)
    ok = (c["f"], c["dt_bias"], c["A"], c["b"], H, None)
    assert forget_gate_launch.accepts(*ok) == f"tensors are not all on {c['f'].device}"
    assert "float32" in (forget_gate_launch.accepts(c["f"].float(), *ok[1:]) or "")
    assert "unit column strides" in (forget_gate_launch.accepts(c["f"].t().contiguous().t(), *ok[1:]) or "")
    short_b = c["b"][:, :2]
    assert "b_logits must be" in (forget_gate_launch.accepts(c["f"], c["dt_bias"], c["A"], short_b, H, None) or "")
    assert "dt_bias" in (forget_gate_launch.accepts(c["f"], c["dt_bias"].bfloat16(), c["A"], c["b"], H, None) or "")
    assert "decay rate" in (forget_gate_launch.accepts(c["f"], c["dt_bias"], c["A"][:2], c["b"], H, None) or "")


# ---- the Triton kernel under the interpreter (a subprocess: TRITON_INTERPRET must precede the import) ----

BROKEN = {  # controls: forget_gate_kernel's own source with one fault, compared the same way
    "bias_dropped": (" + tl.load(dt_ptr + d, mask=m, other=0.0)", ""),
    "beta_raw": ("_sigmoid(b), mask=mh)", "b, mask=mh)"),
    "head_of_channel": ("A = tl.load(a_ptr + d // DK,", "A = tl.load(a_ptr + d % H,"),
    "threshold_flipped": ("tl.where(raw > SOFTPLUS_THRESHOLD, raw,", "tl.where(raw < SOFTPLUS_THRESHOLD, raw,"),
}
G_BAR, BETA_BAR = 1e-5, 1e-6  # the same fp32 math to Triton's exp / log (measured: 1.2e-8 / 1.7e-8 and 5.9e-9)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _compare(mod: Any, bound: float | None) -> dict[str, float]:
    c = _case(torch.bfloat16, seed=1)
    g_ref, beta_ref = torch_ref.kda_forget_gate_beta(c["f"], c["dt_bias"], c["A"], c["b"], H, bound)
    g = torch.full((T, H, DK), float("nan"))
    beta = torch.full((T, H), float("nan"))
    A = c["A"].reshape(-1).contiguous()
    mod.kda_forget_gate_beta_kernel[(T, -(-H * DK // 32))](
        c["f"], c["dt_bias"], A, c["b"], g, beta, float(bound or 0.0), c["f"].stride(0), c["b"].stride(0), H * DK, DK,
        H, SAFE=bound is not None, BLOCK=32, BLOCK_H=16)  # 32 channels a program: two heads' blocks, masks
    return {"g": _rel(g, g_ref), "beta": _rel(beta, beta_ref)}


def _interpreter_report(tmp: str) -> dict[str, Any]:
    """Runs in the subprocess (TRITON_INTERPRET=1): the gate kernel and broken variants vs the torch path."""
    from triton_interp import patch_interpreter

    from k3verify.kernels.kda import forget_gate_kernel

    patch_interpreter()
    report: dict[str, Any] = {"cases": {str(b): _compare(forget_gate_kernel, b) for b in BOUNDS}, "broken": {}}
    for name, (old, new) in BROKEN.items():
        module = broken_variant(forget_gate_kernel, name, old, new, tmp)
        report["broken"][name] = {str(b): _compare(module, b) for b in BOUNDS}
    return report


@pytest.fixture(scope="module")
def interpreter_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("triton", reason="triton is not installed: the interpreter test needs it")
    tmp = str(tmp_path_factory.mktemp("kda_forget_gate"))
    return child_report("test_kernels_kda_forget_gate", "_interpreter_report", tmp)


def test_gate_kernel_matches_torch_under_interpreter(interpreter_report: dict[str, Any]) -> None:
    for bound, r in interpreter_report["cases"].items():
        assert r["g"] < G_BAR and r["beta"] < BETA_BAR, (bound, r)


def test_broken_gate_kernels_are_caught_under_interpreter(interpreter_report: dict[str, Any]) -> None:
    for name, per_bound in interpreter_report["broken"].items():
        # a fault of the plain gate's softplus leaves the safe gate alone; every fault shows in some gate
        caught = [r["g"] > G_BAR or r["beta"] > BETA_BAR for r in per_bound.values()]
        assert any(caught), (name, per_bound)
        if name != "threshold_flipped":
            assert all(caught), (name, per_bound)


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_layer_prefill_routes_through_the_gate_op(preset: str) -> None:
    """Every KDA layer's prefill calls kda.gate_beta once (two packed sequences, one call per layer)."""
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.presets import get_preset
    from k3verify.serving.batch import PackedBatch
    from k3verify.serving.model import ServingModel

    cfg = get_preset(preset)
    model = ServingModel(cfg, torch.float32).load(synthetic_tensors(cfg, seed=0))
    batch = PackedBatch.build(torch.arange(9), [4, 5])
    before = REGISTRY.counts[(kda_ops.FORGET_GATE_BETA, TORCH)]
    with torch.no_grad():
        model.prefill(batch)
    assert len(cfg.kda_layers) > 0
    assert REGISTRY.counts[(kda_ops.FORGET_GATE_BETA, TORCH)] - before == len(cfg.kda_layers)
