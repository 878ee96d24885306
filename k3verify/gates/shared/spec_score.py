"""The fused speculative score launch against the unfused chain, bit for bit, eager and replayed from a CUDA graph:
the spec.fused.vs_unfused check's trial, which the speculative bench runs too (ctx needs cfg, generator, device)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from k3verify.gates.core.check import Trial
from k3verify.gates.shared import builders
from k3verify.gates.shared.spec_cases import NUM_DRAFT, OpCase, bits, op_case
from k3verify.kernels.kda.score import SCORE_CONV, SCORE_FUSED, SCORE_NORM, SCORE_RECORD, kda_score
from k3verify.kernels.registry import TRITON

UNFUSED_OPS = (SCORE_CONV, SCORE_RECORD, SCORE_NORM)


def poisoned_records(case: OpCase) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-filled (poisoned) conv and state records: an element a kernel should write and does not shows."""
    B, n, h, dk = case.shape
    D, W1 = case.windows[0].shape[1:]
    dev = case.g.device
    return (torch.full((B, n, 3, D, W1), float("nan"), device=dev),
            torch.full((B, n, h, dk, dk), float("nan"), device=dev))


def score_outputs(case: OpCase, o: torch.Tensor, y: torch.Tensor, conv_rec: torch.Tensor,
             state_rec: torch.Tensor) -> dict[str, torch.Tensor]:
    pool = torch.cat([case.state.flatten(), *(w.flatten() for w in case.windows)])
    return {"o": bits(o), "y": bits(y), "conv_records": bits(conv_rec), "state_records": bits(state_rec),
            "pool": bits(pool)}


def run_eager(case: OpCase, fused: bool) -> dict[str, torch.Tensor]:
    conv_rec, state_rec = poisoned_records(case)
    o, y = kda_score(case.xs, case.weights, case.windows, case.state, case.slots, case.keep, case.g, case.beta,
                      case.gate, case.norm_weight, case.eps, case.scale, conv_rec, state_rec, fused=fused)
    builders.assert_routed(*((SCORE_FUSED,) if fused else UNFUSED_OPS), backend=TRITON)
    return score_outputs(case, o, y, conv_rec, state_rec)


def run_replayed(case: OpCase) -> dict[str, torch.Tensor]:
    """The fused launch captured in a CUDA graph (after an eager warm-up), records re-poisoned, then replayed."""
    conv_rec, state_rec = poisoned_records(case)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return kda_score(case.xs, case.weights, case.windows, case.state, case.slots, case.keep, case.g, case.beta,
                          case.gate, case.norm_weight, case.eps, case.scale, conv_rec, state_rec, fused=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, y = step()
    builders.assert_routed(SCORE_FUSED, backend=TRITON)
    conv_rec.fill_(float("nan"))
    state_rec.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return score_outputs(case, o, y, conv_rec, state_rec)


def fused_vs_unfused_trial(ctx: Any, rows_list: tuple[int, ...]) -> Trial:
    """(also the bench's) ctx needs cfg, generator and device."""
    ref, cand, ctrl = {}, {}, {}
    for rows in rows_list:
        case = op_case(ctx, torch.bfloat16, rows=rows)
        unfused = run_eager(case, fused=False)
        fused, replayed = run_eager(case, fused=True), run_replayed(case)
        wrong = run_eager(replace(case, slots=torch.roll(case.slots, 1) + (rows == 1)), fused=True)
        for key, value in unfused.items():
            for mode, got in (("eager", fused), ("graph", replayed)):
                ref[f"rows{rows}.{mode}.{key}"] = value
                cand[f"rows{rows}.{mode}.{key}"] = got[key]
                ctrl[f"rows{rows}.{mode}.{key}"] = wrong[key]
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        f"rows {rows_list} x {NUM_DRAFT + 1} positions, bf16, this preset's KDA dims; unfused = kda.score_conv + "
        "kda.score_record + kda.score_norm (Triton, eager); fused = kda.score_fused (one Triton launch) eager "
        "and replayed from a CUDA graph; records NaN-poisoned before each run; `pool` = the pool's raw bits after"])


