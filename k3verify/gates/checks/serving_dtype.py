"""The model as served, in the run's serving dtype (`parity --dtype`), against an fp64 gold.

Two bf16 implementations cannot agree element by element (rounding, router near-ties flip experts), so the
question asked is DESIGN's for bf16 whole models: is ours at most 1.5x as far from the gold as the oracle run
in the same dtype? bar = max(floor, 1.5 x oracle-at-dtype's own distance), both measured in this run, per part:
`prefill` (a cacheless pass, every position) and `decode` (the runner: a cached prefill, then teacher-forced
decode steps, each row at its position). The outcome per part is a 0/1 flag; distances and bars are metrics.
Control: the same decode with the KDA states never written back.
"""

from __future__ import annotations

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates import fixtures as fx
from k3verify.gates.compare import rel_rms_error
from k3verify.gates.route_pin import PinStats, RouteRecord, pin_routes, record_routes
from k3verify.serving.batch import PackedBatch
from k3verify.serving.runner import ModelRunner

PREFILL, DECODE = 40, 8
# Floors where the oracle-at-dtype sits (almost) on the gold: fp32 as model.logits.fp32 (chunked vs recurrent KDA
# op order, measured up to 4e-4 at 25 layers); bf16 the bench's 5e-3.
FLOORS = {torch.float32: 2e-3, torch.bfloat16: 5e-3}
FACTOR = 1.5
# Above this the oracle at the serving dtype is itself far from the gold (measured in bf16: kl-tiny 0.025, the
# bench's kl-48b-8l 0.016, but k3-tiny 0.19, k3-skew-10 0.46, k3-syn-25 0.90: hostile synthetic weights drive
# SiTU into its caps and amplify rounding), and a stale-state control no longer stands out.
CHAOS_LIMIT = 0.1


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _decode_rows(runner: ModelRunner, ids: torch.Tensor, routes: RouteRecord, gold: torch.nn.Module,
                 stats: PinStats) -> torch.Tensor:
    """Cached prefill of ids[:PREFILL] (its last row), then one teacher-forced decode step per later id; router
    near-ties pinned to the gold's choice (each call lines up with the gold's rows from its own start)."""
    cfg = runner.model.cfg
    runner.admit(0, ids.numel())
    try:
        with pin_routes(runner.model, routes, gold, cfg, stats):
            rows = [runner.prefill([(0, ids[:PREFILL].tolist())])[0]]
            rows += [runner.decode([(0, int(ids[t]))])[0] for t in range(PREFILL, ids.numel())]
        return torch.stack(rows).float()
    finally:
        runner.release(0)


@register_check(id="model.served.vs_gold", component="model", level="model", kind=Kind.BITEXACT,
                control="decode with the KDA states never written back (stale state)")
@fx.single_thread
def check_served_vs_gold(ctx: CheckContext) -> Trial:
    if not ctx.cfg.has_kda:
        raise SkipCheck("the control needs KDA state; this config has no KDA layer")
    dtype = ctx.dtype
    if dtype not in FLOORS:
        raise SkipCheck(f"no floor for serving dtype {dtype}")
    ids = fx.prompt(ctx, PREFILL + DECODE, salt=11)
    gold_model = fx.reference_model(ctx, torch.float64)
    with record_routes(gold_model) as routes:
        gold = gold_model(ids.to(ctx.device)).logits
    base_stats, stats = PinStats(), PinStats()
    oracle = fx.reference_model(ctx, dtype)
    with pin_routes(oracle, routes, gold_model, ctx.cfg, base_stats):
        base = oracle(ids.to(ctx.device)).logits.float()
    chaos = rel_rms_error(gold, base)
    if chaos > CHAOS_LIMIT:
        raise SkipCheck(f"the oracle itself in {_name(dtype)} sits {chaos:.3g} (rel RMS) from the fp64 gold on this "
                        f"model (> {CHAOS_LIMIT}): rounding is amplified so far that a whole-model comparison cannot "
                        f"tell a fault from noise; the {_name(dtype)} serving path is held by the module checks and "
                        "the bit-exact serving checks instead")
    model = fx.served_model(ctx)
    with pin_routes(model, routes, gold_model, ctx.cfg, stats):
        prefill = model.prefill(PackedBatch.build(ids, [ids.numel()], device=ctx.device), all_logits=True).all_logits
    assert prefill is not None
    runner = ModelRunner(model, num_pages=16, page_size=16, num_slots=2, max_context=128)
    decode = _decode_rows(runner, ids, routes, gold_model, stats)
    assert runner.state_pool is not None
    with fx.stale_kda_state(runner.state_pool):
        stale = _decode_rows(runner, ids, routes, gold_model, PinStats())
    rows = {"prefill": slice(0, ids.numel()), "decode": slice(PREFILL - 1, ids.numel())}
    ours = {"prefill": prefill.float(), "decode": decode}
    metrics: dict[str, float] = {}
    flags, ctrl_flags = [], []
    for part, sl in rows.items():
        g, b = gold[sl], base[sl]
        bar = max(FLOORS[dtype], FACTOR * rel_rms_error(g, b))
        dist = rel_rms_error(g, ours[part])
        metrics |= {f"{part}.ours_vs_gold": dist, f"{part}.oracle_vs_gold": rel_rms_error(g, b),
                    f"{part}.bar": bar,
                    f"{part}.argmax_agreement": float((ours[part].argmax(-1) == g.argmax(-1)).float().mean())}
        flags.append(int(dist <= bar))
        ctrl = stale if part == "decode" else ours[part]
        ctrl_flags.append(int(rel_rms_error(g, ctrl) <= bar))
    return Trial(reference=torch.ones(2, dtype=torch.int64), candidate=torch.tensor(flags),
                 control=torch.tensor(ctrl_flags), metrics=metrics,
                 notes=[f"serving dtype {_name(dtype)}; flags [prefill, decode]: ours within "
                        f"max(floor {FLOORS[dtype]:g}, {FACTOR} x the oracle at the same dtype) of the fp64 gold",
                        f"prefill {ids.numel()} positions (cacheless); decode: cached prefill of {PREFILL} then "
                        f"{DECODE} teacher-forced steps"])
