"""The long-context oracle run every long check shares: one prompt of LONG_TOKENS tokens, run once per run
through the fp32 oracle (with its router decisions), cached in ctx.cache under the prompt's ids.

A fault that shows only in long sequences (a page index that wraps past 64 pages, an expert that drops tokens
past a capacity, a prefill segment that starts one position off, a query block of the attention at the wrong
offset) has nowhere to show in a check of a few hundred tokens; these prompts are past 64 pages of 16 tokens,
past the attention's 1,024-row query blocks and put several hundred tokens on one expert in one call.
Other checks (prefix caching, the near-tie excuse) take the same run through `long_prompt` / `long_oracle`.
"""

from __future__ import annotations

from typing import Any

import torch

from k3verify.gates.core.check import CheckContext, SkipCheck
from k3verify.gates.shared import builders
from k3verify.gates.shared.route_pin import PinStats, RouteRecord, pin_routes, record_routes

LONG_TOKENS = 4000  # within k3-tiny's max_position_embeddings of 4096
LONG_SALT = 45_000  # the long prompt's own seed salt: no other check draws a prompt of this length with it
MIN_LONG_TOKENS = 1100  # past 64 pages of 16 tokens and one 1,024-row query block: shorter is not "long"


def long_length(ctx: CheckContext) -> int:
    """LONG_TOKENS, or the model's max_position_embeddings when smaller (a skip when that is not long)."""
    n = min(LONG_TOKENS, ctx.cfg.max_position_embeddings)
    if n < MIN_LONG_TOKENS:
        raise SkipCheck(f"max_position_embeddings {ctx.cfg.max_position_embeddings} < {MIN_LONG_TOKENS}: "
                        "no long context to check")
    return n


def long_prompt(ctx: CheckContext) -> torch.Tensor:
    """The shared long prompt: token ids [long_length(ctx)] from the run's seed."""
    return builders.prompt(ctx, long_length(ctx), salt=LONG_SALT)


def long_oracle(ctx: CheckContext) -> tuple[Any, RouteRecord]:
    """The fp32 oracle's forward over the long prompt (logits [T, V], no captures) and its router decisions;
    run once per run, shared by every check that asks."""
    ids = long_prompt(ctx)
    key = f"long_context.oracle.{hash(tuple(ids.tolist()))}"
    if key not in ctx.cache:
        ref = builders.reference_model(ctx)
        with record_routes(ref) as routes:
            ctx.cache[key] = (ref(ids.to(ctx.device)), routes)
    out: tuple[Any, RouteRecord] = ctx.cache[key]
    return out


def long_gold(ctx: CheckContext) -> torch.Tensor:
    """The oracle in fp64 over the long prompt, routes pinned to the fp32 run's near-tie choices (the noise of a
    long check: only measured where noise.json holds no recording for this run). Cached per run."""
    ids = long_prompt(ctx)
    key = f"long_context.gold.{hash(tuple(ids.tolist()))}"
    if key not in ctx.cache:
        _, routes = long_oracle(ctx)
        gold = builders.reference_model(ctx, torch.float64)
        with pin_routes(gold, routes, builders.reference_model(ctx), ctx.cfg, PinStats()):
            ctx.cache[key] = gold(ids.to(ctx.device)).logits
    logits: torch.Tensor = ctx.cache[key]
    return logits
