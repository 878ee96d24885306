"""Serving checks on the prefix cache: a request served from a cached prefix gives the bits of the same request
served cold, and nothing cached survives a change of the weights.

- serving.prefix.hit_equals_cold: prompts built to catch each wrong cache are served one at a time with the cache
  on (snapshot budget of a few entries, a page pool the cache must give back), then some together with sampling
  seeds (two of them the same cached prompt, whose partial last page both would write, one steered to another
  token); the reference serves each
  prompt alone and cold, its prefill cut where the request's was (its cached prefix's cuts included). One at a
  time: tokens and logprobs bit for bit; together: tokens (batched GEMMs of other row counts round differently).
  The family: branches of one prefix in the middle of a block and on its edge, a prompt one token off inside its
  last (partial) block at the same length, equal blocks under different first blocks with the same tail, a
  3-token prompt and its extension, repeats. Control: the same requests served with the KDA snapshot not restored
  (the state of a cached prefix lost), which must differ.
- serving.prefix.weights_reload: a prompt cached, one weight written in place (what a reload does), the prompt
  again: it must answer what a cold engine on the new weights answers. Control: the answer cached before the write.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from k3verify.gates import CheckContext, Kind, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.prefix_drive import Served, as_tensors, serve
from k3verify.serving import prefix_reuse
from k3verify.serving.prefix_reuse import BLOCK, PrefixSettings
from k3verify.serving.runner import ModelRunner
from k3verify.serving.sampler import SamplingParams

NEW = 4  # generated tokens per request
PAGE = 16
STEER = 7  # the token the second request sent together is steered to
SNAPSHOTS = 10  # the snapshot budget, in snapshots: small enough that the family evicts


def family(ctx: CheckContext) -> tuple[list[list[int]], list[list[int]]]:
    """(one at a time, together) prompts of the check."""
    g = torch.Generator().manual_seed(ctx.seed * 7_340_033 + 47)
    vocab = int(ctx.target.tokenizer().num_base_tokens)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    x = ids(2 * BLOCK + 20)
    a, b = x + ids(9), x[: BLOCK + 30] + ids(14)
    off = list(a)
    off[-3] = (off[-3] + 1) % vocab  # inside the last, partial block; same length as `a`
    z, tail = ids(BLOCK + 8), ids(10)
    p1, p2 = ids(BLOCK) + z + tail, ids(BLOCK) + z + tail  # equal blocks under different first blocks
    short = ids(3)
    edge = x[: 2 * BLOCK] + ids(5)
    alone = [a, short, b, a, off, p1, p2, short, short + ids(4), edge, x[: 2 * BLOCK], b, p1, a]
    together = [a, a, b, edge, short]
    return alone, together


def _runner(ctx: CheckContext, prefix: bool, num_pages: int) -> ModelRunner:
    runner = ModelRunner(builders.served_model(ctx), num_pages=num_pages, page_size=PAGE, num_slots=4, max_context=512)
    if prefix:
        reuse = runner.enable_prefix_cache(str(ctx.target.digest), ctx.cfg.vocab_size, PrefixSettings(grid=2 * BLOCK))
        reuse.cache.budget_bytes = SNAPSHOTS * reuse.one_snapshot
    return runner


@contextmanager
def _not_restored() -> Iterator[None]:
    """The control's wrong cache: a hit's KDA snapshot is not copied into its slot (it keeps the zero state)."""
    restore = prefix_reuse.restore
    prefix_reuse.restore = lambda snap, pool, slot: None
    try:
        yield
    finally:
        prefix_reuse.restore = restore


def _greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=3) for _ in range(n)]


def _sampled(n: int) -> list[SamplingParams]:
    """The requests sent together: sampled with their own seeds, except the second, steered by logit_bias to
    another token than the first's, so the two resuming from one whole-prompt entry surely write different
    latents at its end (a toy model's distribution can be so peaked that two seeds draw the same token)."""
    out = [SamplingParams(max_tokens=NEW + 4, temperature=1.0, seed=101 + i, ignore_eos=True) for i in range(n)]
    out[1] = SamplingParams(max_tokens=NEW + 4, temperature=0.0, ignore_eos=True, logit_bias=((STEER, 100.0),))
    return out


def _run(ctx: CheckContext, alone: list[list[int]], together: list[list[int]],
         num_pages: int) -> tuple[list[Served], list[Served], dict[str, float]]:
    runner = _runner(ctx, True, num_pages)
    tok, eos, vocab = ctx.target.tokenizer(), tuple(ctx.cfg.eos_token_ids), ctx.cfg.vocab_size
    one = serve(runner, tok, alone, _greedy(len(alone)), eos=eos, vocab_size=vocab)
    many = serve(runner, tok, together, _sampled(len(together)), eos=eos, vocab_size=vocab, together=True,
                 max_step_tokens=96)
    assert runner.prefix is not None
    c = runner.prefix.cache.counters
    return one, many, {"hits": c.hits, "tokens_reused": c.tokens_reused, "evictions": c.evictions,
                       "pages_copied": runner.prefix.cache.kv.num_copied}


@register_check(
    id="serving.prefix.hit_equals_cold", component="serving", level="serving", kind=Kind.BITEXACT,
    control="the same requests served with each hit's KDA snapshot not restored (the cached state lost)",
)
@builders.single_thread
def check_prefix_hit_equals_cold(ctx: CheckContext) -> Trial:
    alone, together = family(ctx)
    pages = 2 + sum(-(-(len(p) + NEW + 4) // PAGE) for p in together)  # the cache must give pages back to admit
    one, many, metrics = _run(ctx, alone, together, pages)
    tok, eos, vocab = ctx.target.tokenizer(), tuple(ctx.cfg.eos_token_ids), ctx.cfg.vocab_size
    cold_one = serve(_runner(ctx, False, 256), tok, alone, _greedy(len(alone)), eos=eos, vocab_size=vocab,
                     forced=[s.cuts for s in one])
    cold_many = serve(_runner(ctx, False, 256), tok, together, _sampled(len(together)), eos=eos, vocab_size=vocab,
                      forced=[s.cuts for s in many])
    with _not_restored():
        wrong_one, wrong_many, _ = _run(ctx, alone, together, pages)
    ref = {**as_tensors(cold_one, True), **{f"together.{k}": v for k, v in as_tensors(cold_many, False).items()}}
    cand = {**as_tensors(one, True), **{f"together.{k}": v for k, v in as_tensors(many, False).items()}}
    ctrl = {**as_tensors(wrong_one, True), **{f"together.{k}": v for k, v in as_tensors(wrong_many, False).items()}}
    served = [f"{s.cached}/{len(p)}" for s, p in zip(one, alone, strict=True)]
    notes = [f"one at a time, cached/prompt tokens per request: {', '.join(served)}",
             f"together: {', '.join(f'{s.cached}/{len(p)}' for s, p in zip(many, together, strict=True))}"]
    if not metrics["hits"] or not any(s.cached == len(p) for s, p in zip(one, alone, strict=True)):
        raise RuntimeError(f"the prefix family produced no hits or no whole-prompt hit ({served}): nothing compared")
    return Trial(reference=ref, candidate=cand, control=ctrl, metrics=metrics, notes=notes)


@register_check(
    id="serving.prefix.weights_reload", component="serving", level="serving", kind=Kind.BITEXACT,
    control="the answer the cache gave before the weight was written",
)
@builders.single_thread
def check_prefix_weights_reload(ctx: CheckContext) -> Trial:
    alone, _ = family(ctx)
    prompt = alone[0]
    tok, eos, vocab = ctx.target.tokenizer(), tuple(ctx.cfg.eos_token_ids), ctx.cfg.vocab_size
    runner = _runner(ctx, True, 64)
    before = serve(runner, tok, [prompt, prompt], _greedy(2), eos=eos, vocab_size=vocab)
    model = builders.served_model(ctx)
    weight = model.get_parameter("lm_head.weight") if hasattr(model, "lm_head") else next(model.parameters())
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(1.5)
        after = serve(runner, tok, [prompt], _greedy(1), eos=eos, vocab_size=vocab)
        cold = serve(_runner(ctx, False, 64), tok, [prompt], _greedy(1), eos=eos, vocab_size=vocab,
                     forced=[after[0].cuts])
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    if before[1].cached != len(prompt):
        raise RuntimeError(f"the repeated prompt was not a whole-prompt hit ({before[1].cached}/{len(prompt)} "
                           "cached): the reload case is not exercised")
    return Trial(reference=as_tensors(cold, True), candidate=as_tensors(after, True),
                 control=as_tensors(before[1:], True),
                 notes=[f"after the write: {after[0].cached}/{len(prompt)} prompt tokens from the cache"])
