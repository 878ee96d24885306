"""Unit-test doubles: a toy ModelRunner with real page/slot bookkeeping and a byte tokenizer.

FakeRunner refuses every protocol violation the real runner would (decode of an unadmitted sequence,
prefill twice, writing past the reservation, double admit/release), so an engine bug fails loudly.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

BOS, EOS, IM_END = 256, 257, 258
SPECIAL_NAMES = {BOS: "<|bos|>", EOS: "<|eos|>", IM_END: "<|im_end|>", 259: "<|im_user|>", 260: "<|im_assistant|>"}
TOKENIZER_VOCAB = 261
MODEL_VOCAB = 300  # > TOKENIZER_VOCAB: ids the tokenizer cannot decode exist, as in the real model
LETTERS = list(range(ord("a"), ord("z") + 1)) + [ord(" ")]


class ByteTokenizer:
    """Bytes are ids 0..255; ids 256.. are named specials."""

    n_vocab = TOKENIZER_VOCAB
    eos_id = EOS
    im_end_id = IM_END

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def is_special(self, token_id: int) -> bool:
        return token_id >= 256

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} outside 0..{self.n_vocab - 1}")
        return SPECIAL_NAMES[token_id].encode() if token_id >= 256 else bytes([token_id])

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        raw = b"".join(self.token_bytes(i) for i in ids if not (skip_special and self.is_special(i)))
        return raw.decode("utf-8", errors="replace")


def toy_logits(history: Sequence[int], eos_bias: float) -> torch.Tensor:
    """A [V] logit row that depends on the whole history and nothing else (batch-invariant by construction)."""
    g = torch.Generator().manual_seed(zlib.crc32(bytes(str(list(history)), "ascii")))
    row = torch.randn(MODEL_VOCAB, generator=g)
    row[LETTERS] += 3.0  # mostly readable text, so stop strings can match
    row[EOS] += eos_bias
    return row


@dataclass
class _Slot:
    pages: int
    reserved: int
    history: list[int] = field(default_factory=list)
    prompt_len: int = 0
    next_token: int | None = None  # what decode_next feeds (set_next_tokens)


class FakeRunner:
    """ModelRunner protocol over toy_logits, with pages of `page_size` tokens and `max_slots` slots."""

    device = torch.device("cpu")
    prefix = None  # no prefix cache: every prompt is prefilled from its first token

    def __init__(self, *, max_context: int = 512, num_pages: int = 96, page_size: int = 16, max_slots: int = 8,
                 eos_bias: float = 0.0) -> None:
        self.max_context, self.num_pages, self.page_size, self.max_slots = max_context, num_pages, page_size, max_slots
        self.eos_bias = eos_bias
        self.free_pages = num_pages
        self.slots: dict[int, _Slot] = {}
        self.max_batch_seen = 0
        self.prefill_calls: list[int] = []
        self.fail_next: BaseException | None = None

    def logits_for(self, slot: _Slot) -> torch.Tensor:
        return toy_logits(slot.history, self.eos_bias)

    def _pages(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_context and self._pages(num_tokens) <= self.num_pages

    @property
    def num_free_slots(self) -> int:
        return self.max_slots - len(self.slots)

    def can_admit(self, num_tokens: int) -> bool:
        return (self.can_ever_fit(num_tokens) and self._pages(num_tokens) <= self.free_pages
                and len(self.slots) < self.max_slots)

    def admit(self, seq_id: int, num_tokens: int) -> None:
        if seq_id in self.slots or not self.can_admit(num_tokens):
            raise RuntimeError(f"cannot admit seq {seq_id} ({num_tokens} tokens)")
        self.slots[seq_id] = _Slot(self._pages(num_tokens), num_tokens)
        self.free_pages -= self._pages(num_tokens)

    def _maybe_fail(self) -> None:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc

    def prefill(self, seqs: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Prompt tokens (a whole prompt or its next chunk) of admitted sequences that have not decoded yet."""
        self._maybe_fail()
        rows = []
        for seq_id, tokens in seqs:
            slot = self.slots[seq_id]
            if not tokens or len(slot.history) + len(tokens) > slot.reserved or slot.next_token is not None:
                raise RuntimeError(f"bad prefill of seq {seq_id}: {len(tokens)} tokens, slot {slot}")
            slot.history += list(tokens)
            slot.prompt_len = len(slot.history)
            rows.append(self.logits_for(slot))
        self.prefill_calls.append(len(seqs))
        self.max_batch_seen = max(self.max_batch_seen, len(seqs))
        return torch.stack(rows)

    def decode(self, seqs: list[tuple[int, int]]) -> torch.Tensor:
        self._maybe_fail()
        rows = []
        for seq_id, token in seqs:
            slot = self.slots[seq_id]
            if not slot.history or len(slot.history) >= slot.reserved:
                raise RuntimeError(f"decode of seq {seq_id} past its reservation of {slot.reserved} tokens")
            slot.history.append(token)
            rows.append(self.logits_for(slot))
        self.max_batch_seen = max(self.max_batch_seen, len(seqs))
        return torch.stack(rows)

    def decode_next(self, seq_ids: list[int], graphs: object = None) -> torch.Tensor:
        missing = [sid for sid in seq_ids if self.slots[sid].next_token is None]
        if missing:
            raise RuntimeError(f"decode_next of seq(s) {missing} before any set_next_tokens")
        return self.decode([(sid, int(self.slots[sid].next_token or 0)) for sid in seq_ids])

    def set_next_tokens(self, seq_ids: list[int], tokens: torch.Tensor) -> None:
        for sid, tok in zip(seq_ids, tokens.tolist(), strict=True):
            self.slots[sid].next_token = int(tok)

    def release(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id)
        self.free_pages += slot.pages

    def reset_caches(self) -> None:
        self.slots.clear()
        self.free_pages = self.num_pages

    def check_integrity(self) -> None:
        used = sum(s.pages for s in self.slots.values())
        if used + self.free_pages != self.num_pages or len(self.slots) > self.max_slots:
            raise RuntimeError(f"page accounting broken: {used} used + {self.free_pages} free != {self.num_pages}")
