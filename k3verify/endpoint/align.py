"""Logprob entries a server left out, put back in their places by token id.

llama.cpp's server holds back a generated token while the text so far ends inside a multi-byte UTF-8 character:
that token gets no logprobs entry of its own, and the next entry that completes the character carries the held
bytes in front of its own (its `id` is still its own token). So `logprobs.content` can have fewer entries than
`usage.completion_tokens`, and position i of the list is not position i of the answer. Aligning by index or by
text would then compare the wrong positions; instead the full id list (llama.cpp's native `/completion` with
`return_tokens`) is replayed through the server's rule, which says exactly which positions have an entry, and the
entries are accepted only if their ids are exactly those positions' ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from k3verify.endpoint.wire import Step

UTF8_LEADS = ((0xE0, 0xC0, 2), (0xF0, 0xE0, 3), (0xF8, 0xF0, 4))  # (mask, value, sequence length)


def ends_inside_character(text: bytes) -> bool:
    """True when one of the last four bytes starts a UTF-8 sequence longer than the bytes after it: the server's
    test for a character cut off at the end of the text (it looks at lead bytes only)."""
    for back in range(1, min(4, len(text)) + 1):
        byte = text[-back]
        for mask, value, length in UTF8_LEADS:
            if byte & mask == value and back < length:
                return True
    return False


def positions_with_entries(ids: Sequence[int], piece: Callable[[int], bytes]) -> list[int]:
    """The positions of `ids` that get a logprobs entry: those after which the generated text (each token's
    `piece`, special tokens empty) does not end inside a character."""
    text, out = b"", []
    for position, token_id in enumerate(ids):
        text += piece(token_id)
        if not ends_inside_character(text):
            out.append(position)
    return out


def align_entries(steps: Sequence[Step], ids: Sequence[int], piece: Callable[[int], bytes]) -> list[Step] | None:
    """`steps` (the entries the server sent) spread over every position of `ids`; a position without an entry
    keeps its id and no logprobs. None when the entries' ids are not exactly the ids at the positions the rule
    gives (something else went missing: the answer cannot be aligned)."""
    places = positions_with_entries(ids, piece)
    if len(places) != len(steps) or any(step.token_id != ids[p] for step, p in zip(steps, places, strict=True)):
        return None
    out = [Step(token_id, None) for token_id in ids]
    for step, position in zip(steps, places, strict=True):
        out[position] = step
    return out
