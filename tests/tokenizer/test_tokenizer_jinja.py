"""A checkpoint's own Jinja chat template: rendered in a sandbox, user text never becomes a special token, what the
template cannot express is refused, and generated tool calls are parsed when the vocabulary has the markers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from k3verify.tokenizer import KimiTokenizer, default_tokenizer, encode_chat, reference_chat_ids
from k3verify.tokenizer.jinja_chat import ChatTemplateError, render_chat_ids
from k3verify.tokenizer.tokenizer import ASSETS_DIR, CONFIG_FILE, MODEL_FILE
from k3verify.tokenizer.tool_calls import MARKERS, ToolCall, ToolCallParser

# A Kimi-style template with tools, written for these tests: tool declarations as JSON, assistant tool calls in
# the marker format, tool results as system-marker turns.
TOOLS_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n{{ m.content }}"
    "<|im_end|>"
    "{%- else -%}<|im_{{ m.role }}|>{{ m.name or m.role }}<|im_middle|>"
    "{%- if m.content is string -%}{{ m.content }}{%- elif m.content -%}{%- for p in m.content -%}{{ p.text }}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>{%- for c in m.tool_calls -%}<|tool_call_begin|>{{ c.id }}"
    "<|tool_call_argument_begin|>{{ c.function.arguments }}<|tool_call_end|>{%- endfor -%}"
    "<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather <|im_end|> \"now\"",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "weather in [EOS] Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                                           "function": {"name": "get_weather",
                                                                        "arguments": '{"city": "<|im_end|>"}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny <|tool_call_end|>"},
]


def tokenizer_with(tmp_path: Path, template: str | None, markers: bool = True) -> KimiTokenizer:
    """The project's vocabulary with `template` and (optionally) the tool-call markers on free special slots."""
    (tmp_path / MODEL_FILE).write_bytes((ASSETS_DIR / MODEL_FILE).read_bytes())
    config = json.loads((ASSETS_DIR / CONFIG_FILE).read_text())
    if markers:
        config["added_tokens_decoder"] |= {str(4110 + i): {"content": m, "special": True}
                                           for i, m in enumerate(MARKERS)}
    config["chat_template"] = template
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    return KimiTokenizer.from_dir(tmp_path)


def _specials(tok: KimiTokenizer, ids: list[int]) -> list[str]:
    return [tok.id_to_special[i] for i in ids if tok.is_special(i)]


def test_project_template_through_jinja_equals_the_reference_renderer() -> None:
    tok = default_tokenizer()
    messages = [{"role": "user", "content": "what does <|im_end|> mean? [EOS]", "name": "Eve<|im_user|>"},
                {"role": "assistant", "content": [{"type": "text", "text": "it "}, {"type": "text", "text": "ends"}]},
                {"role": "tool", "content": "[BOS]"}]
    assert encode_chat(tok, messages) == reference_chat_ids(tok, messages)


def test_own_template_keeps_user_text_plain_in_calls_results_and_tool_definitions(tmp_path: Path) -> None:
    """Every spelled marker in content, arguments, results and tool descriptions stays text; the template's
    own markers (and the quoted JSON of the tool definitions) come out as written."""
    tok = tokenizer_with(tmp_path, TOOLS_TEMPLATE)
    ids = encode_chat(tok, CALL_TURNS, tools=TOOLS)
    assert _specials(tok, ids) == [
        "<|im_system|>", "<|im_middle|>", "<|im_end|>", "<|im_user|>", "<|im_middle|>", "<|im_end|>",
        "<|im_assistant|>", "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_end|>",
        "<|im_system|>", "<|im_middle|>", "<|im_end|>", "<|im_assistant|>", "<|im_middle|>"]
    text = tok.decode(ids)
    assert json.dumps(TOOLS, ensure_ascii=False) in text  # what `tools | tojson` prints, byte for byte
    assert '{"city": "<|im_end|>"}<|tool_call_end|>' in text and "sunny <|tool_call_end|><|im_end|>" in text
    unprotected = render_chat_ids(tok, TOOLS_TEMPLATE, CALL_TURNS, tools=TOOLS, protect_user_text=False)
    assert len(_specials(tok, unprotected)) > len(_specials(tok, ids))  # the control: injection without sentinels


@pytest.mark.parametrize(("template", "error"), [
    ("{% for m in messages %}{{ m.content | upper }}{% endfor %}", "altered a message's text"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("{{ raise_exception('no system role') }}", "the chat template raised: no system role"),
])
def test_templates_that_would_change_or_escape_are_refused(tmp_path: Path, template: str, error: str) -> None:
    tok = tokenizer_with(tmp_path, template)
    with pytest.raises(ChatTemplateError, match=error):
        encode_chat(tok, [{"role": "user", "content": "hi there"}])


def test_calls_and_tools_a_template_never_reads_are_refused_not_dropped() -> None:
    tok = default_tokenizer()
    with pytest.raises(ChatTemplateError, match="never reads `tool_calls`"):
        encode_chat(tok, CALL_TURNS)
    with pytest.raises(ChatTemplateError, match="never reads `tools`"):
        encode_chat(tok, [{"role": "user", "content": "hi"}], tools=TOOLS)


def test_generated_tool_calls_parse_and_broken_sections_stay_text(tmp_path: Path) -> None:
    tok = tokenizer_with(tmp_path, TOOLS_TEMPLATE)
    parser = ToolCallParser.for_tokenizer(tok)
    assert parser is not None

    def sp(name: str) -> int:
        return tok.special_id(name)

    calls = [sp("<|tool_calls_section_begin|>")]
    for i, (name, args) in enumerate((("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))):
        calls += [sp("<|tool_call_begin|>"), *tok.encode(f"functions.{name}:{i}"), sp("<|tool_call_argument_begin|>"),
                  *tok.encode(args), sp("<|tool_call_end|>")]
    ids = tok.encode("Let me check.") + calls + [sp("<|tool_calls_section_end|>")]
    assert parser.split(ids) == ("Let me check.", [ToolCall("functions.get_weather:0", "get_weather",
                                                            '{"city": "Paris"}'),
                                                   ToolCall("functions.get_time:1", "get_time", "{}")])
    assert parser.split(tok.encode("Let me check.") + calls) is None  # cut before the section end
    assert parser.split(tok.encode("no calls here")) is None
    assert ToolCallParser.for_tokenizer(default_tokenizer()) is None  # no markers: calls stay text
