"""Speculative decoding: the score pass, its KDA records, the commit of the accepted prefix, greedy output.

- spec.records.vs_sequential: one KDA layer's score ops over k+1 positions record, bit for bit, the
  states, windows and outputs that k+1 sequential decode steps produce, and leave the pool untouched.
- spec.verify.logits: a score pack's logits at every position vs the same tokens decoded one at a time.
- spec.commit.accepted_prefix: after score + commit on NaN-poisoned caches and arena, each slot holds the
  record of its accepted position, rejected MLA positions hold their old bits, idle storage is untouched.
- spec.greedy.vs_plain: speculative greedy generation (drafts: the model's own continuation, half of them
  corrupted) equals plain greedy generation token for token.
- spec.engine.gated_vs_plain: the same through the engine, under a cost policy that declines scores and probes
  again: launch-ahead plain steps alternate with in-order score steps, and the tokens equal plain greedy's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from k3verify.gates import CheckContext, Kind, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.engine_run import collect_events
from k3verify.gates.shared.patch import patched
from k3verify.gates.shared.spec_cases import NUM_DRAFT, OpCase, bits, op_case, poison_caches
from k3verify.kernels import conv as conv_ops
from k3verify.kernels import kda as kda_ops
from k3verify.kernels.kda.score import SCORE_CONV, SCORE_NORM, SCORE_RECORD, kda_score
from k3verify.kernels.norm import GATED_RMS, gated_rms_norm
from k3verify.serving.engine import Engine
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner, generate_greedy
from k3verify.serving.sampler import SamplingParams
from k3verify.serving.spec import scorer as scorer_module
from k3verify.serving.spec.arena import commit_accepted
from k3verify.serving.spec.drafter import ControlledDrafter, WithoutDrafts
from k3verify.serving.spec.offline import generate_speculative
from k3verify.serving.spec.policy import CostPolicy, SpecPolicy
from k3verify.serving.spec.scorer import SpecScorer
from k3verify.serving.spec.step import SpecCounters, SpeculativeStep
from k3verify.tokenizer import default_tokenizer

PROMPT_LENS = (9, 17, 5)
ACCEPTED = [0, 2, NUM_DRAFT]  # per scored row: none, some, all drafts kept


def _sequential(case: OpCase) -> dict[str, torch.Tensor]:
    """k+1 decode steps (conv.causal_decode + kda.decode_slots) on a copy of the pool: each step's output and
    the state / windows the rows' slots hold after it."""
    windows, state = case.pool_copy()
    B, n, h, dk = case.shape
    out: dict[str, list[torch.Tensor]] = {"o": [], "states": [], "windows": []}
    for j in range(n):
        xq, xk, xv = case.xs
        q, k, v = conv_ops.conv_decode_qkv((xq[:, j], xk[:, j], xv[:, j]), case.weights, windows, case.slots,
                                           case.keep)
        o = kda_ops.kda_decode_slots(q.view(B, h, dk), k.view(B, h, dk), v.view(B, h, dk), case.g[:, j],
                                     case.beta[:, j], state, case.slots, case.scale)
        out["o"].append(o)
        out["states"].append(state.index_select(0, case.slots))
        out["windows"].append(torch.stack([w.index_select(0, case.slots) for w in windows], dim=1))
    return {key: torch.stack(v, dim=1) for key, v in out.items()}


def _scored(case: OpCase) -> dict[str, torch.Tensor]:
    """The score ops on the pool itself (read only), into NaN-filled records."""
    B, n, h, dk = case.shape
    W1 = case.windows[0].shape[-1]
    conv_rec = torch.full((B, n, 3, case.windows[0].shape[1], W1), float("nan"), device=case.g.device)
    state_rec = torch.full((B, n, h, dk, dk), float("nan"), device=case.g.device)
    pool_before = bits(torch.cat([case.state.flatten(), *(w.flatten() for w in case.windows)]))
    o, y = kda_score(case.xs, case.weights, case.windows, case.state, case.slots, case.keep, case.g, case.beta,
                      case.gate, case.norm_weight, case.eps, case.scale, conv_rec, state_rec, fused=False)
    pool_after = bits(torch.cat([case.state.flatten(), *(w.flatten() for w in case.windows)]))
    return {"o": o, "y": y, "states": state_rec, "windows": conv_rec, "pool_before": pool_before,
            "pool_after": pool_after}


