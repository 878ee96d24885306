"""A checkpoint's own Jinja chat template, rendered so that user text can never become a special token.

The template runs in jinja2's immutable sandbox (no attribute access to Python internals, no mutation of the
messages). Before rendering, every free-text field a client controls (message content and text parts, names,
tool-call ids and arguments, tool results, strings inside tool definitions) is replaced by a sentinel made of a
per-render random nonce and an index. The rendered string is then split at the sentinels: the template's own text
is encoded with special-token names recognised (the template is trusted), each sentinel's text is encoded as plain
text. So "[EOS]" or "<|im_end|>" typed by a user stays text, whatever the template does.

A sentinel the template passed through `tojson` arrives quoted ("<sentinel>"): it is replaced by the JSON string
body of its text, which is what the template would have printed. A sentinel the template altered (sliced, upper-
cased, ...) cannot be put back faithfully and raises. A request the template cannot express raises too: tool calls
or tool definitions sent to a template that never reads them are refused, not dropped.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTokenizer(Protocol):
    """What rendering needs of a tokenizer (KimiTokenizer is one). A protocol, not the class: the tokenizer
    module checks templates at load through this one, so this module must not import it back."""

    @property
    def id_to_special(self) -> Mapping[int, str]: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]: ...


ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


class ChatTemplateError(ValueError):
    """A template that does not compile, or a request it cannot render faithfully; the message says which."""


def _tojson(value: Any, indent: int | None = None) -> str:
    # Templates written for transformers expect its tojson: plain json.dumps, non-ASCII kept, no HTML escaping.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise ChatTemplateError(f"the chat template raised: {message}")


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the sandbox (cached by its source); a syntax error raises naming the line."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat_template does not compile: line {exc.lineno}: {exc.message}") from None


@functools.lru_cache(maxsize=16)
def template_reads(source: str) -> frozenset[str]:
    """Every variable, attribute and constant item name the template reads (to refuse what it would drop)."""
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    tree = env.parse(source)
    names: set[str] = {n.name for n in tree.find_all(nodes.Name)}
    names |= {n.attr for n in tree.find_all(nodes.Getattr)}
    names |= {n.arg.value for n in tree.find_all(nodes.Getitem) if isinstance(n.arg, nodes.Const)
              and isinstance(n.arg.value, str)}
    return frozenset(names)


class _Protector:
    """Swaps client strings for sentinels (fresh nonce per render) and remembers them."""

    def __init__(self) -> None:
        self.nonce = secrets.token_hex(8)
        self.texts: list[str] = []
        self.pattern = re.compile(f"(\"?)K3VS{self.nonce}N(\\d+)Z(\"?)")
        self.trace = re.compile(f"K3VS{self.nonce[:8]}", re.IGNORECASE)  # what an altered sentinel still shows

    def __call__(self, text: str) -> str:
        if not text:  # nothing to inject, and a template may test it for truth (an empty name means "no name")
            return text
        self.texts.append(text)
        return f"K3VS{self.nonce}N{len(self.texts) - 1}Z"

    def deep(self, value: Any) -> Any:
        """Every string leaf of a JSON-like value protected (tool definitions)."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, Mapping):
            return {k: self.deep(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.deep(v) for v in value]
        return value


def _protect_message(m: Mapping[str, Any], index: int, protect: _Protector) -> dict[str, Any]:
    extra = sorted(set(m) - MESSAGE_KEYS)
    if extra:
        raise ChatTemplateError(f"message {index}: unexpected keys {extra}; accepted: {sorted(MESSAGE_KEYS)}")
    role = m.get("role")
    if role not in ROLES:
        raise ChatTemplateError(f"message {index}: unknown chat role {role!r}; supported: {list(ROLES)}")
    out: dict[str, Any] = {"role": role}
    content = m.get("content")
    if isinstance(content, str):
        out["content"] = protect(content)
    elif isinstance(content, list):
        out["content"] = [_protect_part(p, index, protect) for p in content]
    elif content is None and (role == "assistant" and m.get("tool_calls")):
        out["content"] = None
    else:
        raise ChatTemplateError(f"message {index}: content must be a string or a list of text parts "
                                f"(null only for an assistant message with tool_calls); got {content!r}")
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise ChatTemplateError(f"message {index}: {key} must be a string; got {m[key]!r}")
            out[key] = protect(m[key])
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise ChatTemplateError(f"message {index}: only assistant messages carry tool_calls")
        out["tool_calls"] = [_protect_call(c, index, protect) for c in m["tool_calls"]]
    return out


def _protect_part(part: Any, index: int, protect: _Protector) -> dict[str, str]:
    if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str) \
            or set(part) - {"type", "text"}:
        raise ChatTemplateError(f"message {index}: content parts must be {{'type': 'text', 'text': str}}; "
                                f"got {part!r}")
    return {"type": "text", "text": protect(part["text"])}


