"""Logprob entries llama-server leaves out (a token that ends inside a UTF-8 character) are put back by id, and an
answer whose entries do not fit the server's rule is refused rather than aligned by index."""

from __future__ import annotations

from k3verify.endpoint.align import align_entries, ends_inside_character, positions_with_entries
from k3verify.endpoint.wire import Step

PIECES = {1: b"a", 2: "é".encode()[:1], 3: "é".encode()[1:], 4: "€".encode()[:1], 5: b"", 6: b" b", 7: b"\x9f"}


def piece(token_id: int) -> bytes:
    return PIECES[token_id]


def test_cut_off_rule_looks_at_lead_bytes_only() -> None:
    """A lead byte short of its sequence length cuts the text off; a stray continuation byte does not."""
    assert ends_inside_character(b"a\xc3") and ends_inside_character(b"\xe2\x82") and ends_inside_character(b"\xf0x")
    assert not ends_inside_character("aé€".encode()) and not ends_inside_character(b"\x9f")
    assert not ends_inside_character(b"")


def test_held_back_tokens_get_no_entry_and_the_rest_align_by_id() -> None:
    """é split over tokens 2, 3: token 2 has no entry; a special token (empty piece) inside a cut-off character
    has none either; the text ending cut off leaves the tail without entries."""
    ids = [1, 2, 3, 6, 4, 5, 6, 7, 2]
    assert positions_with_entries(ids, piece) == [0, 2, 3, 6, 7]
    steps = [Step(t, -1.0, {t: -1.0}) for t in (1, 3, 6, 6, 7)]
    aligned = align_entries(steps, ids, piece)
    assert aligned is not None and [s.token_id for s in aligned] == ids
    assert [s.logprob is not None for s in aligned] == [True, False, True, True, False, False, True, True, False]


def test_entries_that_do_not_fit_the_rule_are_not_aligned() -> None:
    """One entry too many, too few, or an id at the wrong place: None, never an alignment by index."""
    ids = [1, 2, 3, 6]
    assert align_entries([Step(t, -1.0) for t in (1, 3, 6)], ids, piece) is not None
    assert align_entries([Step(t, -1.0) for t in (1, 2, 3, 6)], ids, piece) is None
    assert align_entries([Step(t, -1.0) for t in (1, 6)], ids, piece) is None
    assert align_entries([Step(t, -1.0) for t in (1, 6, 3)], ids, piece) is None