@register_check(
    id="spec.records.vs_sequential", component="kda", level="kernel", kind=Kind.BITEXACT,
    control="records one position late (record j holds the state before position j)",
)
@builders.single_thread
@builders.torch_path(conv_ops.CAUSAL_DECODE, kda_ops.DECODE_SLOTS, GATED_RMS, SCORE_CONV, SCORE_RECORD, SCORE_NORM)
def check_records_vs_sequential(ctx: CheckContext) -> Trial:
    case = op_case(ctx, torch.float32)
    seq, ver = _sequential(case), _scored(case)
    # the gated norm is not a decode-step op per position (CPU vectorizes [B, n, ...] differently from [B, ...]):
    # the reference applies it to the sequential outputs at the score's shape
    seq["y"] = gated_rms_norm(seq["o"], case.gate, case.norm_weight, case.eps)
    ref = {k: seq[k] for k in ("o", "y", "states", "windows")} | {"pool": ver["pool_before"]}
    cand = {k: ver[k] for k in ("o", "y", "states", "windows")} | {"pool": ver["pool_after"]}
    first_state = case.state.index_select(0, case.slots)[:, None]
    first_win = torch.stack([w.index_select(0, case.slots) for w in case.windows], dim=1)[:, None]
    ctrl = cand | {"states": torch.cat([first_state, ver["states"][:, :-1]], 1),
                   "windows": torch.cat([first_win, ver["windows"][:, :-1]], 1)}
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        f"{case.shape[0]} rows x {case.shape[1]} positions (k={NUM_DRAFT}), fp32, one KDA layer's dims; pool "
        "idle slots hold NaN / 1e30, records start NaN; `pool` = raw bits of the pool before vs after the score"])


def _prefilled(ctx: CheckContext, poison: bool) -> tuple[ModelRunner, list[list[int]]]:
    runner = ModelRunner(builders.serving_model(ctx), num_pages=32, page_size=8, num_slots=4, max_context=128)
    if poison:
        poison_caches(runner)
    prompts = [builders.prompt(ctx, n, salt=40 + i).tolist() for i, n in enumerate(PROMPT_LENS)]
    for sid, p in enumerate(prompts):
        runner.admit(sid, len(p) + 2 * (NUM_DRAFT + 1))
    runner.prefill(list(enumerate(prompts)))
    return runner, prompts


def _score_rows(ctx: CheckContext) -> list[list[int]]:
    return [builders.prompt(ctx, NUM_DRAFT + 1, salt=50 + i).tolist() for i in range(len(PROMPT_LENS))]


@register_check(
    id="spec.verify.logits", component="serving", level="serving", kind=Kind.RMS,
    noise="the K3 reference's logits in fp32 vs fp64 (routes pinned) on each prompt + its score row, at the "
    "scored positions (the score pack's GEMMs run k+1 rows per sequence where decode runs one: rounding only)",
    control="the score row is built without the last accepted token (drafts shifted one position early)",
)
@builders.single_thread
def check_score_logits(ctx: CheckContext) -> Trial:
    rows = _score_rows(ctx)

    def scored(shift: bool) -> torch.Tensor:
        runner, _ = _prefilled(ctx, poison=False)
        scorer = SpecScorer(runner, NUM_DRAFT, len(rows))
        packs = [r[1:] + r[-1:] if shift else r for r in rows]
        logits = scorer.score(list(enumerate(packs)))
        scorer.commit([0] * len(rows))
        return logits

    runner, prompts = _prefilled(ctx, poison=False)
    ref = torch.stack([runner.decode([(sid, r[j]) for sid, r in enumerate(rows)]) for j in range(NUM_DRAFT + 1)], 1)
    noise = _oracle_score_rows(ctx, prompts, rows) if ctx.needs_noise else None
    return Trial(reference=ref, candidate=scored(False), control=scored(True), position_dim=1, noise=noise, notes=[
        f"prompts {PROMPT_LENS}, one score pack of {NUM_DRAFT + 1} tokens each vs {NUM_DRAFT + 1} decode steps "
        "of the same tokens"])


