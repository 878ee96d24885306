"""The MXFP4 bench's parity: packed experts vs the same experts dequantized to bf16, prefill and decode.

What the packed mode changes is the expert GEMMs' arithmetic (codes x scales decoded in registers, exactly
the dequantized values, multiplied by another GEMM). So the candidate (packed) is held to the dequantized
model in the same dtype and the same decode path, never to an fp32 gold: on random-weight K3 widths bf16
alone sits 0.14-0.15 (relative RMS) from fp32, dominated by routing near-ties and bf16 chaos, not by the
kernel. Following gates/core/noise.py and gates/shared/route_pin.py:

- routes are pinned: the dequantized run (MoE through its grouped GEMM) records every router call, and each
  other run's drift-explained flips take the recorded choice (counted, and reported as metrics);
- the bar derives from the measured noise between two legitimate bf16 evaluations of the dequantized
  reference that differ only in their GEMM arithmetic: its grouped GEMM vs the per-expert reference loop
  (`moe.combine` forced to each backend). No packed code takes part, so a packed bug cannot widen its bar;
  bar = max(4 x noise, 4 bf16 unit roundoffs) (gates/core/noise.derive_bar);
- control: the packed experts read high nibble first (codes nibble-swapped), under the same pins.

Decode runs the graphs' static step eagerly (`GraphDecoder(use_graphs=False)`): a pin is a host-side
decision a captured graph cannot take. Replay == that eager step bit for bit is its own result
(`bench.graph_replay_vs_eager.b*`, same run), so the two together cover the served graph decode. Each
side's distance to the fp32 gold is kept as information only (metrics `*_vs_fp32_gold_rms`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from k3verify.bench.speed_parity import judge, teacher_forced
from k3verify.gates import Kind, Trial, compare
from k3verify.gates.core.noise import derive_bar
from k3verify.gates.shared.patch import patched
from k3verify.gates.shared.route_pin import PinStats, pin_routes, record_routes
from k3verify.kernels.moe import COMBINE
from k3verify.kernels.moe.grouped import PackedExperts
from k3verify.kernels.registry import CUDA, REGISTRY, TORCH
from k3verify.serving.batch import PackedBatch
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.layers.moe import SparseMoE
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner

Run = Callable[[], torch.Tensor]  # one evaluation of the logits being compared


@contextlib.contextmanager
def combine_on(backend: str) -> Iterator[None]:
    """Every dequantized MoE layer's expert combine on one backend (CUDA: the grouped GEMM, also on CPU)."""
    REGISTRY.force(COMBINE, backend)
    try:
        yield
    finally:
        REGISTRY.force(COMBINE, None)


def swap_nibbles(experts: PackedExperts) -> PackedExperts:
    def swap(codes: torch.Tensor) -> torch.Tensor:
        return ((codes & 0x0F) << 4) | (codes >> 4)

    return PackedExperts(swap(experts.w13_codes), experts.w13_scales, swap(experts.w2_codes), experts.w2_scales,
                         experts.group)


@contextlib.contextmanager
def nibbles_swapped(model: ServingModel) -> Iterator[None]:
    """The control: every packed MoE layer reads its codes high nibble first."""
    with contextlib.ExitStack() as stack:
        for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
            swapped = swap_nibbles(moe.packed_experts())
            stack.enter_context(patched(moe, "packed_experts", lambda swapped=swapped: swapped))
        yield


def prefill_run(model: ServingModel, ids: torch.Tensor) -> Run:
    """Every position's logits of one self-contained prefill of `ids`."""
    def run() -> torch.Tensor:
        out = model.prefill(PackedBatch.build(ids, [ids.numel()], device=model.device), all_logits=True).all_logits
        if out is None:
            raise RuntimeError("prefill(all_logits=True) returned no per-position logits")
        return out
    return run


def decode_run(runner: ModelRunner, ids: torch.Tensor, prompt_len: int, steps: int, max_context: int) -> Run:
    """Prefill ids[:P] through the runner, then teacher-force ids[P..P+S-1] one step at a time through the
    graphs' static step run eagerly: logits at positions P-1..P+S-1 ([S+1, V])."""
    P, S = prompt_len, steps
    if P + S > min(max_context, ids.numel()):
        raise ValueError(f"decode parity needs {P + S} tokens; have {ids.numel()} within context {max_context}")

    def run() -> torch.Tensor:
        return teacher_forced(runner, ids, P, S, GraphDecoder(runner.model, max_context, buckets=(1,),
                                                              use_graphs=False))
    return run


def _rms(ref: torch.Tensor, other: torch.Tensor) -> float:
    return compare(Kind.RMS, ref, other, 1.0).metric


def packed_vs_dequantized(check_id: str, dequantized: ServingModel, run_dequantized: Run, packed: ServingModel,
                          run_packed: Run, gold: torch.Tensor, what: str) -> dict[str, Any]:
    """Judge run_packed against run_dequantized under pinned routes, bar from the dequantized model's own
    grouped-vs-loop noise (module doc). `gold`: the fp32 logits of the same positions (information only)."""
    cfg = dequantized.cfg
    with combine_on(CUDA), record_routes(dequantized) as routes:
        ref = run_dequantized()
    noise_pins, pins = PinStats(), PinStats()
    with combine_on(TORCH), pin_routes(dequantized, routes, dequantized, cfg, noise_pins):
        second = run_dequantized()
    noise = _rms(ref, second)
    bar, derivation = derive_bar(noise, "bfloat16")
    with pin_routes(packed, routes, dequantized, cfg, pins):
        cand = run_packed()
    with pin_routes(packed, routes, dequantized, cfg, PinStats()), nibbles_swapped(packed):
        ctrl = run_packed()
    gold = gold.to(ref.device)
    metrics = {"noise_grouped_vs_loop_rms": noise, "packed_vs_fp32_gold_rms": _rms(gold, cand),
               "dequantized_vs_fp32_gold_rms": _rms(gold, ref),
               "argmax_agreement_packed_vs_dequantized": float((cand.argmax(-1) == ref.argmax(-1)).float().mean()),
               **pins.as_metrics("router"), **noise_pins.as_metrics("noise_router")}
    trial = Trial(reference=ref, candidate=cand, control=ctrl, metrics=metrics, notes=[
        f"{what}; packed vs dequantized bf16 experts (same decoded values, other GEMM), routes pinned to the "
        "dequantized run's near-ties; noise = dequantized grouped GEMM vs its per-expert loop; " + derivation,
        "the fp32 gold distances are information only: bf16 vs fp32 on random-weight K3 widths is routing "
        "near-ties and bf16 chaos, not the packed kernel"])
    return judge(check_id, Kind.RMS, trial, bar)
