"""A checkpoint's tiktoken vocabulary in the form a GGUF file carries it (llama.cpp's `gpt2` BPE model with the
`kimi-k2` pre-tokenizer): token strings, token types and merges.

GGUF stores byte-level BPE tokens as text through GPT-2's reversible byte -> printable-character map, and the
merges as "left right" pairs of such strings. A tiktoken file has no merge list, only ranks: the pair that forms a
token is found by running BPE on its bytes with every rank below its own, which leaves exactly two parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from functools import cache

from k3verify.tokenizer import KimiTokenizer

PRE_TOKENIZER = "kimi-k2"
TOKENIZER_MODEL = "gpt2"


class TokenType(IntEnum):
    """GGUF's `tokenizer.ggml.token_type` codes (llama.cpp's llama_token_type)."""

    NORMAL = 1
    CONTROL = 3
    UNUSED = 5


@cache
def byte_chars() -> tuple[str, ...]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, every other byte for the
    next unused code point from 256 on, so each token's bytes become a string without whitespace or controls."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = chr(extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


def token_text(raw: bytes) -> str:
    table = byte_chars()
    return "".join(table[b] for b in raw)


def merge_parts(ranks: Mapping[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two tokens whose merge forms `token`: BPE over its bytes, merging the lowest-ranked adjacent pair
    first, with only ranks below the token's own allowed."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best:
                best, at = rank, i
        if at < 0:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {limit}) is not the merge of two lower-ranked tokens: BPE over its "
                         f"bytes stops at {len(parts)} parts")
    return parts[0], parts[1]


@dataclass(frozen=True)
class GgufVocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]


def gguf_vocab(tokenizer: KimiTokenizer, vocab_size: int) -> GgufVocab:
    """Every id below `vocab_size` (the model's, which may exceed the tokenizer's) as a GGUF token: ordinary
    tokens NORMAL, the special slots (named or reserved) CONTROL, ids past the tokenizer UNUSED padding."""
    if vocab_size < tokenizer.num_base_tokens:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.num_base_tokens} "
                         "ordinary tokens")
    ranks = tokenizer.mergeable_ranks
    tokens: list[str] = []
    types: list[int] = []
    merges: list[str] = []
    for token_id in range(vocab_size):
        if token_id < tokenizer.num_base_tokens:
            raw = tokenizer.token_bytes(token_id)
            tokens.append(token_text(raw))
            types.append(TokenType.NORMAL)
            if len(raw) > 1:
                left, right = merge_parts(ranks, raw)
                merges.append(f"{token_text(left)} {token_text(right)}")
        elif token_id < tokenizer.n_vocab:
            tokens.append(tokenizer.id_to_special[token_id])
            types.append(TokenType.CONTROL)
        else:
            tokens.append(f"[PAD{token_id}]")
            types.append(TokenType.UNUSED)
    return GgufVocab(tokens, types, merges)
