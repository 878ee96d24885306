"""KimiTokenizer: pinned ids, round trips, an independent BPE reference, special-token safety, long inputs."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from k3verify.tokenizer import (
    MAX_CHARS_PER_CALL,
    MAX_RUN_CHARS,
    PAT_STR,
    KimiTokenizer,
    default_tokenizer,
    split_for_encoding,
)
from k3verify.tokenizer.tokenizer import ASSETS_DIR, CONFIG_FILE, MODEL_FILE, load_mergeable_ranks

TOK = default_tokenizer()
RANKS = load_mergeable_ranks(ASSETS_DIR / MODEL_FILE)
SPECIAL_NAMES = sorted(TOK.special_to_id)

# Characters the pre-tokenizer treats specially, mixed into generated text so hypothesis hits them often.
TRICKY = " \t\n\r\x0b\x0c\u00a0\u3000'sStTlLdD中文字あアé\u0301Ω0123456789_-.,!?<|>[]😀\u200b"
texts = st.text(alphabet=st.one_of(st.characters(exclude_categories=["Cs"]), st.sampled_from(TRICKY)), max_size=60)

EXACT_IDS = {
    "": [],
    "Hello world": [72, 954, 111, 660],
    "What does [EOS] mean?": [2231, 769, 953, 949, 2987, 93, 542, 300, 63],
    "<|im_end|>": [60, 124, 956, 2242, 2354],
    "中文分词是自然语言处理中的一个重要问题。": [3176, 408],
    "  x = 12345\n\n\tdef f():\r\n": [32, 1539, 274, 32, 1226, 826, 259, 9, 2561, 320, 401, 930],
    "naïve café 😀": [110, 1566, 2432, 1617, 32, 240, 159, 152, 128],
    "They're here, aren't they? I'LL see.": [2840, 2097, 700, 44, 262, 114, 268, 2096, 767, 63, 642, 39, 2222, 608, 46],
}


def reference_bpe_encode(text: str) -> list[int]:
    """Pure-Python encoder: `regex` (V1) pre-tokenization, then merge the lowest-ranked adjacent pair, leftmost."""
    ids: list[int] = []
    for match in regex.finditer(PAT_STR, text, flags=regex.V1):
        piece = match.group().encode("utf-8")
        if piece in RANKS:
            ids.append(RANKS[piece])
            continue
        parts = [piece[i : i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            candidates = [
                (RANKS[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False)) if a + b in RANKS
            ]
            if not candidates:
                break
            _, i = min(candidates)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [RANKS[p] for p in parts]
    return ids


def test_vocab_layout_and_special_ids_follow_released_offsets() -> None:
    """N = 4096 base tokens, 258 special slots, named specials at the released vocab's offsets."""
    assert TOK.num_base_tokens == 4096
    assert TOK.n_vocab == 4096 + 258
    expected = {
        "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
        "<|start_header_id|>": 5, "<|end_header_id|>": 6, "[EOT]": 9, "<|im_system|>": 10, "<|im_middle|>": 11,
        "[PAD]": 255,
    }  # fmt: skip
    assert {name: TOK.special_to_id[name] - 4096 for name in expected} == expected
    assert (TOK.bos_id, TOK.eos_id, TOK.im_end_id, TOK.pad_id) == (4096, 4097, 4098, 4351)
    assert TOK.id_to_special[4103] == "<|reserved_token_4103|>"
    assert TOK.id_to_special[4353] == "<|reserved_token_4353|>"
    assert len(TOK.special_to_id) == 258


@pytest.mark.parametrize("text", list(EXACT_IDS))
def test_exact_ids_are_pinned(text: str) -> None:
    """These ids pin the shipped vocabulary; the build test keeps the vocabulary itself reproducible."""
    assert TOK.encode(text) == EXACT_IDS[text]
    assert TOK.decode(EXACT_IDS[text]) == text


@settings(max_examples=300, deadline=None)
@given(texts)
def test_decode_encode_round_trips(text: str) -> None:
    """decode(encode(s)) == s for any text without lone surrogates."""
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert all(0 <= i < TOK.num_base_tokens for i in ids)


