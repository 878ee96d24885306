"""Decode and caches: prefill + decode steps vs one full forward, the absorbed MLA decode, cache
integrity after every step, and untouched state slots / pages staying bit-identical."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.patch import patched
from k3verify.oracle import functional as Fn
from k3verify.serving.batch import PackedBatch
from k3verify.serving.context import ForwardContext
from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.layers import mla as mla_mod
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner

DECODE_STEPS = 6
# (first prefill, continuation prefill or 0): one sequence arrives in two prefill chunks
PROMPTS = {0: (20, 0), 1: (33, 0), 2: (10, 15)}
DECODE_LENS = [9, 30, 17]  # cached contexts of the MLA decode checks


def _positions(sid: int) -> list[int]:
    """The positions whose logits a sequence yields: end of each prefill chunk, then every decode step."""
    first, cont = PROMPTS[sid]
    return [first - 1] + ([first + cont - 1] if cont else []) + list(range(first + cont, first + cont + DECODE_STEPS))


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
    with during_decode() if during_decode is not None else contextlib.nullcontext():
        for _ in range(DECODE_STEPS):
            step = [(sid, tokens[sid][runner.num_cached(sid)]) for sid in PROMPTS]
            for row, (sid, _) in zip(runner.decode(step), step, strict=True):
                rows[sid].append(row)
    runner.check_integrity()
    for sid in PROMPTS:
        runner.release(sid)
    return {f"seq{sid}": torch.stack(r) for sid, r in rows.items()}


@register_check(
    id="serving.decode.vs_full", component="serving", level="serving", kind=Kind.RMS,
    noise="the K3 reference's logits in fp32 vs fp64 (routes pinned) on each whole sequence, at the compared positions",
    control="decode from stale state: the KDA state is never written back during decode",
)
@builders.single_thread
def check_decode_vs_full(ctx: CheckContext) -> Trial:
    model = builders.serving_model(ctx)
    total = {sid: first + cont + DECODE_STEPS for sid, (first, cont) in PROMPTS.items()}
    tokens = {sid: builders.prompt(ctx, n, salt=10 + sid).tolist() for sid, n in total.items()}
    ref = {}
    for sid in PROMPTS:
        full = model.prefill(PackedBatch.build(torch.tensor(tokens[sid]), [total[sid]], device=ctx.device),
                             all_logits=True).all_logits
        assert full is not None  # asked for with all_logits=True
        ref[f"seq{sid}"] = full[_positions(sid)]
    noise = None
    if ctx.needs_noise:
        ids = {sid: torch.tensor(tokens[sid]) for sid in PROMPTS}
        noise = ({f"seq{s}": builders.reference_forward(ctx, ids[s])[0].logits[_positions(s)] for s in PROMPTS},
                 {f"seq{s}": builders.reference_gold(ctx, ids[s]).logits[_positions(s)] for s in PROMPTS})
    runner = _runner(model)
    cand = _decode_scenario(ctx, runner, tokens)
    ctrl = _decode_scenario(ctx, runner, tokens,
                            lambda: builders.stale_kda_state(runner.state_pool))
    return Trial(reference=ref, candidate=cand, control=ctrl, position_dim=0, noise=noise, notes=[
        f"prompts {PROMPTS} (first prefill, continuation), {DECODE_STEPS} decode steps through ModelRunner vs "
        "one cacheless forward of the whole sequence; integrity checked after the scenario"])


class LatentDecode:
    """Prefix latents of DECODE_LENS sequences in a fresh paged cache, and the decode batch after them."""

    def __init__(self, ctx: CheckContext, dtype: torch.dtype) -> None:
        self.cache = PagedLatentCache(ctx.cfg, num_pages=24, page_size=8, dtype=dtype, device=ctx.device)
        for sid, n in enumerate(DECODE_LENS):
            self.cache.reserve(sid, n + 1)
        tables = [self.cache.table(sid) for sid in range(len(DECODE_LENS))]
        self.prefill = PackedBatch.build(builders.dummy_ids(sum(DECODE_LENS)), DECODE_LENS, page_tables=tables,
                                         page_size=8, device=ctx.device)
        self.decode = PackedBatch.build(builders.dummy_ids(len(DECODE_LENS)), [1] * len(DECODE_LENS),
                                        start_pos=DECODE_LENS, page_tables=tables, page_size=8, is_decode=True,
                                        device=ctx.device)

    def context(self, batch: PackedBatch) -> ForwardContext:
        assert batch.page_table is not None
        return ForwardContext(batch, kv_cache=self.cache,
                              kv_rows=self.cache.rows(batch.page_table, batch.seg_ids, batch.positions))


@register_check(
    id="mla.decode.absorbed", component="mla", level="module", kind=Kind.RMS,
    noise="the oracle's MLA layers in fp32 vs fp64 on each whole sequence (prefix + decode token), last row",
    control="absorbed scores without the (qk_nope + qk_rope)^-0.5 scale",
)
@builders.single_thread
def check_absorbed_decode(ctx: CheckContext) -> Trial:
    if not ctx.cfg.has_mla:
        raise SkipCheck("preset has no MLA layers")
    model, setup = builders.serving_model(ctx), LatentDecode(ctx, torch.float32)
    ref, cand, ctrl, low, high = {}, {}, {}, {}, {}
    for i in ctx.cfg.full_attn_layers:
        attn = builders.layers(model)[i].self_attn
        x_pre = builders.layer_inputs(ctx, sum(DECODE_LENS), torch.float32)
        attn(x_pre, setup.context(setup.prefill))
        x = builders.layer_inputs(ctx, len(DECODE_LENS), torch.float32)
        if ctx.needs_noise:
            low[f"layers.{i}"], high[f"layers.{i}"] = _oracle_last_rows(ctx, i, x_pre, x, DECODE_LENS)
        key = f"layers.{i}"
        plain, absorbed = setup.context(setup.decode), setup.context(setup.decode)
        plain.mla_absorb = False
        ref[key] = attn(x, plain)
        cand[key] = attn(x, absorbed)
        if absorbed.stats.get("mla_absorbed_decode", 0) == 0:
            raise RuntimeError("the absorbed decode path was not engaged")
        with patched(attn, "scale", 1.0):
            ctrl[key] = attn(x, setup.context(setup.decode))
    return Trial(reference=ref, candidate=cand, control=ctrl, noise=(low, high) if low else None,
                 notes=[f"contexts {DECODE_LENS}: decode in the latent space vs keys/values expanded by kv_b_proj"])


def _oracle_softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The oracle's attention softmax (functional.causal_attention): fp32, cast back once."""
    return torch.softmax(Fn.hi(scores), dim=-1).to(dtype)