def _protect_call(call: Any, index: int, protect: _Protector) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise ChatTemplateError(f"message {index}: a tool call needs function.name and function.arguments "
                                f"(strings); got {call!r}")
    out = {"type": "function", "function": {"name": protect(fn["name"]), "arguments": protect(fn["arguments"])}}
    if call.get("id") is not None:
        out["id"] = protect(str(call["id"]))
    return out


def _refuse_what_it_drops(source: str, messages: Sequence[Mapping[str, Any]], tools: Any) -> None:
    reads = template_reads(source)
    if any(m.get("tool_calls") for m in messages) and "tool_calls" not in reads:
        raise ChatTemplateError("messages carry tool_calls but this checkpoint's chat template never reads "
                                "`tool_calls`: they would be dropped")
    if tools and "tools" not in reads:
        raise ChatTemplateError("the request defines tools but this checkpoint's chat template never reads "
                                "`tools`: they would be dropped")


def render_chat_ids(tokenizer: ChatTokenizer, source: str, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                    protect_user_text: bool = True) -> list[int]:
    """Prompt ids of `messages` under the Jinja template `source` (see the module doc). protect_user_text=False
    renders without sentinels (the control of the injection check: never for serving)."""
    _refuse_what_it_drops(source, messages, tools)
    protect = _Protector()
    msgs = [_protect_message(m, i, protect) for i, m in enumerate(messages)]
    if not protect_user_text:
        msgs = [_unprotect(m, protect) for m in msgs]
    variables: dict[str, Any] = {"messages": msgs, "add_generation_prompt": add_generation_prompt,
                                 "bos_token": tokenizer.id_to_special[tokenizer.bos_id],
                                 "eos_token": tokenizer.id_to_special[tokenizer.eos_id]}
    if tools:
        variables["tools"] = protect.deep(list(tools)) if protect_user_text else list(tools)
    try:
        text = compile_template(source).render(**variables)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None
    if not protect_user_text:
        return tokenizer.encode(text, allow_special=True)
    return _encode_rendered(tokenizer, text, protect)


def _unprotect(value: Any, protect: _Protector) -> Any:
    if isinstance(value, str):
        m = protect.pattern.fullmatch(value)
        return protect.texts[int(m.group(2))] if m else value
    if isinstance(value, dict):
        return {k: _unprotect(v, protect) for k, v in value.items()}
    if isinstance(value, list):
        return [_unprotect(v, protect) for v in value]
    return value


def _encode_rendered(tokenizer: ChatTokenizer, text: str, protect: _Protector) -> list[int]:
    """Template text with specials recognised; user text (JSON-escaped where quoted) as plain text, adjacent user
    pieces (content parts) as one run, exactly as their concatenation would encode."""
    ids: list[int] = []
    user = ""
    pos = 0

    def template_text(piece: str) -> list[int]:
        if protect.trace.search(piece):
            raise ChatTemplateError("the chat template altered a message's text (a sentinel came out changed): "
                                    "its output cannot be encoded without risking special-token injection")
        return tokenizer.encode(piece, allow_special=True)

    for match in protect.pattern.finditer(text):
        quoted = match.group(1) == '"' and match.group(3) == '"'
        start = match.start() if quoted else match.start() + len(match.group(1))
        end = match.end() if quoted else match.end() - len(match.group(3))
        if start > pos:
            ids += tokenizer.encode(user) + template_text(text[pos:start])
            user = ""
        raw = protect.texts[int(match.group(2))]
        user += json.dumps(raw, ensure_ascii=False) if quoted else raw
        pos = end
    return ids + tokenizer.encode(user) + template_text(text[pos:])
