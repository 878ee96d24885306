"""Tokenizer and chat rendering for the Kimi-K3 / Kimi-Linear family (SPEC §7)."""

from k3verify.tokenizer.chat import (
    Segment,
    encode_chat,
    encode_rendered,
    reencode_check,
    reference_chat_ids,
    render_chat,
    render_chat_text,
)
from k3verify.tokenizer.streaming import IncrementalDecoder
from k3verify.tokenizer.templates import KIMI_CHAT_FORMAT, KIMI_CHAT_TEMPLATE
from k3verify.tokenizer.tokenizer import (
    MAX_CHARS_PER_CALL,
    MAX_RUN_CHARS,
    NUM_SPECIAL_SLOTS,
    PAT_STR,
    KimiTokenizer,
    default_tokenizer,
    split_for_encoding,
)

__all__ = [
    "KIMI_CHAT_FORMAT",
    "KIMI_CHAT_TEMPLATE",
    "MAX_CHARS_PER_CALL",
    "MAX_RUN_CHARS",
    "NUM_SPECIAL_SLOTS",
    "PAT_STR",
    "IncrementalDecoder",
    "KimiTokenizer",
    "Segment",
    "default_tokenizer",
    "encode_chat",
    "encode_rendered",
    "reencode_check",
    "reference_chat_ids",
    "render_chat",
    "render_chat_text",
    "split_for_encoding",
]
