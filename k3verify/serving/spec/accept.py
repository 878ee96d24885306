"""Acceptance of k draft tokens from one score row: logits [k+1, V] (row j predicts the token after
position j, position 0 being the last accepted token) -> the tokens to emit (accepted drafts + one more).

Greedy: the longest prefix of drafts equal to the model's argmax, then the bonus token (the argmax after
the last accepted position). Sampling: standard speculative rejection sampling for a deterministic drafter
(its proposal q is one-hot on the draft): draft d at row j is accepted with probability p_j(d); on the
first rejection the emitted token is drawn from p_j with d removed (max(p - q, 0), renormalized); if every
draft survives, the bonus token is drawn from p_k. p_j is the request's own distribution (temperature,
top-k, top-p as the sampler applies them) and every draw uses the request's counter-based numbers for its
position (an acceptance coin and the token draw, independent streams), so each emitted token is distributed
exactly as plain sampling would draw it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from k3verify.serving.sampler import SamplingParams, accept_coin, draw_from, token_distribution


@dataclass(frozen=True)
class Accepted:
    """num_accepted drafts survived (the commit keeps positions 0..num_accepted); `tokens` are emitted."""

    num_accepted: int
    tokens: list[int]  # the accepted drafts, then one token from the row after the last accepted position


def accept_greedy(logits: torch.Tensor, drafts: list[int]) -> Accepted:
    """[k+1, V] logits, k drafts -> accepted drafts + the bonus token (1..k+1 tokens)."""
    _check(logits, drafts)
    return accept_greedy_ids(logits.argmax(dim=-1).tolist(), drafts)


def greedy_counts(best: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The greedy rule on the device: best [B, k+1] argmax ids, drafts [B, k] -> [B] int64 drafts accepted (the
    longest prefix where each draft equals the argmax before it), so a commit can follow a score without a host
    round trip. accept_greedy_ids is the same rule on the host, and callers hold the two to each other."""
    k = drafts.shape[1]
    return (best[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)


def accept_greedy_ids(best: list[int], drafts: list[int]) -> Accepted:
    """accept_greedy on the rows' argmax ids already on the host (one transfer for a whole score batch)."""
    if len(best) != len(drafts) + 1:
        raise ValueError(f"acceptance needs k+1 = {len(drafts) + 1} argmax ids; got {len(best)}")
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return Accepted(a, drafts[:a] + [best[a]])


def accept_read_back(out: list[list[int]], drafts: list[list[int]], rejected: Collection[int] = ()
                     ) -> list[Accepted]:
    """After SpecScorer.commit_greedy: rows [k+1 argmax ids..., the device's count] read back -> each row's
    Accepted by the host's rule (rows in `rejected` accept nothing), held to the counts the device committed."""
    results = [Accepted(0, []) if r in rejected else accept_greedy_ids(o[:-1], d)
               for r, (o, d) in enumerate(zip(out, drafts, strict=True))]
    if [a.num_accepted for a in results] != [o[-1] for o in out]:
        raise RuntimeError(f"greedy acceptance on the device committed {[o[-1] for o in out]} drafts, on the host "
                           f"{[a.num_accepted for a in results]}: the two rules disagree")
    return results


def token_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The request's sampling distribution over a [V] logit row (what the sampler draws a token from)."""
    return token_distribution(row, params)


def accept_sampled(logits: torch.Tensor, drafts: list[int], params: SamplingParams, seed: int,
                   position: int) -> Accepted:
    """[k+1, V] logits, k drafts, a sampled request -> accepted drafts + one token drawn as described above.
    Row j predicts the token at `position + j`; its coin and its draw are the request's counter-based numbers
    for that position (serving/sampler.py), so no generator state is consumed and a batch cannot shift them."""
    _check(logits, drafts)
    if params.is_greedy:
        return accept_greedy(logits, drafts)
    for j, d in enumerate(drafts):
        p = token_probs(logits[j], params)
        if accept_coin(seed, position + j) < float(p[d]):
            continue
        residual = p.clone()
        residual[d] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p is one-hot on d, yet u >= p[d] = 1 cannot happen with u in (0, 1)
            raise RuntimeError(f"rejection sampling: draft {d} rejected with no mass left elsewhere (p[d]={p[d]})")
        return Accepted(j, drafts[:j] + [draw_from(residual / total, seed, position + j)])
    bonus = token_probs(logits[len(drafts)], params)
    return Accepted(len(drafts), drafts + [draw_from(bonus, seed, position + len(drafts))])


def _check(logits: torch.Tensor, drafts: list[int]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"acceptance needs [k+1, V] logits for k={len(drafts)} drafts; got {tuple(logits.shape)}")
