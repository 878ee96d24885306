"""A checkpoint's tiktoken vocabulary as GGUF tokens and merges: the byte map is GPT-2's, and BPE with the derived
merges rebuilds every token and encodes text exactly as tiktoken does."""

from __future__ import annotations

import pytest
import regex

from k3verify.peers.gguf_vocab import TokenType, byte_chars, gguf_vocab, merge_parts, token_text
from k3verify.tokenizer import PAT_STR, KimiTokenizer, default_tokenizer

TEXT = ("Kimi Delta Attention keeps a fixed-size state; the tokenizer's merges must rebuild every word exactly. "
        "Numbers 12345, punctuation!? and ümlauts, 漢字 too.")


def bpe(merges: list[str], raw: bytes) -> list[str]:
    """Plain BPE over GGUF strings: merge the lowest-ranked adjacent pair (rank = position in `merges`) until none."""
    rank = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    parts = [token_text(bytes([b])) for b in raw]
    while len(parts) > 1:
        pairs = [(rank.get((a, b), len(rank)), i) for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))]
        best, at = min(pairs)
        if best == len(rank):
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


def test_byte_map_is_a_bijection_onto_printable_characters() -> None:
    """256 distinct characters, none whitespace or control; printable ASCII stands for itself."""
    chars = byte_chars()
    assert len(set(chars)) == 256 and all(c.isprintable() and not c.isspace() for c in chars)
    assert all(chars[b] == chr(b) for b in range(ord("!"), ord("~") + 1))


@pytest.fixture(scope="module")
def tokenizer() -> KimiTokenizer:
    return default_tokenizer()


def test_merges_rebuild_every_token_and_encode_text_as_tiktoken(tokenizer: KimiTokenizer) -> None:
    """Every multi-byte token is one merge of two lower-ranked tokens; BPE with the merges list reproduces
    tiktoken's ids on pre-tokenized words; specials are CONTROL, ids past the tokenizer UNUSED padding."""
    vocab = gguf_vocab(tokenizer, tokenizer.n_vocab + 3)
    assert len(vocab.tokens) == tokenizer.n_vocab + 3
    multi = [t for t in range(tokenizer.num_base_tokens) if len(tokenizer.token_bytes(t)) > 1]
    assert len(vocab.merges) == len(multi)
    index = {text: i for i, text in enumerate(vocab.tokens[: tokenizer.num_base_tokens])}
    for word in regex.findall(PAT_STR, TEXT, flags=regex.V1):  # the pre-tokenizer's pieces (V1: `&&` classes)
        want = tokenizer.encode(word)
        assert [index[p] for p in bpe(vocab.merges, word.encode())] == want, word
    assert vocab.types[tokenizer.eos_id] == TokenType.CONTROL and vocab.tokens[tokenizer.eos_id] == "[EOS]"
    assert vocab.types[-1] == TokenType.UNUSED and vocab.tokens[-1] == f"[PAD{tokenizer.n_vocab + 2}]"


def test_a_token_that_is_no_merge_of_lower_ranks_is_refused() -> None:
    """A vocabulary whose token cannot be formed by BPE from lower ranks has no merge list: say which token."""
    ranks = {bytes([b]): b for b in range(256)} | {b"abc": 256}
    with pytest.raises(ValueError, match=r"token b'abc' \(rank 256\) is not the merge of two lower-ranked tokens"):
        merge_parts(ranks, b"abc")
