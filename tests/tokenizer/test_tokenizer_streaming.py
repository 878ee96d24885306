"""IncrementalDecoder: streamed text equals the full decode, and partial characters are held back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from k3verify.tokenizer import IncrementalDecoder, default_tokenizer

TOK = default_tokenizer()
MULTIBYTE = "naïve café — 中文字 😀👩‍👩‍👧 Ωμέγα ok"
BYTE_ID = {TOK.token_bytes(i): i for i in range(TOK.num_base_tokens) if len(TOK.token_bytes(i)) == 1}


def stream(ids: list[int], *, skip_special: bool = False) -> list[str]:
    decoder = IncrementalDecoder(TOK, skip_special=skip_special)
    return [decoder.push(i) for i in ids] + [decoder.finish()]


def test_single_byte_tokens_emit_only_complete_characters() -> None:
    """Fed one byte per token, the text after every byte is exactly the complete-character prefix."""
    data = MULTIBYTE.encode("utf-8")
    decoder = IncrementalDecoder(TOK)
    emitted = ""
    for k in range(1, len(data) + 1):
        emitted += decoder.push(BYTE_ID[data[k - 1 : k]])
        assert emitted == data[:k].decode("utf-8", errors="ignore")
        assert decoder.has_pending == (k < len(data) and data[k] & 0xC0 == 0x80)
    assert emitted == MULTIBYTE
    assert decoder.finish() == ""


def test_stream_cut_at_every_token_position_reproduces_decode() -> None:
    """For each cut k, the text after k tokens is the complete prefix, and the rest completes the full decode."""
    ids = TOK.encode(MULTIBYTE)
    assert any(not TOK.token_bytes(i).decode("utf-8", errors="ignore") for i in ids)  # some token is a partial char
    for k in range(len(ids) + 1):
        decoder = IncrementalDecoder(TOK)
        head = "".join(decoder.push(i) for i in ids[:k])
        assert head == TOK.decode_bytes(ids[:k]).decode("utf-8", errors="ignore")
        assert head + "".join(decoder.push(i) for i in ids[k:]) + decoder.finish() == MULTIBYTE


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, TOK.n_vocab - 1), max_size=40))
def test_stream_of_arbitrary_ids_equals_decode(ids: list[int]) -> None:
    """Any id sequence, invalid UTF-8 and specials included, streams to exactly `decode(ids)`."""
    assert "".join(stream(ids)) == TOK.decode(ids)
    assert "".join(stream(ids, skip_special=True)) == TOK.decode(ids, skip_special=True)


def test_truncated_character_is_flushed_as_replacement() -> None:
    """A stream ending mid-character yields U+FFFD at finish, like decode does."""
    partial = "😀".encode()[:2]
    ids = [BYTE_ID[partial[:1]], BYTE_ID[partial[1:]]]
    decoder = IncrementalDecoder(TOK)
    assert [decoder.push(i) for i in ids] == ["", ""]
    assert decoder.has_pending
    assert decoder.finish() == "\ufffd" == TOK.decode(ids)
    assert not decoder.has_pending