def _oracle_score_rows(ctx: CheckContext, prompts: list[list[int]], rows: list[list[int]]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's logits [B, k+1, V] at each scored position, in fp32 and in fp64 (routes pinned)."""
    low, high = [], []
    for prompt, row in zip(prompts, rows, strict=True):
        ids, span = torch.tensor(prompt + row), slice(len(prompt), len(prompt) + len(row))
        low.append(builders.reference_forward(ctx, ids)[0].logits[span])
        high.append(builders.reference_gold(ctx, ids).logits[span])
    return torch.stack(low), torch.stack(high)


def _committed(ctx: CheckContext, accepted: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(expected, actual) bits after score + commit of `accepted` drafts, on poisoned caches and arena; the
    expectation is always built for ACCEPTED."""
    runner, _ = _prefilled(ctx, poison=True)
    pool, cache = runner.state_pool, runner.kv_cache
    scorer = SpecScorer(runner, NUM_DRAFT, len(PROMPT_LENS))
    scorer.arena.poison()
    slots = torch.tensor([runner.slot_of(s) for s in range(len(PROMPT_LENS))], device=ctx.device)
    used = set(slots.tolist()) | {p for s in range(len(PROMPT_LENS)) for p in cache.table(s)}
    idle = [s for s in range(pool.num_slots + 1) if s not in used]
    idle_pages = [p for p in range(cache.num_pages) if p not in used]
    before_idle = _idle_bits(runner, idle, idle_pages)
    flat = cache.data.view(cache.data.shape[0], -1, cache.width)
    scorer.score(list(enumerate(_score_rows(ctx))))
    rows = scorer.pending_latent_rows
    written, old = flat.index_select(1, rows), scorer.arena.latents[:, : rows.numel()].clone()
    B, n = len(PROMPT_LENS), NUM_DRAFT + 1
    acc = torch.tensor(ACCEPTED, device=ctx.device)
    b = torch.arange(B, device=ctx.device)
    keep = (torch.arange(n, device=ctx.device)[None, :] <= acc[:, None]).reshape(-1)
    expected = {"state": bits(scorer.arena.state[:, b, acc]), "windows": bits(scorer.arena.conv[:, b, acc]),
                "latents": bits(torch.where(keep[None, :, None], written, old))} | before_idle
    if not all(bool(torch.isfinite(t).all()) for t in (scorer.arena.state[:, b, acc], written)):
        raise RuntimeError("the score left non-finite records or latents: the expectation itself is poisoned")
    # committed by hand (the scorer is dropped after): the control commits other counts than the expectation
    commit_accepted(pool, cache, scorer.arena, slots, torch.tensor(accepted, device=ctx.device), rows)
    for sid, a in enumerate(accepted):
        runner.mark_cached(sid, a + 1)
    actual = {"state": bits(pool.state[:, slots]),
              "windows": bits(torch.stack([t[:, slots] for t in (pool.conv_q, pool.conv_k, pool.conv_v)], 2)),
              "latents": bits(flat.index_select(1, rows))} | _idle_bits(runner, idle, idle_pages)
    return expected, actual


def _idle_bits(runner: ModelRunner, slots: list[int], pages: list[int]) -> dict[str, torch.Tensor]:
    dev = runner.kv_cache.data.device
    s, p = torch.tensor(slots, device=dev), torch.tensor(pages, device=dev)
    out = {f"idle_{k}": bits(t.index_select(1, s)) for k, t in runner.state_pool.tensors().items()}
    return out | {"idle_pages": bits(runner.kv_cache.data.index_select(1, p))}


@register_check(
    id="spec.commit.accepted_prefix", component="serving", level="serving", kind=Kind.BITEXACT,
    control="rejected drafts committed: every scored row commits all k drafts",
)
@builders.single_thread
def check_commit_accepted_prefix(ctx: CheckContext) -> Trial:
    expected, actual = _committed(ctx, ACCEPTED)
    _, wrong = _committed(ctx, [NUM_DRAFT] * len(ACCEPTED))
    return Trial(reference=expected, candidate=actual, control=wrong, notes=[
        f"rows accept {ACCEPTED} of {NUM_DRAFT} drafts; caches and arena NaN-poisoned; compared as raw bits: slot "
        "state / windows = the accepted position's record, latents of rejected positions = their pre-score bits, "
        "idle slots and pages unchanged"])


def _runner(model: ServingModel) -> ModelRunner:
    """A runner over `model` whose caches are NaN-poisoned (anything read before it was written shows)."""
    r = ModelRunner(model, num_pages=32, page_size=8, num_slots=4, max_context=128)
    poison_caches(r)
    return r


def _commit_every_draft(pool: Any, cache: Any, arena: Any, slots: torch.Tensor, accepted: torch.Tensor,
                        rows: torch.Tensor | None) -> None:
    """The greedy checks' control: every scored row commits all k drafts, rejected ones too."""
    commit_accepted(pool, cache, arena, slots, torch.full_like(accepted, NUM_DRAFT), rows)


def _commits(commit_all: bool) -> contextlib.AbstractContextManager[None]:
    """The scorer's commit as it is, or (control) committing every draft."""
    return patched(scorer_module, "commit_accepted", _commit_every_draft if commit_all else commit_accepted)


@register_check(
    id="spec.greedy.vs_plain", component="serving", level="serving", kind=Kind.BITEXACT,
    control="rejected drafts committed: every scored row commits all k drafts",
)
@builders.single_thread
def check_greedy_vs_plain(ctx: CheckContext) -> Trial:
    new = 16
    model = builders.serving_model(ctx)
    prompts = [builders.prompt(ctx, n, salt=60 + i).tolist() for i, n in enumerate(PROMPT_LENS)]

    plain = generate_greedy(_runner(model), prompts, new)
    refs = {i: p + o for i, (p, o) in enumerate(zip(prompts, plain, strict=True))}

    def speculative(commit_all: bool) -> tuple[list[list[int]], list[int], int]:
        scorer = SpecScorer(_runner(model), NUM_DRAFT, len(prompts))
        scorer.arena.poison()
        # the last prompt gets no drafts: it rides along in the others' score passes (offline.filler_drafts)
        drafter = WithoutDrafts(ControlledDrafter(NUM_DRAFT, refs, corrupt=0.5, vocab_size=ctx.cfg.vocab_size,
                                                  seed=ctx.seed), {len(prompts) - 1})

        with _commits(commit_all):
            run = generate_speculative(scorer, drafter, prompts, new, policy=SpecPolicy(min_mean_accepted=0.0))
        scorer.runner.check_integrity()
        return run.tokens, run.accepted_per_row, run.rider_rows

    cand, accepted, riders = speculative(False)
    if all(a == NUM_DRAFT for a in accepted) or not any(accepted) or not riders:
        raise RuntimeError(f"accepted drafts per score row {accepted}, {riders} rider rows: no rejection (the "
                           "control would commit the right state), no acceptance (nothing multi-token was committed) "
                           "or no rider; the check tests less than it says")
    ctrl, _, _ = speculative(True)
    return Trial(reference=torch.tensor(plain), candidate=torch.tensor(cand), control=torch.tensor(ctrl), metrics={
        "verify_rows": float(len(accepted)), "mean_accepted": sum(accepted) / max(len(accepted), 1),
        "rider_rows": float(riders)}, notes=[
        f"prompts {PROMPT_LENS}, {new} new tokens, k={NUM_DRAFT}; drafts = plain greedy continuation with each token "
        f"corrupted with probability 0.5, none for the last prompt (a rider: {riders} rider rows); accepted drafts per "
        f"score row {accepted}; caches and arena NaN-poisoned"])


@register_check(
    id="spec.engine.gated_vs_plain", component="serving", level="serving", kind=Kind.BITEXACT,
    control="rejected drafts committed: every scored row commits all k drafts",
)
@builders.single_thread
def check_engine_cost_policy_vs_plain(ctx: CheckContext) -> Trial:
    """The engine's speculative step under a cost policy that declines scores (a plain step priced at 1 us) and
    probes again every few declined steps: the engine then alternates launch-ahead plain steps (no drafts asked
    for; step n+1 launched before step n is read) with in-order score steps, and must drain the step in flight
    before each in-order one. Its greedy tokens equal plain greedy's."""
    new = 16
    model = builders.serving_model(ctx)
    prompts = [builders.prompt(ctx, n, salt=70 + i).tolist() for i, n in enumerate(PROMPT_LENS)]

    plain = generate_greedy(_runner(model), prompts, new)
    refs = {i + 1: p + o for i, (p, o) in enumerate(zip(prompts, plain, strict=True))}  # the engine's ids start at 1

    def served(commit_all: bool) -> tuple[list[list[int]], SpecCounters]:
        r = _runner(model)
        scorer = SpecScorer(r, NUM_DRAFT, len(prompts))
        scorer.arena.poison()
        drafter = ControlledDrafter(NUM_DRAFT, refs, corrupt=0.5, vocab_size=ctx.cfg.vocab_size, seed=ctx.seed)
        cost_policy = CostPolicy(score_s={len(prompts): 10.0}, decode_s={len(prompts): 1e-6}, reprobe_after=2)
        step = SpeculativeStep(scorer, drafter, SpecPolicy(min_mean_accepted=0.0), cost_policy)
        engine = Engine(r, default_tokenizer(), eos_token_ids=ctx.cfg.eos_token_ids, vocab_size=ctx.cfg.vocab_size,
                        speculator=step)

        with _commits(commit_all):
            engine.start()
            try:
                params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
                events = collect_events(engine, [(p, params) for p in prompts], timeout_s=120)
            finally:
                engine.stop()
        errors = [e.error for evs in events for e in evs if e.error is not None]
        if errors:
            raise RuntimeError(f"the engine failed a request: {errors[0]}")
        return [[t for e in evs for t in e.token_ids] for evs in events], step.counters

    cand, c = served(False)
    if not (c.plain_ahead_steps and c.score_steps and c.accepted):
        raise RuntimeError(f"{c}: the run had no launch-ahead step, no score or no accepted draft; the check tests "
                           "less than it says")
    ctrl, _ = served(True)
    return Trial(reference=torch.tensor(plain), candidate=torch.tensor(cand), control=torch.tensor(ctrl), metrics={
        "plain_ahead_steps": float(c.plain_ahead_steps), "verify_steps": float(c.score_steps),
        "gated_steps": float(c.declined_steps)}, notes=[
        f"prompts {PROMPT_LENS}, {new} new tokens, k={NUM_DRAFT}; drafts = plain greedy continuation with each token "
        f"corrupted with probability 0.5; {c.plain_ahead_steps} launch-ahead steps, {c.score_steps} scores "
        f"({c.accepted} drafts accepted), {c.declined_steps} declined; caches and arena NaN-poisoned"])
