"""The parallel model's sums in bf16 (gates/shared/dist_arithmetic.py says why each is shaped as it is): the collective
itself at a world where a bf16 ring loses bits, and the expert-parallel MoE's fp32 partial sums, against the
single-process bf16 MoE."""

from __future__ import annotations

from typing import Any

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared.dist_common import asked_layout, session
from k3verify.gates.shared.dist_arithmetic import REDUCE_WORLD, contributions, exact_sum, run_reduce_world
from k3verify.gates.core.suite import derive_seed

SUITES = ("full",)
MOE_BF16_BAR = 5e-4
MOE_BF16_BAR_REASON = (
    "each rank's expert terms are summed in fp32 as the single-process combine sums them, only reassociated (fp32 "
    "ulp 6e-8), and both round once to bf16: they differ only where the two fp32 sums straddle a bf16 rounding "
    "boundary (~2^-16 of the elements) by one ulp (2^-8); 5e-4 admits one ulp on ~1.6% of the elements. A partial "
    "rounded to bf16 before the collective moves about half of them by one ulp (measured 2e-3 to 3e-3)")


@register_check(
    id="dist.reduce.fp32", component="serving", level="module", kind=Kind.BITEXACT, suites=SUITES,
    devices=("cpu",),
    control=f"the same contributions all-reduced by a bf16 collective ({REDUCE_WORLD} ranks: the ring rounds each "
            "running sum to bf16)",
)
def check_reduce_fp32(ctx: CheckContext) -> Trial:
    world = max(REDUCE_WORLD, *asked_layout(ctx))  # a layout the model cannot take skips every dist.* check
    seed = derive_seed(ctx.seed, "dist.reduce.fp32")
    ranks = run_reduce_world(world, seed)
    ref: dict[str, Any] = {}
    cand: dict[str, Any] = {}
    ctrl: dict[str, Any] = {}
    for name in ("bf16", "fp32"):
        want = exact_sum([contributions(r, seed)[name] for r in range(world)])
        for r, out in enumerate(ranks):
            ref[f"{name}.rank{r}"], cand[f"{name}.rank{r}"], ctrl[f"{name}.rank{r}"] = \
                want, out[name], out[f"control.{name}"]
    return Trial(reference=ref, candidate=cand, control=ctrl, metrics={"world": float(world)},
                 notes=[f"Comm.all_reduce in a gloo world of {world} (CPU) on {ranks[0]['bf16'].numel()} bf16 and as "
                        "many fp32 values per rank whose fp32 sum is exact in any order: every rank must hold the "
                        "exact sum rounded once to the input dtype. At 2 ranks a bf16 collective of bf16 values "
                        "would pass too (one add, one rounding), hence a world of its own"])


@register_check(
    id="dist.moe.bf16", component="moe", level="module", kind=Kind.RMS, bar=MOE_BF16_BAR,
    bar_reason=MOE_BF16_BAR_REASON, suites=SUITES, devices=("cpu",),
    control="each rank's fp32 partial sum rounded to bf16 before the collective (a second rounding)",
)
def check_moe_bf16(ctx: CheckContext) -> Trial:
    s = session(ctx)
    if s.single["moe_bf16"] is None:
        raise SkipCheck(f"{ctx.cfg.num_experts} experts cannot give each of {s.world} ranks one")
    ref: dict[str, Any] = {}
    cand: dict[str, Any] = {}
    ctrl: dict[str, Any] = {}
    for i, want in enumerate(s.single["moe_bf16"]):
        for r, out in enumerate(s.ranks):
            ref[f"moe{i}.rank{r}"] = want.float()
            cand[f"moe{i}.rank{r}"] = out["moe_bf16"][i].float()
            ctrl[f"moe{i}.rank{r}"] = out["control.moe_bf16_rounded"][i].float()
    differ = sum(int((c != r).sum()) for c, r in zip(cand.values(), ref.values(), strict=True))
    total = sum(c.numel() for c in cand.values())
    return Trial(reference=ref, candidate=cand, control=ctrl,
                 metrics={"world": float(s.world), "elements_differing": float(differ), "elements": float(total)},
                 notes=[f"every MoE block of the EP-only layout (1 x {s.world}) in bf16 against the single-process "
                        f"bf16 block on the same bf16 inputs ({len(s.single['moe_bf16'])} blocks); {differ} of "
                        f"{total} elements differ from it"])
