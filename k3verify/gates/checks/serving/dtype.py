"""The model as served, in the run's serving dtype (`parity --dtype`), against a gold one precision up.

Two bf16 implementations cannot agree element by element (rounding, router near-ties flip experts), so the
question asked is DESIGN's for bf16 whole models: is ours at most 1.5x as far from the gold as the reference run
in the same dtype? bar = max(floor, 1.5 x reference-at-dtype's own distance), both measured in this run, per part:
`prefill` (a cacheless pass, every position) and `decode` (the runner: a cached prefill, then teacher-forced
decode steps, each row at its position). The outcome per part is a 0/1 flag; distances and bars are metrics.
Control: the same decode with the KDA states never written back.

- served.vs_gold: the K3 reference in fp64 is the gold, the reference in the serving dtype the baseline
  (router near-ties pinned to the gold's choice); every preset that fits whole.
- served.vs_transformers: transformers' KimiLinear in fp32 is the gold and the same model in the serving
  dtype the baseline, built one after the other (meta build, storage on the device): the model-level check at
  real size, as the bench does it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.core.compare import rel_rms_error
from k3verify.gates.shared import builders
from k3verify.gates.shared.route_pin import PinStats, pin_routes, record_routes
from k3verify.oracle.hf_kimi_linear import hf_forward
from k3verify.serving.batch import PackedBatch
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner

# Floors where the reference at the dtype sits (almost) on the gold: fp32 as model.logits.fp32 (chunked vs
# recurrent KDA op order, measured up to 4e-4 at 25 layers); bf16 the bench's 5e-3.
FLOORS = {torch.float32: 2e-3, torch.bfloat16: 5e-3}
FACTOR = 1.5
# Above this the reference at the serving dtype is itself far from the gold (measured in bf16: kl-tiny 0.025, the
# bench's kl-48b-8l 0.016, but k3-tiny 0.19, k3-skew-10 0.46, k3-syn-25 0.90: hostile synthetic weights drive
# SiTU into its caps and amplify rounding), and a stale-state control no longer stands out.
CHAOS_LIMIT = 0.1
KEEP_FP32 = ("e_score_correction_bias", "gate.weight", "dt_bias", "A_log")  # transformers keeps these in fp32

Pin = Callable[[nn.Module], contextlib.AbstractContextManager[Any]]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _lengths(ctx: CheckContext) -> tuple[int, int]:
    """(prefill, decode) token counts: the bench's 240 + 16 on a GPU, 40 + 8 on CPU."""
    return (240, 16) if ctx.device.type == "cuda" else (40, 8)


def _decode_rows(runner: ModelRunner, ids: torch.Tensor, prefill: int, pin: Pin) -> torch.Tensor:
    """Cached prefill of ids[:prefill] (its last row), then one teacher-forced decode step per later id."""
    runner.admit(0, ids.numel())
    try:
        with pin(runner.model):
            rows = [runner.prefill([(0, ids[:prefill].tolist())])[0]]
            rows += [runner.decode([(0, int(ids[t]))])[0] for t in range(prefill, ids.numel())]
        return torch.stack(rows).float()
    finally:
        runner.release(0)


def _skip_if_chaotic(dtype: torch.dtype, gold: torch.Tensor, base: torch.Tensor, what: str) -> None:
    chaos = rel_rms_error(gold, base)
    if chaos > CHAOS_LIMIT:
        raise SkipCheck(f"{what} in {_name(dtype)} sits {chaos:.3g} (rel RMS) from the gold on this model (> "
                        f"{CHAOS_LIMIT}): rounding is amplified so far that a whole-model comparison cannot tell a "
                        f"fault from noise; the {_name(dtype)} serving path is held by model.layerwise.sublayers "
                        "and the bit-exact serving checks instead")


