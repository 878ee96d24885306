"""Decode and caches: prefill + decode steps vs one full forward, the absorbed MLA decode, cache
integrity after every step, and untouched state slots / pages staying bit-identical."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates import fixtures as fx
from k3verify.serving.batch import PackedBatch
from k3verify.serving.context import ForwardContext
from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner

DECODE_STEPS = 6
# (first prefill, continuation prefill or 0): one sequence arrives in two prefill chunks
PROMPTS = {0: (20, 0), 1: (33, 0), 2: (10, 15)}
DECODE_BAR = 1e-4


def _runner(model: ServingModel, num_slots: int = 4) -> ModelRunner:
    return ModelRunner(model, num_pages=48, page_size=8, num_slots=num_slots, max_context=256)


def _decode_scenario(ctx: CheckContext, runner: ModelRunner, tokens: dict[int, list[int]],
                     during_decode: Callable[[], Any] | None = None) -> dict[str, torch.Tensor]:
    """Prefill (one pack, then a continuation pack), DECODE_STEPS decode steps; the logits each step
    yields per sequence: [1 + continuation + steps, V]."""
    rows: dict[int, list[torch.Tensor]] = {sid: [] for sid in PROMPTS}
    for sid, (first, cont) in PROMPTS.items():
        runner.admit(sid, first + cont + DECODE_STEPS)
    out = runner.prefill([(sid, tokens[sid][:first]) for sid, (first, _) in PROMPTS.items()])
    for row, sid in zip(out, PROMPTS, strict=True):
        rows[sid].append(row)
    conts = [(sid, tokens[sid][first:first + cont]) for sid, (first, cont) in PROMPTS.items() if cont]
    for row, (sid, _) in zip(runner.prefill(conts), conts, strict=True):
        rows[sid].append(row)
    with during_decode() if during_decode is not None else contextlib.nullcontext():  # type: ignore[attr-defined]
        for _ in range(DECODE_STEPS):
            step = [(sid, tokens[sid][runner.num_cached(sid)]) for sid in PROMPTS]
            for row, (sid, _) in zip(runner.decode(step), step, strict=True):
                rows[sid].append(row)
    runner.check_integrity()
    for sid in PROMPTS:
        runner.release(sid)
    return {f"seq{sid}": torch.stack(r) for sid, r in rows.items()}


@register_check(
    id="serving.decode.vs_full", component="serving", level="serving", kind=Kind.RMS, bar=DECODE_BAR,
    bar_reason="fp32; recurrent KDA step vs chunked prefill and latent-space (absorbed) MLA vs expanded keys: "
    "measured rel RMS ~1e-6; a decode that never advances the KDA state sits above 1e-2",
    control="decode from stale state: the KDA state is never written back during decode",
)
@fx.single_thread
def check_decode_vs_full(ctx: CheckContext) -> Trial:
    model = fx.serving_model(ctx)
    total = {sid: first + cont + DECODE_STEPS for sid, (first, cont) in PROMPTS.items()}
    tokens = {sid: fx.prompt(ctx, n, salt=10 + sid).tolist() for sid, n in total.items()}
    ref = {}
    for sid, (first, cont) in PROMPTS.items():
        full = model.prefill(PackedBatch.build(torch.tensor(tokens[sid]), [total[sid]], device=ctx.device),
                             all_logits=True).all_logits
        positions = [first - 1] + ([first + cont - 1] if cont else []) + list(range(first + cont, total[sid]))
        ref[f"seq{sid}"] = full[positions]
    runner = _runner(model)
    cand = _decode_scenario(ctx, runner, tokens)
    ctrl = _decode_scenario(ctx, runner, tokens,
                            lambda: fx.stale_kda_state(runner.state_pool))
    return Trial(reference=ref, candidate=cand, control=ctrl, position_dim=0, notes=[
        f"prompts {PROMPTS} (first prefill, continuation), {DECODE_STEPS} decode steps through ModelRunner vs "
        "one cacheless forward of the whole sequence; integrity checked after the scenario"])


@register_check(
    id="mla.decode.absorbed", component="mla", level="module", kind=Kind.RMS, bar=1e-5,
    bar_reason="fp32; q.W_kb against the latent is a reassociation of q.k: measured rel RMS ~1e-7, the unscaled "
    "control moves it by >1e-1",
    control="absorbed scores without the (qk_nope + qk_rope)^-0.5 scale",
)
@fx.single_thread
def check_absorbed_decode(ctx: CheckContext) -> Trial:
    if not ctx.cfg.has_mla:
        raise SkipCheck("preset has no MLA layers")
    model = fx.serving_model(ctx)
    cache = PagedLatentCache(ctx.cfg, num_pages=24, page_size=8, dtype=torch.float32, device=ctx.device)
    lens = [9, 30, 17]
    for sid, n in enumerate(lens):
        cache.reserve(sid, n + 1)
    tables = [cache.table(sid) for sid in range(len(lens))]

    def cached(batch: PackedBatch) -> ForwardContext:
        assert batch.page_table is not None
        return ForwardContext(batch, kv_cache=cache, kv_rows=cache.rows(batch.page_table, batch.seg_ids,
                                                                      batch.positions))
    pre = PackedBatch.build(fx.dummy_ids(sum(lens)), lens, page_tables=tables, page_size=8, device=ctx.device)
    dec = PackedBatch.build(fx.dummy_ids(len(lens)), [1] * len(lens), start_pos=lens, page_tables=tables,
                            page_size=8, is_decode=True, device=ctx.device)
    ref, cand, ctrl = {}, {}, {}
    for i in ctx.cfg.full_attn_layers:
        attn = model.model.layers[i].self_attn
        attn(fx.layer_inputs(ctx, sum(lens), torch.float32), cached(pre))
        x = fx.layer_inputs(ctx, len(lens), torch.float32)
        key = f"layers.{i}"
        plain, absorbed = cached(dec), cached(dec)
        plain.mla_absorb = False
        ref[key] = attn(x, plain)
        cand[key] = attn(x, absorbed)
        if absorbed.stats.get("mla_absorbed_decode", 0) == 0:
            raise RuntimeError("the absorbed decode path was not engaged")
        with fx.patched(attn, "scale", 1.0):
            ctrl[key] = attn(x, cached(dec))
    return Trial(reference=ref, candidate=cand, control=ctrl,
                 notes=[f"contexts {lens}: decode in the latent space vs keys/values expanded through kv_b_proj"])


def _integrity_scenario(runner: ModelRunner, ids: list[int], corrupt_after: int | None) -> torch.Tensor:
    """Run a scheduler-like sequence of steps; 1 for every step after which integrity fails."""
    steps: list[Callable[[], object]] = [
        lambda: [runner.admit(s, 40) for s in (1, 2, 3)],
        lambda: runner.prefill([(1, ids[:9]), (2, ids[9:30]), (3, ids[30:33])]),
        lambda: runner.decode([(1, 5), (2, 6), (3, 7)]),
        lambda: runner.prefill([(3, ids[33:50])]),
        lambda: runner.decode([(1, 8), (3, 9)]),
        lambda: runner.release(2),
        lambda: runner.admit(4, 24),
        lambda: runner.prefill([(4, ids[:20])]),
        lambda: runner.decode([(1, 1), (3, 2), (4, 3)]),
        lambda: [runner.release(s) for s in (1, 3, 4)],
    ]
    outcome = []
    for n, step in enumerate(steps):
        try:
            step()
            if corrupt_after == n:  # the fault: sequence 3 also "owns" sequence 1's first page
                runner.kv_cache._tables[3].append(runner.kv_cache._tables[1][0])
            runner.check_integrity()
            outcome.append(0)
        except Exception:
            outcome.append(1)
    return torch.tensor(outcome)


@register_check(
    id="serving.cache.integrity", component="serving", level="serving", kind=Kind.BITEXACT,
    control="a page double-allocated after the first decode step must be detected",
)
@fx.single_thread
def check_cache_integrity(ctx: CheckContext) -> Trial:
    model = fx.served_model(ctx)
    ids = fx.prompt(ctx, 50, salt=20).tolist()
    cand = _integrity_scenario(_runner(model), ids, None)
    ctrl = _integrity_scenario(_runner(model), ids, corrupt_after=2)
    return Trial(reference=torch.zeros_like(cand), candidate=cand, control=ctrl,
                 notes=["0 = both caches pass check_integrity() after the step; steps: admit, prefill, decode, "
                        "continuation, decode, release, admit, prefill, decode, release"])


def _fill_sentinels(t: torch.Tensor) -> None:
    """Alternate 1e30 and NaN over dim 1 (slots / pages): unused storage that must stay untouched."""
    for j in range(t.shape[1]):
        t[:, j] = float("nan") if j % 2 else 1e30


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t.contiguous().view(torch.int16)


@register_check(
    id="serving.state.untouched_slots", component="serving", level="serving", kind=Kind.BITEXACT,
    control="every KDA state write also lands in the next slot (slot + 1)",
)
@fx.single_thread
def check_untouched_slots(ctx: CheckContext) -> Trial:
    model = fx.served_model(ctx)
    ids = fx.prompt(ctx, 40, salt=21).tolist()

    def run(fault: bool) -> dict[str, torch.Tensor]:
        runner = _runner(model, num_slots=6)
        pool, cache = runner.state_pool, runner.kv_cache
        for t in (*pool.tensors().values(), cache.data):
            _fill_sentinels(t)
        runner.admit(1, 30)
        runner.admit(2, 30)
        used = {runner.slot_of(1), runner.slot_of(2)}
        pages = set(cache.table(1)) | set(cache.table(2))
        idle_slots = torch.tensor([s for s in range(pool.num_slots + 1) if s not in used], device=ctx.device)
        idle_pages = torch.tensor([p for p in range(cache.num_pages) if p not in pages], device=ctx.device)
        snapshot = {name: _bits(t.index_select(1, idle_slots)) for name, t in pool.tensors().items()}
        snapshot["latent_pages"] = _bits(cache.data.index_select(1, idle_pages))
        store = pool.store_state
        if fault:
            def leaky(layer: int, slots: torch.Tensor, value: torch.Tensor) -> None:
                store(layer, slots, value)
                store(layer, slots + 1, value)
            pool.store_state = leaky  # type: ignore[method-assign]
        try:
            runner.prefill([(1, ids[:12]), (2, ids[12:31])])
            for step in range(3):
                runner.decode([(1, ids[31 + step]), (2, ids[34 + step])])
        finally:
            pool.__dict__.pop("store_state", None)
        after = {name: _bits(t.index_select(1, idle_slots)) for name, t in pool.tensors().items()}
        after["latent_pages"] = _bits(cache.data.index_select(1, idle_pages))
        runner.release(1)
        runner.release(2)
        return {"before": snapshot, "after": after}  # type: ignore[dict-item]

    good, bad = run(False), run(True)
    return Trial(reference=good["before"], candidate=good["after"], control=bad["after"], notes=[
        "idle slots (scratch included) and idle pages (scratch included) filled with alternating 1e30 / NaN "
        "sentinels, compared as raw bits before and after a prefill and 3 decode steps of two sequences"])
