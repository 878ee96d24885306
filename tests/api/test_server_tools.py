"""OpenAI tool messages in, tool calls out: a checkpoint whose template renders tools and whose vocabulary has the
Kimi tool-call markers gets generated calls back as `tool_calls` (JSON and streamed); without the markers, or with
tool_choice='none', they stay text; a section cut by max_tokens stays text."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
import torch
from server_fakes import FakeRunner
from server_harness import running_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tokenizer"))
from test_tokenizer_jinja import CALL_TURNS, TOOLS, TOOLS_TEMPLATE, tokenizer_with  # noqa: E402

from k3verify.tokenizer import KimiTokenizer  # noqa: E402

MODEL = "tools"


class ScriptedRunner(FakeRunner):
    """Generates `script` token by token (one-hot logits over the tokenizer's vocabulary), then its eos."""

    def __init__(self, script: list[int], vocab: int, eos: int) -> None:
        super().__init__(max_context=1024, num_pages=128)
        self.script, self.vocab, self.eos = script, vocab, eos
        self.prompts: list[list[int]] = []

    def logits_for(self, slot: object) -> torch.Tensor:
        history, prompt_len = slot.history, slot.prompt_len  # type: ignore[attr-defined]
        if len(history) == prompt_len:
            self.prompts.append(list(history))
        step = len(history) - prompt_len
        row = torch.zeros(self.vocab)
        row[self.script[step] if step < len(self.script) else self.eos] = 10.0
        return row


def _call_ids(tok: KimiTokenizer) -> list[int]:
    sp = tok.special_id
    return (tok.encode("Let me check.") + [sp("<|tool_calls_section_begin|>"), sp("<|tool_call_begin|>")]
            + tok.encode("functions.get_weather:0") + [sp("<|tool_call_argument_begin|>")]
            + tok.encode('{"city": "Paris"}') + [sp("<|tool_call_end|>"), sp("<|tool_calls_section_end|>")])


@pytest.fixture
def tok(tmp_path: Path) -> KimiTokenizer:
    return tokenizer_with(tmp_path, TOOLS_TEMPLATE)


def _serve(tok: KimiTokenizer, script: list[int]) -> tuple[ScriptedRunner, object]:
    runner = ScriptedRunner(script, tok.n_vocab, tok.eos_id)
    return runner, running_server(runner, model=MODEL, tokenizer=tok, eos_ids=[tok.eos_id], vocab_size=tok.n_vocab)


def _chat(url: str, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "messages": CALL_TURNS, "tools": TOOLS, "max_tokens": 64, "temperature": 0} | extra
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_generated_call_comes_back_as_tool_calls(tok: KimiTokenizer) -> None:
    runner, server = _serve(tok, _call_ids(tok))
    with server as s:  # type: ignore[attr-defined]
        r = _chat(s.url)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    [prompt] = runner.prompts  # the incoming call and result were rendered by the template, text kept plain
    specials = [tok.id_to_special[i] for i in prompt if tok.is_special(i)]
    assert specials.count("<|tool_call_begin|>") == 1 and specials.count("<|im_end|>") == 4


def test_streamed_call_sends_text_then_one_tool_calls_delta(tok: KimiTokenizer) -> None:
    _, server = _serve(tok, _call_ids(tok))
    with server as s:  # type: ignore[attr-defined]
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": CALL_TURNS, "tools": TOOLS, "stream": True,
                                "temperature": 0}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls == [[{"index": 0, "id": "functions.get_weather:0", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_and_a_cut_section_stay_text(tok: KimiTokenizer) -> None:
    script = _call_ids(tok)
    _, server = _serve(tok, script)
    with server as s:  # type: ignore[attr-defined]
        plain = _chat(s.url, tool_choice="none").json()["choices"][0]
        cut = _chat(s.url, max_tokens=len(script) - 2).json()["choices"][0]
    text = tok.decode(script, skip_special=True)
    assert plain["message"] == {"role": "assistant", "content": text} and plain["finish_reason"] == "stop"
    assert "tool_calls" not in cut["message"] and cut["finish_reason"] == "length"
    assert cut["message"]["content"] == tok.decode(script[:-2], skip_special=True)


def test_without_markers_calls_stay_text(tmp_path: Path) -> None:
    tok = tokenizer_with(tmp_path, TOOLS_TEMPLATE, markers=False)
    text_ids = tok.encode("Let me check. functions.get_weather:0 {}")
    _, server = _serve(tok, text_ids)
    with server as s:  # type: ignore[attr-defined]
        choice = _chat(s.url, messages=[{"role": "user", "content": "hi"}]).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": tok.decode(text_ids)}
