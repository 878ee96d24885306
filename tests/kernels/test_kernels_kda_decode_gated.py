"""kda.decode_slots_gated: the serving decode step from the gate's and beta's raw inputs. Its torch path is the
gate, beta and recurrence the layer used before bit for bit; fla's kernel making the gate and beta's sigmoid
in-kernel (run by Triton's CPU interpreter in a child process) agrees with it to rounding, broken variants of
the call do not; the layer's decode routes through the op."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from triton_interp import broken_variant, child_report  # tests/kernels, on sys.path for pytest and the child

from k3verify.kernels import kda as kda_ops
from k3verify.kernels.kda import torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH

B, H, DK, N_SLOTS = 4, 3, 16, 7
SLOTS = [5, 0, 3, 6]
BOUNDS = (None, -5.0)  # the plain gate (Kimi-Linear) and a safe gate (K3)


def _case(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(B, H, DK, generator=g).to(dtype), "k": torch.randn(B, H, DK, generator=g).to(dtype),
        "v": torch.randn(B, H, DK, generator=g).to(dtype),
        "f": (torch.randn(B, H * DK, generator=g) * 3.0).to(dtype),  # softplus / sigmoid over their whole range
        "dt_bias": torch.randn(H * DK, generator=g), "a_log": torch.randn(H, generator=g) * 0.5,
        "b": torch.randn(B, H, generator=g).to(dtype), "pool": torch.randn(N_SLOTS, H, DK, DK, generator=g) * 0.5,
    }


def _old_forget_gate(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, bound: float | None) -> torch.Tensor:
    """KimiDeltaAttention.forget_gate as the layer wrote it before kernels/kda/torch_ref.kda_forget_gate existed."""
    raw = torch.add(f, dt_bias.float()).view(-1, H, DK)
    A = a_log.float().reshape(-1)[:H].exp()[:, None]
    return -A * F.softplus(raw) if bound is None else bound * torch.sigmoid(A * raw)


@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_is_the_old_decode_bit_for_bit(dtype: torch.dtype, bound: float | None) -> None:
    c = _case(dtype)
    slots = torch.tensor(SLOTS)
    old_pool, new_pool = c["pool"].clone(), c["pool"].clone()
    old_g = _old_forget_gate(c["f"], c["dt_bias"], c["a_log"], bound)
    old = torch_ref.kda_decode_slots_torch(c["q"], c["k"], c["v"], old_g,
                                           torch.sigmoid(c["b"].float()), old_pool, slots, DK**-0.5)
    new = kda_ops.kda_decode_slots_gated(c["q"], c["k"], c["v"], c["f"], c["dt_bias"], c["a_log"], c["b"], new_pool,
                                         slots, DK**-0.5, bound)
    assert REGISTRY.last_backend[kda_ops.DECODE_SLOTS_GATED] == TORCH
    assert torch.equal(old, new) and torch.equal(old_pool, new_pool)
    # the comparison can fail: a gate without dt_bias moves both
    wrong_g = _old_forget_gate(c["f"], 0 * c["dt_bias"], c["a_log"], bound)
    wrong = torch_ref.kda_decode_slots_torch(c["q"], c["k"], c["v"], wrong_g,
                                             torch.sigmoid(c["b"].float()), c["pool"].clone(), slots, DK**-0.5)
    assert not torch.equal(old, wrong)


# ---- fla's kernel under the interpreter (a subprocess: TRITON_INTERPRET must precede the import) ----

BROKEN = {  # controls: fla_launch's own source with one fault in the call, compared the same way
    "bias_dropped": ("a_log=a_log, dt_bias=dt_bias,\n", "a_log=a_log, dt_bias=None,\n"),
    "beta_not_squashed": ("gate_in_kernel=True, beta_sigmoid_in_kernel=True,", "gate_in_kernel=True, "
                          "beta_sigmoid_in_kernel=False,"),
    "gate_not_made": ("gate_in_kernel=True, beta_sigmoid_in_kernel=True,", "gate_in_kernel=False, "
                      "beta_sigmoid_in_kernel=True,"),
}


O_BAR, POOL_BAR = 1e-3, 1e-5  # the same fp32 math to rounding (measured: o 0, pool 4e-8 to 5e-8), bf16 outputs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _compare(fn: Any, bound: float | None) -> dict[str, float]:
    c = _case(torch.bfloat16, seed=1)
    slots = torch.tensor(SLOTS)
    ref_pool, tri_pool = c["pool"].clone(), c["pool"].clone()
    ref = torch_ref.kda_decode_slots_gated_torch(c["q"], c["k"], c["v"], c["f"], c["dt_bias"], c["a_log"], c["b"],
                                                 ref_pool, slots, DK**-0.5, bound)
    out = fn(c["q"], c["k"], c["v"], c["f"], c["dt_bias"], c["a_log"], c["b"], tri_pool, slots, DK**-0.5, bound)
    idle = [s for s in range(N_SLOTS) if s not in SLOTS]
    return {"o": _rel(out, ref), "pool": _rel(tri_pool, ref_pool),
            "idle_equal": float(torch.equal(tri_pool[idle], c["pool"][idle]))}


def _interpreter_report(tmp: str) -> dict[str, Any]:
    """Runs in the subprocess (TRITON_INTERPRET=1): fla's gated decode and broken variants vs the torch path."""
    from triton_interp import patch_interpreter

    from k3verify.kernels.kda import fla_launch

    patch_interpreter()  # bf16 stores round to nearest even, as on the GPU
    report: dict[str, Any] = {"cases": {}, "broken": {}}
    for bound in BOUNDS:
        report["cases"][str(bound)] = _compare(fla_launch.kda_decode_slots_gated_fla, bound)
    for name, (old, new) in BROKEN.items():
        module = broken_variant(fla_launch, name, old, new, tmp)
        report["broken"][name] = {str(b): _compare(module.kda_decode_slots_gated_fla, b) for b in BOUNDS}
    # fla's own launch, as when the signature probe refuses the direct one: the same results, one warning
    import logging

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("k3verify.kernels").addHandler(handler)
    probe = fla_launch._recurrent_kernel
    fla_launch._recurrent_kernel = lambda: "the probe refused it (test)"  # type: ignore[assignment]
    try:
        report["fla_launch"] = {str(b): _compare(fla_launch.kda_decode_slots_gated_fla, b) for b in BOUNDS}
    finally:
        fla_launch._recurrent_kernel = probe  # type: ignore[assignment]
    report["fla_launch_warnings"] = warnings
    from k3verify.kernels.registry import REGISTRY

    report["fla_launch_fallbacks"] = [list(f) for f in REGISTRY.fallbacks]
    return report


