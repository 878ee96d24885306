"""What the endpoint checks share: the session, the prompts, and the greedy answers every token check reuses.

Prompts are token ids drawn from the tokenizer's plain (non-special) vocabulary, seeded by the run seed, so a
server that validates prompt ids against its tokenizer accepts them. Greedy answers are requested one at a time
("alone"), so endpoint.batch.invariance can compare them with the same requests under concurrent load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3verify.endpoint.session import EndpointSession
from k3verify.endpoint.wire import Answer
from k3verify.gates.core.check import CheckContext, SkipCheck

TOP_K = 5


@dataclass(frozen=True)
class Sizes:
    """How much each suite asks of the endpoint: prompt lengths (one greedy request each), tokens per answer,
    prompts scored with echo, prompts streamed, and sampled requests sent as load in the batch check."""

    lengths: tuple[int, ...]
    new_tokens: int
    scored: int
    streamed: int
    noise: int


QUICK = Sizes(lengths=(5, 17, 40), new_tokens=8, scored=2, streamed=1, noise=6)
FULL = Sizes(lengths=(5, 17, 40, 64, 3, 100), new_tokens=16, scored=4, streamed=2, noise=12)


@dataclass
class Greedy:
    """One greedy request and what came back, by token id."""

    prompt: list[int]
    answer: Answer
    tokens: list[int]  # the generated ids up to the first one the server's answer did not identify
    unresolved: int  # generated positions left out because their id could not be identified


def session(ctx: CheckContext) -> EndpointSession:
    if ctx.endpoint is None:
        raise SkipCheck("no endpoint under test: run `k3verify parity --endpoint URL` (or --endpoint self)")
    return ctx.endpoint


def sizes(ctx: CheckContext) -> Sizes:
    return FULL if ctx.suite == "full" else QUICK


def plain_vocab(ctx: CheckContext) -> int:
    """Ids below this are ordinary tokens of the checkpoint's tokenizer (its specials come after them)."""
    return int(ctx.target.tokenizer().num_base_tokens)


def prompts(ctx: CheckContext) -> list[list[int]]:
    g = torch.Generator().manual_seed(ctx.seed * 1_000_003 + 19)
    return [torch.randint(0, plain_vocab(ctx), (n,), generator=g).tolist() for n in sizes(ctx).lengths]


def greedy_body(ctx: CheckContext) -> dict[str, int]:
    return {"max_tokens": sizes(ctx).new_tokens, "temperature": 0, "logprobs": TOP_K}


def greedy_answers(ctx: CheckContext) -> list[Greedy]:
    """Each prompt's greedy answer with top-k logprobs, requested one at a time; cached for the run."""
    if "endpoint.greedy" not in ctx.cache:
        ep = session(ctx)
        if not ep.caps.completions.available:
            raise SkipCheck(f"the endpoint cannot serve token-id prompts with logprobs: {ep.caps.completions.reason}")
        out = []
        for prompt in prompts(ctx):
            answer = ep.complete(prompt, **greedy_body(ctx))
            tokens = answer.resolved_ids()
            out.append(Greedy(prompt, answer, tokens, len(answer.steps) - len(tokens)))
        if not any(g.tokens for g in out):
            raise SkipCheck("the endpoint's logprobs identify none of its tokens (no token ids, no unambiguous text): "
                            "token identity by id is impossible here")
        ctx.cache["endpoint.greedy"] = out
    cached: list[Greedy] = ctx.cache["endpoint.greedy"]
    return cached


def as_ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)
