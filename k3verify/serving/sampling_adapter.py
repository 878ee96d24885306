"""The engine's sampler contract, over today's sampler until the counter-based one lands (issue 15).

`sample_tokens(logits [B, V] fp32, params, seeds [B] int64, positions [B] int64) -> [B] int64` on the
logits' device. Greedy rows are an argmax on the device (no host synchronisation). A sampled row draws
from a generator keyed by (request seed, token position) only, so a seeded request draws the same numbers
whatever shares its batch and whichever step produced the token. This adapter realises that key with a
fresh CPU generator per sampled row (sampler.sample_row), which costs one device->host copy per step that
has a sampled row; issue 15's on-device counter-based sampler removes it behind the same signature.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3verify.serving.sampler import SamplingParams, sample_row

_MASK64 = (1 << 64) - 1


def counter_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position): splitmix64 of the pair, so neighbouring positions
    and neighbouring seeds give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Row i's token under params[i], keyed by (seeds[i], positions[i]) -> [B] int64 on logits' device."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or seeds.shape != (len(params),) \
            or positions.shape != (len(params),):
        raise ValueError(f"logits {tuple(logits.shape)}, seeds {tuple(seeds.shape)}, positions "
                         f"{tuple(positions.shape)} for {len(params)} params")
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled:
        return tokens
    host_seeds, host_pos = seeds.tolist(), positions.tolist()
    draws = [sample_row(logits[i], params[i], torch.Generator().manual_seed(counter_seed(host_seeds[i], host_pos[i])))
             for i in sampled]
    tokens[torch.tensor(sampled, device=logits.device)] = torch.tensor(draws, device=logits.device)
    return tokens
