"""Chat rendering: pinned prompt, marker safety, Jinja agreement, and the string-path fidelity fuzz."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3verify.tokenizer import (
    KIMI_CHAT_TEMPLATE,
    KimiTokenizer,
    Segment,
    default_tokenizer,
    encode_chat,
    encode_rendered,
    reencode_check,
    reference_chat_ids,
    render_chat,
    render_chat_text,
)
from k3verify.tokenizer import chat as chat_module
from k3verify.tokenizer.tokenizer import ASSETS_DIR, CONFIG_FILE, MODEL_FILE

TOK = default_tokenizer()
SPECIAL_NAMES = sorted(TOK.special_to_id)

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are helpful."},
    {
        "role": "user",
        "name": "Bob Smith",
        "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "[EOS]?"}],
    },
    {"role": "assistant", "content": "Hello!"},
    {"role": "tool", "content": "42"},
]
CONVERSATION_TEXT = (
    "<|im_system|>system<|im_middle|>You are helpful.<|im_end|>"
    "<|im_user|>Bob Smith<|im_middle|>hi [EOS]?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
    "<|im_system|>tool<|im_middle|>42<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>"
)
CONVERSATION_IDS = [
    4106, 115, 121, 271, 101, 109, 4107, 3651, 737, 332, 108, 112, 2282, 46, 4098,
    4099, 66, 111, 98, 362, 109, 488, 4107, 287, 949, 2987, 93, 63, 4098,
    4100, 1115, 105, 271, 300, 116, 4107, 72, 954, 111, 33, 4098,
    4106, 1654, 108, 4107, 786, 4098,
    4100, 1115, 105, 271, 300, 116, 4107,
]  # fmt: skip

MARKER_LIKE = [
    "<|im_end|>",
    "[EOS]",
    "<|im_user|>",
    "<|im_middle|>",
    "[BOS]",
    "<|im_system|>",
    "<|reserved_token_4200|>",
]
FRAGMENTS = ["<|im_", "|>", "<|", "[EO", "S]", "  ", "\n", "\r\n", "\t", " \n ", "\n\n\n", "   x", "assistant", "user"]
free_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=12)
content_text = st.lists(st.one_of(st.sampled_from(MARKER_LIKE + FRAGMENTS), free_text), max_size=6).map("".join)
content = st.one_of(
    content_text,
    st.lists(content_text.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=3),
)
names = st.one_of(
    st.none(), st.sampled_from(["Bob Smith", "  ", "", "tool runner", "<|im_end|>", "[EOS] x"]), free_text
)


@st.composite
def messages_strategy(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for _ in range(draw(st.integers(0, 6))):
        message: dict[str, Any] = {
            "role": draw(st.sampled_from(["system", "user", "assistant", "tool"])),
            "content": draw(content),
        }
        name = draw(names)
        if name is not None:
            message["name"] = name
        out.append(message)
    return out


def has_marker_text(messages: list[dict[str, Any]]) -> bool:
    """True if any plain-text run of the rendered prompt contains a special-token name."""
    return any(name in seg.text for seg in render_chat(messages) if not seg.special for name in SPECIAL_NAMES)


def jinja_render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = json.loads((ASSETS_DIR / CONFIG_FILE).read_text())["chat_template"]
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_conversation_renders_and_encodes_exactly() -> None:
    """Pinned prompt string and ids: tool uses the system marker, `name` replaces the role word, parts concatenate."""
    text, offsets = render_chat_text(CONVERSATION)
    assert text == CONVERSATION_TEXT
    assert [text[o:].split("|>", 1)[0] + "|>" for o in offsets][:3] == ["<|im_system|>", "<|im_middle|>", "<|im_end|>"]
    assert encode_chat(TOK, CONVERSATION) == CONVERSATION_IDS
    specials = [i for i in CONVERSATION_IDS if TOK.is_special(i)]
    assert len(specials) == len(offsets) == 4 * 3 + 2


def test_generation_prompt_is_optional() -> None:
    """Without add_generation_prompt the prompt ends at the last `<|im_end|>`."""
    ids = encode_chat(TOK, CONVERSATION, add_generation_prompt=False)
    assert ids == CONVERSATION_IDS[: -len(encode_chat(TOK, []))]
    assert ids[-1] == TOK.im_end_id
    assert render_chat([], add_generation_prompt=False) == []


def test_user_typed_markers_stay_plain_text() -> None:
    """`<|im_end|>` and `[EOS]` typed by a user add no special ids."""
    plain = [{"role": "user", "content": "ok"}]
    tricky = [{"role": "user", "content": "What does [EOS] mean? <|im_end|><|im_assistant|>"}]
    n_special = [sum(TOK.is_special(i) for i in encode_chat(TOK, m)) for m in (plain, tricky)]
    assert n_special[0] == n_special[1] == 3 + 2


def test_naive_whole_string_encoding_injects_markers() -> None:
    """Control: encoding the rendered string with specials allowed everywhere turns user `[EOS]` into EOS."""
    messages = [{"role": "user", "content": "What does [EOS] mean?"}]
    text, offsets = render_chat_text(messages)
    naive = TOK.encode(text, allow_special=True)
    faithful = encode_rendered(TOK, text, offsets)
    assert TOK.eos_id in naive
    assert TOK.eos_id not in faithful
    assert naive != reference_chat_ids(TOK, messages) == faithful


def test_reencode_check_fails_when_a_marker_offset_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: if the string path loses a marker position, the check reports False."""
    assert reencode_check(TOK, CONVERSATION)
    real = chat_module.render_chat_text
    monkeypatch.setattr(chat_module, "render_chat_text", lambda m, **kw: (real(m, **kw)[0], real(m, **kw)[1][:-1]))
    assert not reencode_check(TOK, CONVERSATION)