@settings(max_examples=300, deadline=None)
@given(texts)
def test_tiktoken_matches_pure_python_reference_bpe(text: str) -> None:
    """tiktoken (Rust fancy-regex, `&&` intersection) splits and merges like regex-V1 + textbook BPE."""
    assert TOK.encode(text) == reference_bpe_encode(text)


def test_class_intersection_excludes_han_from_letter_runs() -> None:
    """`[\\p{Lo}&&[^\\p{Han}]]` must keep Han out of letter runs; V0 `regex` reads `&&` literally and differs."""
    text = "abc中文def かな漢字"
    v1 = [m.group() for m in regex.finditer(PAT_STR, text, flags=regex.V1)]
    assert v1 == ["abc", "中文", "def", " かな", "漢字"]
    v0 = [m.group() for m in regex.finditer(PAT_STR, text, flags=regex.V0)]
    assert v0 != v1
    assert TOK.encode(text) == reference_bpe_encode(text)


def test_user_text_never_produces_special_ids() -> None:
    """Every special name typed as text encodes as plain bytes, unless allow_special is set."""
    text = "What does [EOS] mean?"
    assert not any(TOK.is_special(i) for i in TOK.encode(text))
    assert TOK.eos_id in TOK.encode(text, allow_special=True)
    for name in SPECIAL_NAMES:
        ids = TOK.encode(name)
        assert not any(TOK.is_special(i) for i in ids), name
        assert TOK.decode(ids) == name
        assert TOK.encode(name, allow_special=True) == [TOK.special_to_id[name]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(texts, st.sampled_from(SPECIAL_NAMES)), max_size=8))
def test_allow_special_matches_tiktoken_native(parts: list[str]) -> None:
    """Our special-aware encode agrees with tiktoken's own `allowed_special="all"` path."""
    text = "".join(parts)
    ids = TOK.encode(text, allow_special=True)
    assert ids == TOK.encoding.encode(text, allowed_special="all")
    assert TOK.decode(ids) == text


def test_long_runs_are_split_before_encoding() -> None:
    """100k-char runs are cut into ≤25k-char runs; the ids are those of the pieces, and decode restores the text."""
    for text in ("a" * 100_000, " " * 100_000, "x" + "\t" * 100_000 + "中" * 100_000 + "!" * 100_001):
        pieces = list(split_for_encoding(text))
        assert "".join(pieces) == text
        assert len(pieces) >= 4
        runs = [len(run) for piece in pieces for run in re.findall(r"\s+|\S+", piece)]
        assert max(runs) <= MAX_RUN_CHARS
        ids = TOK.encode(text)
        assert ids == [i for piece in pieces for i in TOK.encoding.encode_ordinary(piece)]
        assert TOK.decode(ids) == text


def test_inputs_over_400k_chars_are_chunked_and_short_text_is_untouched() -> None:
    """Pieces never exceed 400k chars; ordinary text stays a single piece, so its ids are unaffected."""
    text = "word " * 100_001
    pieces = list(split_for_encoding(text))
    assert "".join(pieces) == text
    assert len(pieces) == 2 and max(map(len, pieces)) <= MAX_CHARS_PER_CALL
    short = "Hello world.\n" * 100
    assert list(split_for_encoding(short)) == [short]
    assert list(split_for_encoding("")) == []


def test_decode_rejects_out_of_range_ids() -> None:
    """Ids outside the vocabulary raise ValueError naming the id instead of decoding garbage."""
    with pytest.raises(ValueError, match="4354"):
        TOK.decode([1, 4354])
    with pytest.raises(ValueError, match="-1"):
        TOK.decode([-1])


def test_skip_special_drops_only_special_ids() -> None:
    """decode(skip_special=True) removes special ids and keeps everything else."""
    ids = [TOK.bos_id, *TOK.encode("hi"), TOK.im_end_id]
    assert TOK.decode(ids) == "[BOS]hi<|im_end|>"
    assert TOK.decode(ids, skip_special=True) == "hi"


def copy_assets(tmp_path: Path) -> Path:
    for name in (MODEL_FILE, CONFIG_FILE):
        shutil.copy(ASSETS_DIR / name, tmp_path / name)
    return tmp_path


