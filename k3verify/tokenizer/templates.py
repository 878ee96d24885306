"""Chat templates this package can render, keyed by the exact template string a config carries."""

from __future__ import annotations

import hashlib

# The K3 turn format as a Jinja template, so HF-style consumers render the same string we do.
# `tool` turns use the system marker; a non-empty `name` replaces the role word after the marker.
KIMI_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}<|im_system|>{%- else -%}<|im_{{ message['role'] }}|>{%- endif -%}"
    "{%- if message.get('name') -%}{{ message['name'] }}{%- else -%}{{ message['role'] }}{%- endif -%}"
    "<|im_middle|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

KIMI_CHAT_FORMAT = "kimi-im"

# We do not run Jinja: a template is supported only if it is one whose semantics chat.py implements.
SUPPORTED_CHAT_TEMPLATES: dict[str, str] = {KIMI_CHAT_TEMPLATE: KIMI_CHAT_FORMAT}


def chat_format_of(template: object, *, source: str) -> str:
    """Name of the chat format implemented by `template`; ValueError if we cannot render it faithfully."""
    if not isinstance(template, str):
        raise ValueError(f"{source}: chat_template must be a string; got {type(template).__name__}")
    fmt = SUPPORTED_CHAT_TEMPLATES.get(template)
    if fmt is None:
        digest = hashlib.sha256(template.encode()).hexdigest()[:16]
        raise ValueError(
            f"{source}: unsupported chat_template (sha256 {digest}…, {len(template)} chars); "
            f"supported formats: {sorted(SUPPORTED_CHAT_TEMPLATES.values())}"
        )
    return fmt
