"""Tool calls in generated ids, for tokenizers that define the Kimi tool-call markers.

A Kimi model writes its calls after the reply text as
`<|tool_calls_section_begin|>` then, per call, `<|tool_call_begin|>{id}<|tool_call_argument_begin|>{json}
<|tool_call_end|>`, then `<|tool_calls_section_end|>`; the id reads `functions.{name}:{index}`. A tokenizer
without all five markers has no parser (calls stay text). A section that does not parse (cut by max_tokens,
a marker out of order) is returned as text too, never half-parsed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from k3verify.tokenizer.tokenizer import KimiTokenizer

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)
_KIMI_ID = re.compile(r"^\s*(?:functions\.)?(?P<name>[^:\s]+?)(?::\d+)?\s*$")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParser:
    """Splits generated ids into reply text and tool calls (see the module doc)."""

    def __init__(self, tokenizer: KimiTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids = {name: tokenizer.special_id(name) for name in MARKERS}
        self.section_begin = self.ids[SECTION_BEGIN]

    @classmethod
    def for_tokenizer(cls, tokenizer: object) -> ToolCallParser | None:
        """A parser when `tokenizer` is a KimiTokenizer naming every marker, else None (calls stay text)."""
        if not isinstance(tokenizer, KimiTokenizer) or any(m not in tokenizer.special_to_id for m in MARKERS):
            return None
        return cls(tokenizer)

    def split(self, ids: Sequence[int]) -> tuple[str, list[ToolCall]] | None:
        """(reply text, calls) when `ids` hold a well-formed tool-call section; None when they hold none or a
        broken one (the caller then keeps the plain text)."""
        ids = list(ids)
        if self.section_begin not in ids:
            return None
        start = ids.index(self.section_begin)
        calls = self._calls(ids[start + 1:])
        if calls is None:
            return None
        return self.tokenizer.decode(ids[:start], skip_special=True), calls

    def _calls(self, ids: list[int]) -> list[ToolCall] | None:
        m = self.ids
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(ids) and ids[pos] == m[CALL_BEGIN]:
            try:
                arg, end = ids.index(m[ARGS_BEGIN], pos), ids.index(m[CALL_END], pos)
            except ValueError:
                return None
            if not pos < arg < end:
                return None
            raw_id = self.tokenizer.decode(ids[pos + 1:arg])
            named = _KIMI_ID.match(raw_id)
            if named is None:
                return None
            calls.append(ToolCall(raw_id.strip(), named.group("name"), self.tokenizer.decode(ids[arg + 1:end])))
            pos = end + 1
        if not calls or pos >= len(ids) or ids[pos] != m[SECTION_END]:
            return None
        return calls