def _bf16_softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fault: exp, sum and division in the activation dtype."""
    e = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    return (e / e.sum(dim=-1, keepdim=True)).to(dtype)


@register_check(
    id="mla.decode.bf16", component="mla", level="module", kind=Kind.BITEXACT, suites=("full",),
    control="the decode softmax computed in bf16 (exp, sum and division in the activation dtype)",
)
@builders.single_thread
def check_decode_softmax_bf16(ctx: CheckContext) -> Trial:
    """The bf16 absorbed decode against itself with the oracle's softmax swapped in, bit for bit. Its scores are
    bf16 by design (as the oracle's are), and the absorbed and expanded products round them differently by more
    than a bf16 softmax's extra roundings: no comparison with the oracle's MLA could see the softmax's precision,
    so it is pinned on the serving path itself."""
    if not ctx.cfg.has_mla:
        raise SkipCheck("preset has no MLA layers")
    model, setup = builders.serving_model(ctx, torch.bfloat16), LatentDecode(ctx, torch.bfloat16)
    calls = []

    def oracle_probs(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        calls.append(scores.shape)
        return _oracle_softmax(scores, dtype)
    out: dict[str, dict[str, torch.Tensor]] = {"ref": {}, "cand": {}, "ctrl": {}}
    for i in ctx.cfg.full_attn_layers:
        attn = builders.layers(model)[i].self_attn
        attn(builders.layer_inputs(ctx, sum(DECODE_LENS), torch.bfloat16), setup.context(setup.prefill))
        x, key = builders.layer_inputs(ctx, len(DECODE_LENS), torch.bfloat16), f"layers.{i}"
        out["cand"][key] = attn(x, setup.context(setup.decode))
        for name, probs in (("ref", oracle_probs), ("ctrl", _bf16_softmax)):
            with patched(mla_mod, "attention_probs", probs):
                out[name][key] = attn(x, setup.context(setup.decode))
    if len(calls) != len(ctx.cfg.full_attn_layers):
        raise RuntimeError(f"the absorbed decode called mla.attention_probs {len(calls)} times for "
                           f"{len(ctx.cfg.full_attn_layers)} MLA layers: its softmax no longer goes through it")
    return Trial(reference=out["ref"], candidate=out["cand"], control=out["ctrl"],
                 notes=[f"contexts {DECODE_LENS}, bf16; reference: the same decode with the oracle's softmax"])


def _oracle_last_rows(ctx: CheckContext, layer: int, x_pre: torch.Tensor, x: torch.Tensor,
                      lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle MLA layer over each sequence (its prefix rows, then its decode row) in fp32 and fp64: the
    decode rows [B, H] of both."""
    rows: dict[torch.dtype, list[torch.Tensor]] = {torch.float32: [], torch.float64: []}
    start = 0
    for j, n in enumerate(lens):
        seq = torch.cat([x_pre[start:start + n], x[j:j + 1]])
        for dtype in rows:
            attn = builders.layers(builders.reference_model(ctx, dtype))[layer].self_attn
            rows[dtype].append(attn(seq.to(dtype))[-1])
        start += n
    return torch.stack(rows[torch.float32]), torch.stack(rows[torch.float64])


def _integrity_scenario(runner: ModelRunner, ids: list[int], corrupt_after: int | None) -> torch.Tensor:
    """Run a scheduler-like sequence of steps; 1 for every step after which integrity fails."""
    def admit_three() -> None:
        for sid in (1, 2, 3):
            runner.admit(sid, 40)

    def release_rest() -> None:
        for sid in (1, 3, 4):
            runner.release(sid)

    steps: list[Callable[[], object]] = [
        admit_three,
        lambda: runner.prefill([(1, ids[:9]), (2, ids[9:30]), (3, ids[30:33])]),
        lambda: runner.decode([(1, 5), (2, 6), (3, 7)]),
        lambda: runner.prefill([(3, ids[33:50])]),
        lambda: runner.decode([(1, 8), (3, 9)]),
        lambda: runner.release(2),
        lambda: runner.admit(4, 24),
        lambda: runner.prefill([(4, ids[:20])]),
        lambda: runner.decode([(1, 1), (3, 2), (4, 3)]),
        release_rest,
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
@builders.single_thread
def check_cache_integrity(ctx: CheckContext) -> Trial:
    model = builders.served_model(ctx)
    ids = builders.prompt(ctx, 50, salt=20).tolist()
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
@builders.single_thread
def check_untouched_slots(ctx: CheckContext) -> Trial:
    model = builders.served_model(ctx)
    ids = builders.prompt(ctx, 40, salt=21).tolist()

    def run(fault: bool) -> dict[str, dict[str, torch.Tensor]]:
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

        def leaky(layer: int, slots: torch.Tensor, value: torch.Tensor) -> None:
            store(layer, slots, value)
            store(layer, slots + 1, value)
        with patched(pool, "store_state", leaky) if fault else contextlib.nullcontext():
            runner.prefill([(1, ids[:12]), (2, ids[12:31])])
            for step in range(3):
                runner.decode([(1, ids[31 + step]), (2, ids[34 + step])])
        after = {name: _bits(t.index_select(1, idle_slots)) for name, t in pool.tensors().items()}
        after["latent_pages"] = _bits(cache.data.index_select(1, idle_pages))
        runner.release(1)
        runner.release(2)
        return {"before": snapshot, "after": after}

    good, bad = run(False), run(True)
    return Trial(reference=good["before"], candidate=good["after"], control=bad["after"], notes=[
        "idle slots (scratch included) and idle pages (scratch included) filled with alternating 1e30 / NaN "
        "sentinels, compared as raw bits before and after a prefill and 3 decode steps of two sequences"])
