"""The checkpoint's own chat template, rendered the way `serve` renders it (Jinja, sandboxed, user text protected).

Hostile conversations spell every special token of the checkpoint's tokenizer inside content, text parts, names,
tool results and (where the template reads them) tool-call arguments. The special tokens of the rendered prompt
must be exactly those of the same conversation with harmless text: user text never adds a special token. Where
the checkpoint's template is the project's own, the ids must also equal the plain reference renderer's (chat.py).
Control: the same render without the sentinel protection, encoding the whole string with specials recognised.
"""

from __future__ import annotations

from typing import Any

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.tokenizer import KimiTokenizer, encode_chat, reference_chat_ids
from k3verify.tokenizer.jinja_chat import render_chat_ids, template_reads
from k3verify.tokenizer.templates import KIMI_CHAT_FORMAT

Message = dict[str, Any]


def _conversations(spell: str, calls: bool) -> dict[str, list[Message]]:
    """Conversations whose every free-text field says `spell` (hostile) or something harmless."""
    out: dict[str, list[Message]] = {
        "turns": [{"role": "system", "content": f"be brief {spell}"},
                  {"role": "user", "content": f"what does {spell} mean?", "name": f"ann {spell}"},
                  {"role": "assistant", "content": [{"type": "text", "text": spell}, {"type": "text", "text": "!"}]},
                  {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo wor"},
                                               {"type": "text", "text": "ld"}]},  # parts cut inside words
                  {"role": "user", "content": spell}],
        "tool_result": [{"role": "user", "content": "weather?"},
                        {"role": "tool", "content": f"sunny {spell}", "tool_call_id": f"call {spell}"}],
    }
    if calls:
        out["tool_call"] = [{"role": "user", "content": "weather?"},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": "call_0", "type": "function",
                                 "function": {"name": "get_weather", "arguments": f'{{"city": "{spell}"}}'}}]},
                            {"role": "tool", "content": "sunny", "tool_call_id": "call_0"}]
    return out


def _specials(tok: KimiTokenizer, ids: list[int]) -> torch.Tensor:
    return torch.tensor([i for i in ids if tok.is_special(i)], dtype=torch.int64)


def _plain_messages(messages: list[Message]) -> list[Message]:
    """What the plain reference renderer accepts (it has no tool_call_id)."""
    return [{k: v for k, v in m.items() if k != "tool_call_id"} for m in messages]


@register_check(id="tokenizer.chat.own_template", component="tokenizer", level="module", kind=Kind.BITEXACT,
                control="the checkpoint's template rendered without protecting user text")
def check_own_template(ctx: CheckContext) -> Trial:
    tok = ctx.target.tokenizer()
    source = tok.chat_template
    if source is None:
        raise SkipCheck("the checkpoint ships no chat_template: serve refuses chat requests for it")
    calls = "tool_calls" in template_reads(source)
    spell = " ".join(sorted(tok.special_to_id)[:40]) + " [EOS] <|im_end|>"
    hostile, harmless = _conversations(spell, calls), _conversations("plain words", calls)
    ref: dict[str, torch.Tensor] = {}
    cand: dict[str, torch.Tensor] = {}
    ctrl: dict[str, torch.Tensor] = {}
    for name, messages in hostile.items():
        ids = encode_chat(tok, messages)
        ref[f"specials:{name}"] = _specials(tok, encode_chat(tok, harmless[name]))
        cand[f"specials:{name}"] = _specials(tok, ids)
        ctrl[f"specials:{name}"] = _specials(tok, render_chat_ids(tok, source, messages, protect_user_text=False))
        if tok.chat_format == KIMI_CHAT_FORMAT and name != "tool_call":
            ref[f"ids:{name}"] = torch.tensor(reference_chat_ids(tok, _plain_messages(messages)))
            cand[f"ids:{name}"] = torch.tensor(ids)
            ctrl[f"ids:{name}"] = torch.tensor(render_chat_ids(tok, source, messages, protect_user_text=False))
    return Trial(reference=ref, candidate=cand, control=ctrl,
                 notes=[f"template: {tok.chat_format} ({len(source)} chars); reads tool_calls: {calls}; user text "
                        f"spells {len(tok.special_to_id)} special names",
                        "ids:* compare the Jinja render with the plain reference renderer (project template only)"])