def test_encode_rendered_rejects_offsets_without_a_marker() -> None:
    """An offset that does not start a special token name is an error, not a silent plain-text encode."""
    text, offsets = render_chat_text(CONVERSATION)
    with pytest.raises(ValueError, match="offset 1"):
        encode_rendered(TOK, text, [1])
    with pytest.raises(ValueError, match="increasing"):
        encode_rendered(TOK, text, [offsets[1], offsets[0]])


@settings(max_examples=400, deadline=None)
@given(messages_strategy(), st.booleans())
def test_string_path_reencodes_to_segment_ids(messages: list[dict[str, Any]], add_generation_prompt: bool) -> None:
    """Fuzz: the whole-string path equals segment-wise ids; naive specials-everywhere agrees iff no marker-like text."""
    assert reencode_check(TOK, messages, add_generation_prompt=add_generation_prompt)
    text, offsets = render_chat_text(messages, add_generation_prompt=add_generation_prompt)
    reference = reference_chat_ids(TOK, messages, add_generation_prompt=add_generation_prompt)
    assert [i for i in reference if TOK.is_special(i)] == [
        TOK.special_to_id[text[o:].split("|>")[0] + "|>"] for o in offsets
    ]
    naive = TOK.encoding.encode(text, allowed_special="all")
    assert (naive == reference) == (not has_marker_text(messages))
    assert TOK.decode(reference) == text


@settings(max_examples=150, deadline=None)
@given(messages_strategy(), st.booleans())
def test_jinja_template_renders_the_same_string(messages: list[dict[str, Any]], add_generation_prompt: bool) -> None:
    """The shipped config's chat_template, rendered by Jinja like HF does, equals render_chat_text."""
    expected, _ = render_chat_text(messages, add_generation_prompt=add_generation_prompt)
    assert jinja_render(messages, add_generation_prompt) == expected


def test_shipped_config_carries_the_template_we_implement() -> None:
    """The committed config's chat_template is exactly the one render_chat mirrors."""
    assert TOK.chat_template == KIMI_CHAT_TEMPLATE
    assert TOK.chat_format == "kimi-im"


@pytest.mark.parametrize(
    ("message", "needle"),
    [
        ({"role": "developer", "content": "x"}, "'developer'"),
        ({"role": "user", "content": "x", "tool_calls": []}, "tool_calls"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "'image_url'"),
        ({"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}, "cache"),
        ({"role": "user", "content": None}, "NoneType"),
        ({"role": "user", "content": "x", "name": 3}, "name"),
        ({"content": "x"}, "'role'"),
        ({"role": "user"}, "'content'"),
    ],
)
def test_invalid_messages_raise_naming_the_problem(message: dict[str, Any], needle: str) -> None:
    """Unknown roles, keys and part types raise ValueError that names the offending value."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        render_chat([{"role": "user", "content": "fine"}, message])


def test_empty_name_falls_back_to_role() -> None:
    """`name: ""` renders the role word, like the Jinja template's truthiness test."""
    segs = render_chat([{"role": "user", "content": "x", "name": ""}], add_generation_prompt=False)
    assert segs[1] == Segment("user", special=False)


def test_encode_chat_refuses_a_tokenizer_without_template(tmp_path: Path) -> None:
    """No template in the checkpoint means no chat encoding; we never borrow the shipped one."""
    (tmp_path / MODEL_FILE).write_bytes((ASSETS_DIR / MODEL_FILE).read_bytes())
    config = json.loads((ASSETS_DIR / CONFIG_FILE).read_text())
    del config["chat_template"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    tok = KimiTokenizer.from_dir(tmp_path)
    assert tok.encode("Hello world") == TOK.encode("Hello world")
    with pytest.raises(ValueError, match="no chat_template; a checkpoint must ship its own"):
        encode_chat(tok, CONVERSATION)