@pytest.fixture(scope="module")
def interpreter_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("triton", reason="triton is not installed: the interpreter test needs it")
    pytest.importorskip("fla", reason="fla is not installed: the interpreter test runs its kernel")
    return child_report("test_kernels_kda_decode_gated", "_interpreter_report",
                        str(tmp_path_factory.mktemp("kda_gated_interp")))


def test_fla_gated_decode_matches_torch_under_interpreter(interpreter_report: dict[str, Any]) -> None:
    for bound, r in interpreter_report["cases"].items():
        assert r["o"] < O_BAR and r["pool"] < POOL_BAR, (bound, r)
        assert r["idle_equal"] == 1.0, (bound, r)


def test_fla_own_launch_is_the_fallback_with_one_warning(interpreter_report: dict[str, Any]) -> None:
    """When the direct launch's signature probe refuses fla's kernel, fla's wrapper launches it: the same
    results to rounding, the reason logged once however many calls follow (registry.run_inside) and every such
    call counted among the registry's fallbacks."""
    for bound, r in interpreter_report["fla_launch"].items():
        assert r["o"] < O_BAR and r["pool"] < POOL_BAR and r["idle_equal"] == 1.0, (bound, r)
    reason = "direct launch: the probe refused it (test)"
    assert interpreter_report["fla_launch_warnings"] == [
        f"kernel kda.decode_slots_gated: fast path refused, falling back to fla's own launch (4 warps): {reason}"]
    assert interpreter_report["fla_launch_fallbacks"] == [["kda.decode_slots_gated", reason]] * len(BOUNDS)


def test_broken_gated_calls_are_caught_under_interpreter(interpreter_report: dict[str, Any]) -> None:
    for name, per_bound in interpreter_report["broken"].items():
        assert all(r["o"] > O_BAR and r["pool"] > POOL_BAR for r in per_bound.values()), (name, per_bound)


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_layer_decode_routes_through_the_gated_op(preset: str) -> None:
    """Every KDA layer's decode step calls kda.decode_slots_gated once, and the post-gate op never."""
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.presets import get_preset
    from k3verify.serving.batch import PackedBatch
    from k3verify.serving.model import ServingModel

    cfg = get_preset(preset)
    model = ServingModel(cfg, torch.float32).load(synthetic_tensors(cfg, seed=0))
    model.allocate_caches(num_pages=16, page_size=8, num_slots=5)
    batch = PackedBatch.build(torch.zeros(2, dtype=torch.long), [1] * 2, start_pos=[5, 0], slots=[1, 3],
                              page_tables=[[1], [2]], page_size=8, is_decode=True)
    x = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    gated, plain = (kda_ops.DECODE_SLOTS_GATED, TORCH), (kda_ops.DECODE_SLOTS, TORCH)
    before = REGISTRY.counts[gated], REGISTRY.counts[plain]
    with torch.no_grad():
        for i in cfg.kda_layers:
            model.model.layers[i].self_attn(x, model._context(batch, None))
    assert (REGISTRY.counts[gated] - before[0], REGISTRY.counts[plain] - before[1]) == (len(cfg.kda_layers), 0)