def _judge(ctx: CheckContext, ids: torch.Tensor, gold: torch.Tensor, base: torch.Tensor, model: ServingModel,
           pin: Pin, gold_name: str) -> Trial:
    """Ours (prefill and cached decode) against `gold`, with the bar from `base`'s own distance."""
    dtype, (P, _) = ctx.dtype, _lengths(ctx)
    with pin(model):
        prefill = model.prefill(PackedBatch.build(ids, [ids.numel()], device=ctx.device), all_logits=True).all_logits
    assert prefill is not None
    runner = ModelRunner(model, num_pages=2 * (ids.numel() // 16 + 2), page_size=16, num_slots=2,
                         max_context=ids.numel() + 16)
    decode = _decode_rows(runner, ids, P, pin)
    assert runner.state_pool is not None
    with builders.stale_kda_state(runner.state_pool):
        stale = _decode_rows(runner, ids, P, pin)
    rows = {"prefill": slice(0, ids.numel()), "decode": slice(P - 1, ids.numel())}
    ours = {"prefill": prefill.float(), "decode": decode}
    metrics: dict[str, float] = {}
    flags, ctrl_flags = [], []
    for part, sl in rows.items():
        g, b = gold[sl].float(), base[sl].float()
        bar = max(FLOORS[dtype], FACTOR * rel_rms_error(g, b))
        dist = rel_rms_error(g, ours[part])
        metrics |= {f"{part}.ours_vs_gold": dist, f"{part}.baseline_vs_gold": rel_rms_error(g, b), f"{part}.bar": bar,
                    f"{part}.argmax_agreement": float((ours[part].argmax(-1) == g.argmax(-1)).float().mean())}
        flags.append(int(dist <= bar))
        ctrl_flags.append(int(rel_rms_error(g, stale if part == "decode" else ours[part]) <= bar))
    return Trial(reference=torch.ones(2, dtype=torch.int64), candidate=torch.tensor(flags),
                 control=torch.tensor(ctrl_flags), metrics=metrics,
                 notes=[f"serving dtype {_name(dtype)}; gold: {gold_name}; flags [prefill, decode]: ours within "
                        f"max(floor {FLOORS[dtype]:g}, {FACTOR} x the baseline's own distance) of the gold",
                        f"prefill {ids.numel()} positions (cacheless); decode: cached prefill of {P} then "
                        f"{ids.numel() - P} teacher-forced steps"])


def _usable(ctx: CheckContext) -> None:
    if not ctx.cfg.has_kda:
        raise SkipCheck("the control needs KDA state; this config has no KDA layer")
    if ctx.dtype not in FLOORS:
        raise SkipCheck(f"no floor for serving dtype {ctx.dtype}")


@register_check(id="served.vs_gold", component="model", level="serving", kind=Kind.BITEXACT,
                control="decode with the KDA states never written back (stale state)")
@builders.single_thread
def check_served_vs_gold(ctx: CheckContext) -> Trial:
    _usable(ctx)
    ids = builders.prompt(ctx, sum(_lengths(ctx)), salt=11)
    gold_model = builders.reference_model(ctx, torch.float64)
    with record_routes(gold_model) as routes:
        gold = gold_model(ids.to(ctx.device)).logits

    def pin(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return pin_routes(model, routes, gold_model, ctx.cfg, PinStats())

    oracle = builders.reference_model(ctx, ctx.dtype)
    with pin(oracle):
        base = oracle(ids.to(ctx.device)).logits.float()
    _skip_if_chaotic(ctx.dtype, gold, base, "the K3 reference")
    return _judge(ctx, ids, gold, base, builders.served_model(ctx), pin, "K3 reference fp64 (router near-ties pinned)")


def _narrow(model: nn.Module, dtype: torch.dtype) -> None:
    """transformers' model in `dtype`, its fp32-kept tensors kept (exact: the fp32 copy holds stored values)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not any(k in name for k in KEEP_FP32):
            t.data = t.data.to(dtype)


@register_check(id="served.vs_transformers", component="model", level="serving", kind=Kind.BITEXACT,
                control="decode with the KDA states never written back (stale state)")
@builders.single_thread
def check_served_vs_transformers(ctx: CheckContext) -> Trial:
    from k3verify.oracle.hf_model import load_baseline

    _usable(ctx)
    if ctx.cfg.is_k3:
        raise SkipCheck("transformers' KimiLinear has no K3 features: no transformers gold for a K3 model")
    ids = builders.prompt(ctx, sum(_lengths(ctx)), salt=17).to(ctx.device)
    hf = load_baseline(ctx.cfg, ctx.target.hf_config(), builders.checkpoint_tensors(ctx), ctx.device, torch.float32)
    gold = hf_forward(hf, ids)[0].float()
    _narrow(hf, ctx.dtype)
    base = hf_forward(hf, ids)[0].float()
    del hf
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    _skip_if_chaotic(ctx.dtype, gold, base, "transformers' model")
    return _judge(ctx, ids, gold, base, builders.served_model(ctx), lambda m: contextlib.nullcontext(),
                  "transformers KimiLinear fp32 (fla kernels on CUDA, torch paths on CPU)")
