"""Stream text deltas framed from a template (Renderer.sse_chunks, completions and chat without a tool parser) are
the bytes the pydantic models and json.dumps render (chunks() through sse_event), token by token, to the end of a
stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from k3verify.api.chat_render import ChatRenderer
from k3verify.api.render import CompletionRenderer, Renderer, sse_event
from k3verify.serving.events import EngineEvent
from k3verify.serving.sampler import TokenLogprob

TEXTS = ["hello", "", " ", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00\x1f control", "é ü 中文 😀",
         "\ud800 lone surrogate", "</script>", "k3v-text", "{\"json\": 1}"]
KINDS: dict[str, type[Renderer]] = {"completion": CompletionRenderer, "chat": ChatRenderer}


class _Bytes:
    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()


def _renderer(kind: str, **kw: Any) -> Renderer:
    args: dict[str, Any] = {"want_logprobs": False, "include_usage": False} | kw
    return KINDS[kind]("cmpl-abc", 1_700_000_000, "my-model", _Bytes(), **args)


def _events() -> list[EngineEvent]:
    evs = [EngineEvent(text=t, token_ids=[i]) for i, t in enumerate(TEXTS)]
    return evs + [EngineEvent(text="end", token_ids=[99], finish_reason="length", prompt_tokens=3,
                              completion_tokens=len(TEXTS) + 1)]


def _slow(r: Renderer, ev: EngineEvent) -> list[str]:
    return [sse_event(c) for c in r.chunks(ev)]


def _stream(r: Renderer, slow: bool) -> list[str]:
    out: list[str] = []
    for ev in _events():
        out += _slow(r, ev) if slow else r.sse_chunks(ev)
    return out


@pytest.mark.parametrize("include_usage", [False, True], ids=["no_usage", "usage"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_template_framed_deltas_equal_the_model_rendered_ones(kind: str, include_usage: bool) -> None:
    fast_r, slow_r = _renderer(kind, include_usage=include_usage), _renderer(kind, include_usage=include_usage)
    fast, slow = _stream(fast_r, slow=False), _stream(slow_r, slow=True)
    assert fast == slow
    assert fast_r._text_frame is not None, "the template path ran"
    assert (fast_r.text, fast_r.token_ids, fast_r.finish_reason) == (slow_r.text, slow_r.token_ids, "length")
    first = json.loads(fast[0].removeprefix("data: "))
    text = first["choices"][0]["text"] if kind == "completion" else first["choices"][0]["delta"]["content"]
    assert text == "hello" and ("usage" in first) == include_usage
    assert len(fast) == len(TEXTS) - 1 + 1 + include_usage  # the empty delta sends nothing; usage at the end


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logprob_streams_and_the_last_event_take_the_model_path(kind: str) -> None:
    r = _renderer(kind, want_logprobs=True)
    ev = EngineEvent(text="a", token_ids=[5], logprobs=[TokenLogprob(5, -0.5, ((5, -0.5),))])
    assert r.sse_chunks(ev) == _slow(_renderer(kind, want_logprobs=True), ev)
    assert r._text_frame is None


def test_chat_with_a_tool_parser_never_takes_the_template() -> None:
    """Tool-call sections are held back from the content: such a stream's deltas are not plain."""
    assert _renderer("chat").plain_deltas()
    assert not _renderer("chat", tool_parser=object()).plain_deltas()


def test_a_wrong_template_split_would_show() -> None:
    """Control: a frame cut one character off (what a template drifting from the models would give) differs."""
    r = _renderer("completion")
    r.sse_chunks(EngineEvent(text="x", token_ids=[1]))
    assert r._text_frame is not None
    head, tail = r._text_frame
    r._text_frame = (head, tail[1:])
    ev = EngineEvent(text="y", token_ids=[2])
    assert r.sse_chunks(ev) != _slow(_renderer("completion"), ev)
