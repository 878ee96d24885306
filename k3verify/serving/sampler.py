"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators, logprobs.

Every sampled row draws from its own request's torch.Generator, one row at a time, so a seeded
request produces the same tokens whatever else shares its batch (given batch-invariant logits).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and the stop logic. temperature 0 means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token plus the top k
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit before sampling)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2]; got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive; got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0; got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the top-k alternatives (under the raw model distribution)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded when asked, else from the OS entropy pool."""
    g = torch.Generator(device="cpu")
    g.manual_seed(secrets.randbits(63) if seed is None else seed)
    return g


def filter_logits(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the top-p nucleus of a [V] row."""
    vocab = row.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p  # the first token always survives: its mass_before is 0
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
        row = row.masked_fill(drop, float("-inf"))
    return row


def sample_row(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from a [V] fp32 logit row."""
    if params.is_greedy:
        return int(torch.argmax(row))
    # The request's generator lives on the CPU: draw there, so a seed means the same on every device.
    scaled = filter_logits(row.float().cpu() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> list[int]:
    """Tokens for a [n, V] logit batch; row i uses params[i] and generators[i]."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"logits {tuple(logits.shape)} vs {len(params)} params, {len(generators)} generators")
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [greedy[i] if p.is_greedy else sample_row(logits[i], p, generators[i]) for i, p in enumerate(params)]


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """Logprob of tokens[i] under row i of [n, V] logits, with the num_top[i] most likely; None where not asked."""
    out: list[TokenLogprob | None] = [None] * len(tokens)
    rows = [i for i, k in enumerate(num_top) if k is not None]
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    for j, i in enumerate(rows):
        k = min(int(num_top[i] or 0), logp.shape[-1])
        top = torch.topk(logp[j], k) if k else None
        pairs = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        out[i] = TokenLogprob(tokens[i], float(logp[j, tokens[i]]), pairs)
    return out


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[n, V] logits with each row's logit_bias added: `logits` itself when no row has a bias, else a biased copy.
    Logprobs stay those of the raw model distribution: only the choice of token is biased."""
    rows = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    biased = logits.clone()
    for i, pairs in rows:
        ids = torch.tensor([t for t, _ in pairs], device=logits.device)
        biased[i, ids] += torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
    return biased


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """Rows holding NaN or +inf (-inf is a legitimate mask value)."""
    bad = torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1)
    return bad.nonzero().flatten().tolist()
