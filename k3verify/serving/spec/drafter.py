"""Drafters: who proposes the k tokens a score pass checks. Neither needs a second model.

NgramDrafter (prompt lookup): find the longest suffix of prompt + output (up to max_ngram tokens) that
occurred earlier, take its most recent earlier occurrence, and propose the tokens that followed it.
ControlledDrafter (bench and checks): proposes a known continuation (the model's own greedy output) with
each draft token independently replaced by a different token with probability `corrupt`, so the
acceptance rate is set by construction: random-weight checkpoints make n-gram acceptance meaningless.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol


class Drafter(Protocol):
    num_draft: int

    def propose(self, seq_id: int, tokens: Sequence[int]) -> list[int]:
        """Up to num_draft tokens to follow `tokens` (prompt + output so far); [] when it has no guess."""
        ...


class NgramDrafter:
    def __init__(self, num_draft: int, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if num_draft < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need num_draft >= 1 and 1 <= min_ngram <= max_ngram; got {num_draft}, "
                             f"{min_ngram}, {max_ngram}")
        self.num_draft, self.max_ngram, self.min_ngram = num_draft, max_ngram, min_ngram

    def propose(self, seq_id: int, tokens: Sequence[int]) -> list[int]:
        toks = list(tokens)
        for size in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            suffix = toks[-size:]
            # the most recent earlier occurrence: scan starts right to left, excluding the suffix itself
            for start in range(len(toks) - size - 1, -1, -1):
                if toks[start:start + size] == suffix:
                    follow = toks[start + size:start + size + self.num_draft]
                    if follow:
                        return follow
        return []


class ControlledDrafter:
    def __init__(self, num_draft: int, references: Mapping[int, Sequence[int]], corrupt: float, vocab_size: int,
                 seed: int = 0) -> None:
        """references[seq_id]: the whole sequence the drafts follow (prompt + the known continuation)."""
        if num_draft < 1 or not 0.0 <= corrupt <= 1.0 or vocab_size < 2:
            raise ValueError(f"need num_draft >= 1, corrupt in [0, 1], vocab_size >= 2; got {num_draft}, {corrupt}, "
                             f"{vocab_size}")
        self.num_draft, self.corrupt, self.vocab_size, self.seed = num_draft, corrupt, vocab_size, seed
        self.references = {k: list(v) for k, v in references.items()}
        # every position's draft, drawn once here (a propose is then a slice: the draws are a pure function of
        # (seed, sequence, position), and the bench times propose inside each speculative round)
        self._drafts = {k: [self._draft(k, pos, tok) for pos, tok in enumerate(v)] for k, v in self.references.items()}

    def _draft(self, seq_id: int, pos: int, tok: int) -> int:
        # the same (seed, sequence, position) always draws the same: runs are reproducible
        rng = random.Random(f"{self.seed}:{seq_id}:{pos}")
        if rng.random() < self.corrupt:
            tok = (tok + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
        return tok

    def propose(self, seq_id: int, tokens: Sequence[int]) -> list[int]:
        drafts = self._drafts.get(seq_id)
        if drafts is None:
            raise KeyError(f"ControlledDrafter has no reference continuation for sequence {seq_id}")
        m = len(tokens)
        return drafts[m:m + self.num_draft]


class WithoutDrafts:
    """`inner`, except that the sequences in `silent` get no drafts: in a batch with drafting rows they ride along
    in the score pass on filler drafts (offline.filler_drafts). The checks and tests use it to exercise riders."""

    def __init__(self, inner: Drafter, silent: Collection[int]) -> None:
        self.inner, self.silent, self.num_draft = inner, frozenset(silent), inner.num_draft

    def propose(self, seq_id: int, tokens: Sequence[int]) -> list[int]:
        return [] if seq_id in self.silent else self.inner.propose(seq_id, tokens)
