"""The completions stream's text-delta events framed from a template (CompletionRenderer.sse_chunks) are the bytes
the pydantic models and json.dumps render (Renderer.sse_chunks), token by token, to the end of a stream."""

from __future__ import annotations

import json

import pytest

from k3verify.server.render import CompletionRenderer, Renderer
from k3verify.serving.events import EngineEvent
from k3verify.serving.sampler import TokenLogprob

TEXTS = ["hello", "", " ", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00\x1f control", "é ü 中文 😀",
         "\ud800 lone surrogate", "</script>", "k3v-text", "{\"json\": 1}"]


class _Bytes:
    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()


def _renderer(**kw: object) -> CompletionRenderer:
    args: dict[str, object] = {"want_logprobs": False, "include_usage": False} | kw
    return CompletionRenderer("cmpl-abc", 1_700_000_000, "my-model", _Bytes(), **args)  # type: ignore[arg-type]


def _events() -> list[EngineEvent]:
    evs = [EngineEvent(text=t, token_ids=[i]) for i, t in enumerate(TEXTS)]
    return evs + [EngineEvent(text="end", token_ids=[99], finish_reason="length", prompt_tokens=3,
                              completion_tokens=len(TEXTS) + 1)]


def _stream(r: CompletionRenderer, slow: bool) -> list[str]:
    out: list[str] = []
    for ev in _events():
        out += Renderer.sse_chunks(r, ev) if slow else r.sse_chunks(ev)
    return out


@pytest.mark.parametrize("include_usage", [False, True], ids=["no_usage", "usage"])
def test_template_framed_deltas_equal_the_model_rendered_ones(include_usage: bool) -> None:
    fast_r, slow_r = _renderer(include_usage=include_usage), _renderer(include_usage=include_usage)
    fast, slow = _stream(fast_r, slow=False), _stream(slow_r, slow=True)
    assert fast == slow
    assert fast_r._text_frame is not None, "the template path ran"
    assert (fast_r.text, fast_r.token_ids, fast_r.finish_reason) == (slow_r.text, slow_r.token_ids, "length")
    first = json.loads(fast[0].removeprefix("data: "))
    assert first["choices"][0] == {"index": 0, "text": "hello", "finish_reason": None, "logprobs": None}
    assert ("usage" in first) == include_usage
    assert len(fast) == len(TEXTS) - 1 + 1 + include_usage  # the empty delta sends nothing; usage at the end


def test_logprob_streams_and_the_last_event_take_the_model_path() -> None:
    r = _renderer(want_logprobs=True)
    ev = EngineEvent(text="a", token_ids=[5], logprobs=[TokenLogprob(5, -0.5, ((5, -0.5),))])
    assert r.sse_chunks(ev) == Renderer.sse_chunks(_renderer(want_logprobs=True), ev)
    assert r._text_frame is None


def test_a_wrong_template_split_would_show() -> None:
    """Control: a frame cut one character off (what a template drifting from the models would give) differs."""
    r = _renderer()
    r.sse_chunks(EngineEvent(text="x", token_ids=[1]))
    assert r._text_frame is not None
    head, tail = r._text_frame
    r._text_frame = (head, tail[1:])
    got = r.sse_chunks(EngineEvent(text="y", token_ids=[2]))
    assert got != Renderer.sse_chunks(_renderer(), EngineEvent(text="y", token_ids=[2]))
