"""K3 chat rendering: `<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>` per turn.

This plain renderer is the reference for the project's own template (templates.KIMI_CHAT_TEMPLATE); serving
renders every template, that one included, with Jinja (`encode_chat` -> jinja_chat.render_chat_ids), and the
tokenizer.chat.* checks hold the two to the same ids.

Rules (mirrored by templates.KIMI_CHAT_TEMPLATE):
- roles: system, user, assistant; `tool` (a tool result) renders with the `<|im_system|>` marker and the
  word "tool", as the Kimi family feeds tool results back as system-marker turns;
- a non-empty `name` replaces the role word after the marker (it stays plain text, spaces and all);
- content is a string or a list of `{"type": "text", "text": ...}` parts, concatenated with no separator;
- any other message key, part type or role raises ValueError naming it.
Only the markers become special ids; role words, names and content are always plain text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from k3verify.tokenizer.jinja_chat import render_chat_ids
from k3verify.tokenizer.tokenizer import KimiTokenizer

ROLE_MARKERS = {
    "system": "<|im_system|>",
    "user": "<|im_user|>",
    "assistant": "<|im_assistant|>",
    "tool": "<|im_system|>",
}
MESSAGE_KEYS = frozenset({"role", "content", "name"})
PART_KEYS = frozenset({"type", "text"})


@dataclass(frozen=True)
class Segment:
    """A run of the rendered prompt: a special marker, or plain text that is never parsed for markers."""

    text: str
    special: bool


def _content_text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message {index}: content must be a string or a list of parts; got {type(content).__name__}")
    texts = []
    for part in content:
        if not isinstance(part, Mapping):
            raise ValueError(f"message {index}: content part must be an object; got {type(part).__name__}")
        if part.get("type") != "text":
            raise ValueError(f"message {index}: unsupported content part type {part.get('type')!r} (only 'text')")
        extra = sorted(set(part) - PART_KEYS)
        if extra:
            raise ValueError(f"message {index}: unexpected keys in text part: {extra}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"message {index}: text part needs a string 'text'; got {text!r}")
        texts.append(text)
    return "".join(texts)


def render_chat(messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True) -> list[Segment]:
    """Segments of the K3 prompt for `messages`; empty text runs are omitted."""
    segments: list[Segment] = []

    def text(s: str) -> None:
        if s:
            segments.append(Segment(s, special=False))

    def marker(name: str) -> None:
        segments.append(Segment(name, special=True))

    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {index}: must be an object; got {type(message).__name__}")
        extra = sorted(set(message) - MESSAGE_KEYS)
        if extra:
            raise ValueError(f"message {index}: unexpected keys {extra}; accepted: {sorted(MESSAGE_KEYS)}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"message {index}: missing {key!r}")
        role = message["role"]
        if not isinstance(role, str) or role not in ROLE_MARKERS:
            raise ValueError(f"message {index}: unknown chat role {role!r}; supported: {sorted(ROLE_MARKERS)}")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"message {index}: name must be a string; got {type(name).__name__}")
        marker(ROLE_MARKERS[role])
        text(name or role)
        marker("<|im_middle|>")
        text(_content_text(message["content"], index))
        marker("<|im_end|>")
    if add_generation_prompt:
        marker("<|im_assistant|>")
        text("assistant")
        marker("<|im_middle|>")
    return segments


def render_chat_text(
    messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True
) -> tuple[str, list[int]]:
    """The prompt as one string, plus the character offset at which each special marker starts."""
    parts: list[str] = []
    marker_offsets: list[int] = []
    pos = 0
    for seg in render_chat(messages, add_generation_prompt=add_generation_prompt):
        if seg.special:
            marker_offsets.append(pos)
        parts.append(seg.text)
        pos += len(seg.text)
    return "".join(parts), marker_offsets


def reference_chat_ids(
    tokenizer: KimiTokenizer, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True
) -> list[int]:
    """Segment by segment: markers looked up as special ids, every text run encoded on its own as plain text."""
    ids: list[int] = []
    for seg in render_chat(messages, add_generation_prompt=add_generation_prompt):
        if seg.special:
            ids.append(tokenizer.special_id(seg.text))
        else:
            ids += tokenizer.encode(seg.text)
    return ids


def encode_rendered(tokenizer: KimiTokenizer, text: str, marker_offsets: Sequence[int]) -> list[int]:
    """Encode a rendered prompt string; a special id is emitted only at the given offsets.

    Marker-like text anywhere else (a user typing `<|im_end|>` or `[EOS]`) stays plain text, which a
    plain `encode(text, allow_special=True)` would not guarantee.
    """
    ids: list[int] = []
    pos = 0
    for offset in marker_offsets:
        if offset < pos:
            raise ValueError(f"marker offsets must be increasing and non-overlapping; got {offset} after {pos}")
        names = [name for name in tokenizer.special_to_id if text.startswith(name, offset)]
        if len(names) != 1:
            raise ValueError(f"expected exactly one special token at offset {offset}; found {names}")
        ids += tokenizer.encode(text[pos:offset])
        ids.append(tokenizer.special_to_id[names[0]])
        pos = offset + len(names[0])
    ids += tokenizer.encode(text[pos:])
    return ids


def encode_chat(
    tokenizer: KimiTokenizer, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Prompt ids for `messages` (and `tools`) under the tokenizer's own chat template, rendered with Jinja in a
    sandbox with user text protected (jinja_chat.py). A tokenizer without a template fails fast."""
    if tokenizer.chat_template is None:
        raise ValueError(f"{tokenizer.source}: no chat_template; a checkpoint must ship its own (no fallback to a "
                         "sibling model's template)")
    return render_chat_ids(tokenizer, tokenizer.chat_template, messages, tools=tools,
                           add_generation_prompt=add_generation_prompt)


def reencode_check(
    tokenizer: KimiTokenizer, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True
) -> bool:
    """Encoding the whole rendered string (specials only at marker offsets) equals the segment-wise ids."""
    text, offsets = render_chat_text(messages, add_generation_prompt=add_generation_prompt)
    whole = encode_rendered(tokenizer, text, offsets)
    return whole == reference_chat_ids(tokenizer, messages, add_generation_prompt=add_generation_prompt)
