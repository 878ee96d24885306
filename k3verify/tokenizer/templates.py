"""The project's own chat template, and what kind of template a checkpoint carries.

Every template is rendered with Jinja (jinja_chat.py); the project's own one also has a plain renderer (chat.py),
the reference the tokenizer.chat.* checks hold the Jinja path to."""

from __future__ import annotations

import hashlib

from k3verify.tokenizer.jinja_chat import ChatTemplateError, compile_template

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
JINJA_CHAT_FORMAT = "jinja"


def chat_format_of(template: object, *, source: str) -> str:
    """`kimi-im` for the project's own template (its renderer, chat.py, is the gated reference), `jinja` for any
    other template that compiles in the sandbox; ValueError naming the problem otherwise."""
    if not isinstance(template, str):
        raise ValueError(f"{source}: chat_template must be a string; got {type(template).__name__}")
    if template == KIMI_CHAT_TEMPLATE:
        return KIMI_CHAT_FORMAT
    try:
        compile_template(template)
    except ChatTemplateError as exc:
        digest = hashlib.sha256(template.encode()).hexdigest()[:16]
        raise ValueError(f"{source}: chat_template (sha256 {digest}…, {len(template)} chars): {exc}") from None
    return JINJA_CHAT_FORMAT
