"""Each modelled serving fault turns at least one registered check red (status `fail`: the engine's
comparison of candidate vs reference fails), and every check used here is green without the fault."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import k3verify.gates.checks  # noqa: F401 - registers the checks
from k3verify.gates import REGISTRY, Status, make_context_factory
from k3verify.gates.checks.serving.packing import plain_triangle
from k3verify.gates.core.suite import ContextFactory, run_check
from k3verify.kernels.conv import torch_ref as conv_ref
from k3verify.kernels.kda import torch_ref as kda_ref
from k3verify.serving.layers import attn_res, kda, mla, mlp
from k3verify.serving.layers.moe import SparseMoE
from k3verify.serving.model import ServingModel
from k3verify.serving.state_cache import KDAStatePool
from k3verify.target import resolve_target

PRESET = "k3-tiny"


@pytest.fixture(scope="module")
def factory() -> Iterator[ContextFactory]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make_context_factory(resolve_target(PRESET), device="cpu", seed=0, suite="full")
    torch.set_num_threads(saved)


def _status(factory: ContextFactory, check_id: str) -> tuple[Status, str | None]:
    result = run_check(REGISTRY.get(check_id), factory, 0, "cpu")
    return Status(result.status), result.reason or result.traceback


def _leaky_sources(seg_ids: torch.Tensor, local_pos: torch.Tensor, shift: int, total: int, width: int,
                   has_initial: bool, zero_row: int) -> torch.Tensor:
    """Fault: the window is taken from the flat stream, so a sequence sees its predecessor's tail."""
    flat = torch.arange(seg_ids.numel(), device=seg_ids.device)
    return torch.where(flat >= shift, flat - shift, torch.full_like(flat, zero_row))


def _latent_norm_before_experts(self: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    weights, idx = self.gate(x)
    x_in = self.routed_expert_norm(self.routed_expert_down_proj(x))
    return self.routed_expert_up_proj(self.combine(x_in, weights, idx).to(x.dtype)) + self.shared_experts(x)


def _norm_then_mix(self: ServingModel, x: torch.Tensor, blocks: object, pending: torch.Tensor | None = None
                   ) -> torch.Tensor:
    if blocks is None:
        return self.model.norm(x if pending is None else x + pending)
    return attn_res.attn_res_mix(self.model.norm(x), blocks.view(), self.model.output_attn_res_norm.weight,  # type: ignore[attr-defined]
                                 self.model.output_attn_res_proj.weight, self.cfg.rms_norm_eps)


def _no_state_handoff(q, k, v, g, beta, cu, pieces, state, scale, lower_bound):  # noqa: ANN001, ANN202
    """Fault: every segment restarts from the initial state instead of the previous segment's."""
    out = torch.empty_like(v)
    for p in range(max(len(s) for s in pieces)):
        for i, segs in enumerate(pieces):
            if p < len(segs):
                a, b = cu[i] + segs[p][0], cu[i] + segs[p][1]
                out[a:b], _ = kda.kda_prefill(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], [0, b - a],
                                              state[i:i + 1], scale, lower_bound=lower_bound)
    return out, state