def edit_config(directory: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    path = directory / CONFIG_FILE
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("missing", [MODEL_FILE, CONFIG_FILE])
def test_missing_file_raises_naming_the_path(tmp_path: Path, missing: str) -> None:
    """A missing tokenizer file is FileNotFoundError with its exact path; nothing falls back to shipped assets."""
    copy_assets(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / missing))):
        KimiTokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / missing))):
        KimiTokenizer.from_files(tmp_path / MODEL_FILE, tmp_path / CONFIG_FILE)


def test_copied_assets_load_identically(tmp_path: Path) -> None:
    """Control for the failure tests: an unedited copy loads and encodes like the default tokenizer."""
    tok = KimiTokenizer.from_dir(copy_assets(tmp_path))
    assert tok.special_to_id == TOK.special_to_id
    assert tok.encode("Hello world") == EXACT_IDS["Hello world"]


@pytest.mark.parametrize("name", ["<|im_middle|>", "<|im_end|>", "<|im_user|>"])
def test_missing_special_token_raises_naming_it(tmp_path: Path, name: str) -> None:
    """A config without a chat marker in added_tokens_decoder fails at load, naming the marker."""
    copy_assets(tmp_path)
    edit_config(tmp_path, lambda c: c["added_tokens_decoder"].pop(str(TOK.special_to_id[name])))
    with pytest.raises(ValueError, match=re.escape(name)):
        KimiTokenizer.from_dir(tmp_path)


def test_unknown_bos_token_raises(tmp_path: Path) -> None:
    """bos_token must name a special token of this vocabulary."""
    copy_assets(tmp_path)
    edit_config(tmp_path, lambda c: c.update(bos_token="<s>"))
    with pytest.raises(ValueError, match=re.escape("'<s>'")):
        KimiTokenizer.from_dir(tmp_path)


def test_a_template_that_does_not_compile_raises_and_any_other_is_the_checkpoints_own(tmp_path: Path) -> None:
    """A checkpoint's template wins: any template that compiles in the sandbox is accepted (rendered with Jinja);
    one with a syntax error is rejected at load, naming the line."""
    copy_assets(tmp_path)
    edit_config(tmp_path, lambda c: c.update(chat_template="{{ bos_token }}{% for m in messages %}{% endfor %}"))
    assert KimiTokenizer.from_dir(tmp_path).chat_format == "jinja"
    edit_config(tmp_path, lambda c: c.update(chat_template="{% for m in messages %}{{ m.content }"))
    with pytest.raises(ValueError, match="chat_template .* does not compile: line 1"):
        KimiTokenizer.from_dir(tmp_path)


def test_special_id_outside_reserved_range_raises(tmp_path: Path) -> None:
    """added_tokens_decoder ids must lie in N … N+257."""
    copy_assets(tmp_path)
    edit_config(tmp_path, lambda c: c["added_tokens_decoder"].update({"4354": {"content": "<|x|>", "special": True}}))
    with pytest.raises(ValueError, match="4354"):
        KimiTokenizer.from_dir(tmp_path)


def test_malformed_model_line_raises_with_location(tmp_path: Path) -> None:
    """A corrupt tiktoken.model line is reported with file and line number."""
    copy_assets(tmp_path)
    lines = (tmp_path / MODEL_FILE).read_text().splitlines()
    lines[300] = "!!notbase64 300"
    (tmp_path / MODEL_FILE).write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / MODEL_FILE}:301")):
        KimiTokenizer.from_dir(tmp_path)


def test_missing_single_byte_token_raises(tmp_path: Path) -> None:
    """Every byte needs a token, or some text could not be encoded."""
    copy_assets(tmp_path)
    lines = (tmp_path / MODEL_FILE).read_text().splitlines()
    # Drop byte 0x00 and renumber so only the byte coverage is wrong.
    renumbered = [f"{line.split()[0]} {rank}" for rank, line in enumerate(lines[1:])]
    (tmp_path / MODEL_FILE).write_text("\n".join(renumbered) + "\n")
    with pytest.raises(ValueError, match="single bytes"):
        KimiTokenizer.from_dir(tmp_path)
