"""Incremental detokenization for streaming: emit text only once its UTF-8 bytes are complete."""

from __future__ import annotations

import codecs
from typing import Protocol


class TokenBytes(Protocol):
    """What the decoder reads: KimiTokenizer, or the engine's TokenText (which also covers vocab padding ids)."""

    def is_special(self, token_id: int) -> bool: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class IncrementalDecoder:
    """Feed token ids one at a time; the concatenated outputs equal `tokenizer.decode(all_ids)`.

    A token may end inside a multi-byte character (byte-level BPE), so its bytes are held back until
    the character completes; `finish()` flushes a truncated tail as U+FFFD, like `decode` does.
    """

    def __init__(self, tokenizer: TokenBytes, *, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by `token_id` ("" while a character is still partial)."""
        if self.skip_special and self.tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def finish(self) -> str:
        """Flush held-back bytes at end of stream (a partial character becomes U+FFFD) and reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def has_pending(self) -> bool:
        """True while some bytes wait for the rest of their character."""
        return bool(self._utf8.getstate()[0])