Fault = Callable[[pytest.MonkeyPatch], None]
FAULTS: dict[str, tuple[Fault, list[str]]] = {
    "block_diagonal_mask": (lambda mp: mp.setattr(mla, "key_ranges", plain_triangle),
                            ["serving.packed.equal_lengths", "serving.packed.unequal_lengths"]),
    "conv_boundary_reset": (lambda mp: mp.setattr(conv_ref, "_sources", _leaky_sources),
                            ["kda.conv.packed_boundary"]),
    "beta_sigmoid_missing": (lambda mp: mp.setattr(kda_ref, "kda_beta", lambda b: b.float()),
                             ["kda.module.fp32"]),
    "beta_sigmoid_twice": (lambda mp: mp.setattr(kda_ref, "kda_beta",
                                                 lambda b: torch.sigmoid(torch.sigmoid(b.float()))),
                           ["kda.module.fp32"]),
    "situ_linear_cap_dropped": (lambda mp: mp.setattr(mlp, "situ_glu", lambda g, u, b, lb: _situ(g, u, b, None)),
                                ["mlp.module.fp32", "moe.module.fp32"]),
    "situ_gate_cap_dropped": (lambda mp: mp.setattr(mlp, "situ_glu", lambda g, u, b, lb: _situ(g, u, 1e9, lb)),
                              ["mlp.module.fp32", "moe.module.fp32"]),
    "latent_norm_before_experts": (lambda mp: mp.setattr(SparseMoE, "forward", _latent_norm_before_experts),
                                   ["moe.module.fp32"]),
    "output_mix_after_norm": (lambda mp: mp.setattr(ServingModel, "finish", _norm_then_mix), ["model.logits.fp32"]),
    "kda_state_not_handed_across_segments": (lambda mp: mp.setattr(kda, "run_pieces_unchecked", _no_state_handoff),
                                             ["kda.segmented"]),
    "kda_state_not_stored": (lambda mp: (mp.setattr(KDAStatePool, "store_state", lambda *a, **k: None),
                                         mp.setattr(KDAStatePool, "state_view",
                                                    lambda self, layer: self.state[self.layer_index[layer]].clone())),
                             ["serving.decode.vs_full"]),
}
_situ = mlp.situ_glu


@pytest.mark.parametrize("check_id", sorted({c for _, ids in FAULTS.values() for c in ids}))
def test_check_is_green_without_faults(factory: ContextFactory, check_id: str) -> None:
    status, why = _status(factory, check_id)
    assert status is Status.PASS, why


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_turns_a_check_red(factory: ContextFactory, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    inject, check_ids = FAULTS[fault]
    inject(monkeypatch)
    outcomes = {cid: _status(factory, cid) for cid in check_ids}
    failed = [cid for cid, (status, _) in outcomes.items() if status is Status.FAIL]
    assert failed, f"fault {fault!r} survived: {outcomes}"


def test_bf16_module_check_runs_mla_on_the_torch_kernels(factory: ContextFactory,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """mla.module.bf16 compares the module's math in the oracle's op order: inside it, SDPA and the Triton
    norms are pinned to torch (the H200 showed 15% of elements off with them routed in). A pin placed
    above @register_check would never run: this proves it is active while the check executes."""
    from k3verify.gates.shared import builders
    from k3verify.kernels import attn, norm
    from k3verify.kernels.registry import REGISTRY as KERNELS

    seen: list[dict[str, str]] = []
    serving_model = builders.serving_model

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(dict(KERNELS._forced))
        return serving_model(*args, **kwargs)

    monkeypatch.setattr(builders, "serving_model", spy)
    status, why = _status(factory, "mla.module.bf16")
    assert status is Status.PASS, why
    assert seen and all(s.get(op) == "torch" for s in seen for op in (attn.CAUSAL, norm.RMS, norm.GATED_RMS))
    assert attn.CAUSAL not in KERNELS._forced  # released after the check


@pytest.mark.parametrize("leak", [False, True])
def test_conv_boundary_same_row_count_reference(factory: ContextFactory, monkeypatch: pytest.MonkeyPatch,
                                                leak: bool) -> None:
    """CUDA's form of kda.conv.packed_boundary ("alone" = the pack with the other sequences' inputs replaced,
    the GEMMs keeping their row count), run on the CPU: green without the fault, red with a leaking window."""
    from k3verify.gates.checks.serving import packing
    monkeypatch.setattr(packing, "same_row_count_reference", lambda ctx: True)
    if leak:
        monkeypatch.setattr(conv_ref, "_sources", _leaky_sources)
    result = run_check(REGISTRY.get("kda.conv.packed_boundary"), factory, 0, "cpu")
    assert any("other sequences' inputs replaced" in n for n in result.notes), result.notes
    assert Status(result.status) is (Status.FAIL if leak else Status.PASS), result.reason or result.traceback
