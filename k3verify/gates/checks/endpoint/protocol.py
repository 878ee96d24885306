"""Endpoint checks on the protocol around the model: chat-template rendering, stop strings, eos handling, and
streamed vs non-streamed answers. References come from the checkpoint's tokenizer and the oracle, or (stream,
stop strings) from the endpoint's own plain greedy answer to the same request."""

from __future__ import annotations

import torch

from k3verify.endpoint.session import EndpointAnswerError
from k3verify.endpoint.wire import Answer
from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.endpoint_common import Greedy, as_ids, greedy_answers, greedy_body, session, sizes
from k3verify.gates.shared.endpoint_oracle import score
from k3verify.tokenizer import encode_chat

FINISH_CODES = {None: 0, "stop": 1, "length": 2}
MAX_BIAS = 100.0  # OpenAI's logit_bias range
CONVERSATIONS: list[list[dict[str, object]]] = [
    # non-ASCII text: a server that decodes the body with another charset than UTF-8 renders other tokens
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour: «bleu» or vert?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello, how can I help?"},
     {"role": "user", "content": "tell me a joke"}],
    [{"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}],
]


def _finish(answer: Answer) -> torch.Tensor:
    return as_ids([FINISH_CODES.get(answer.finish_reason, 3)])


def _text(text: str) -> torch.Tensor:
    return as_ids(list(text.encode()))


@register_check(
    id="endpoint.chat.template", component="endpoint", level="serving", kind=Kind.BITEXACT,
    control="the conversation rendered without the generation prompt (no assistant turn opened)",
)
def check_chat_template(ctx: CheckContext) -> Trial:
    ep = session(ctx)
    if not ep.caps.chat.available:
        raise SkipCheck(f"the endpoint offers no chat completions: {ep.caps.chat.reason}")
    tokenizer = ctx.target.tokenizer()
    if tokenizer.chat_template is None:
        raise SkipCheck(f"the checkpoint has no chat template ({tokenizer.source} has no chat_template): there is "
                        "no reference rendering to hold the endpoint's to")
    ref, cand, ctrl, notes = {}, {}, {}, []
    for i, messages in enumerate(CONVERSATIONS[: 3 if ctx.suite == "full" else 2]):
        want = encode_chat(tokenizer, messages)
        wrong = encode_chat(tokenizer, messages, add_generation_prompt=False)
        usage = ep.chat([dict(m) for m in messages], max_tokens=1, temperature=0).usage or {}
        key = f"conv{i}"
        ref[f"{key}.prompt_tokens"], ctrl[f"{key}.prompt_tokens"] = as_ids([len(want)]), as_ids([len(wrong)])
        cand[f"{key}.prompt_tokens"] = as_ids([int(usage.get("prompt_tokens", -1))])
        if ep.caps.tokenize_chat.available and ep.caps.tokenize_path is not None:
            reply = ep.client.post(ep.caps.tokenize_path, {"model": ep.model, "messages": messages})
            body = reply.body if reply.ok and isinstance(reply.body, dict) else {}
            ref[f"{key}.ids"], ctrl[f"{key}.ids"] = as_ids(want), as_ids(wrong)
            cand[f"{key}.ids"] = as_ids([int(t) for t in body.get("tokens", [])])
    if not ep.caps.tokenize_chat.available:
        notes.append(f"prompt token counts only (usage.prompt_tokens): {ep.caps.tokenize_chat.reason}")
    notes.append("reference: the checkpoint tokenizer's chat rendering (k3verify.tokenizer.encode_chat)")
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=notes)


def _stop_string(ctx: CheckContext, g: Greedy) -> tuple[str, int] | None:
    """An ASCII token text of the answer (not its first two tokens) that occurs in its text after the start:
    (stop string, index of its first occurrence)."""
    tokenizer = ctx.target.tokenizer()
    best: tuple[str, int] | None = None
    for token in g.tokens[2:]:
        if token >= tokenizer.n_vocab or tokenizer.is_special(token):
            continue
        text = tokenizer.token_bytes(token).decode("utf-8", errors="replace")
        at = g.answer.text.find(text)
        if text.isascii() and text.strip() and at > 0 and (best is None or len(text) > len(best[0])):
            best = (text, at)
    return best


@register_check(
    id="endpoint.stop.strings", component="endpoint", level="serving", kind=Kind.BITEXACT,
    control="the stop string kept in the returned text",
)
def check_stop_strings(ctx: CheckContext) -> Trial:
    ep = session(ctx)
    ref, cand, ctrl, notes = {}, {}, {}, []
    for i, g in enumerate(greedy_answers(ctx)):
        found = _stop_string(ctx, g)
        if found is None:
            continue
        stop, at = found
        answer = ep.complete(g.prompt, max_tokens=greedy_body(ctx)["max_tokens"], temperature=0, stop=[stop])
        key = f"prompt{i}"
        ref[f"{key}.text"], ctrl[f"{key}.text"] = _text(g.answer.text[:at]), _text(g.answer.text[:at] + stop)
        cand[f"{key}.text"] = _text(answer.text)
        ref[f"{key}.finish"] = ctrl[f"{key}.finish"] = as_ids([FINISH_CODES["stop"]])
        cand[f"{key}.finish"] = _finish(answer)
        notes.append(f"prompt {i}: stop={stop!r}, first met at character {at} of the unstopped greedy text")
    if not ref:
        raise SkipCheck("no greedy answer has an ASCII token text to use as a stop string")
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=notes)


def _eos_bias(ctx: CheckContext, g: Greedy, eos: int) -> tuple[int, float] | None:
    """(step j, bias b): with logit_bias {eos: b} the greedy answer keeps its first j tokens and then takes eos,
    each side clear of the oracle's near-tie threshold; None if no b within [-100, 100] does that."""
    scores = score(ctx, g.prompt + g.tokens, len(g.prompt))
    margins = [scores.margin(j, eos) for j in range(len(g.tokens))]
    ties = [scores.tie_threshold(j) for j in range(len(g.tokens))]
    best: tuple[float, int, float] | None = None
    for j in range(1, len(margins)):
        gap = min(margins[:j]) - margins[j]
        if gap > 2 * max(ties[: j + 1]) and (best is None or gap > best[0]):
            best = (gap, j, (min(margins[:j]) + margins[j]) / 2)
    if best is not None:
        return best[1], best[2]
    bias = margins[0] + max(1.0, 2 * ties[0])  # eos at the very first step
    return (0, bias) if bias <= MAX_BIAS else None


@register_check(
    id="endpoint.stop.eos", component="endpoint", level="serving", kind=Kind.BITEXACT,
    control="generation does not stop at the eos token (it continues with the unbiased next token)",
)
@builders.single_thread
def check_stop_eos(ctx: CheckContext) -> Trial:
    ep = session(ctx)
    if not ep.caps.logit_bias.available:
        raise SkipCheck(f"eos is steered with logit_bias, which the endpoint lacks: {ep.caps.logit_bias.reason}")
    g = max(greedy_answers(ctx), key=lambda a: len(a.tokens))
    if not g.tokens:
        raise SkipCheck("no greedy answer has an identifiable token to steer eos into")
    tokenizer = ctx.target.tokenizer()
    ref, cand, ctrl, notes = {}, {}, {}, []
    for eos in sorted(ctx.cfg.eos_token_ids):
        chosen = _eos_bias(ctx, g, eos)
        if chosen is None:
            notes.append(f"eos {eos}: no logit_bias within +-{MAX_BIAS} makes it the greedy token; not checked")
            continue
        j, bias = chosen
        answer = ep.complete(g.prompt, max_tokens=len(g.tokens), temperature=0, logprobs=1,
                             logit_bias={str(eos): round(bias, 4)})
        ids = answer.resolved_ids()
        ids = ids[:-1] if ids and ids[-1] == eos else ids
        name = tokenizer.token_bytes(eos).decode("utf-8", errors="replace") if eos < tokenizer.n_vocab else ""
        key = f"eos{eos}"
        ref[f"{key}.tokens"], cand[f"{key}.tokens"] = as_ids(g.tokens[:j]), as_ids(ids)
        ctrl[f"{key}.tokens"] = as_ids([*g.tokens[:j], eos, g.tokens[j]])
        ref[f"{key}.finish"], cand[f"{key}.finish"] = as_ids([FINISH_CODES["stop"]]), _finish(answer)
        ctrl[f"{key}.finish"] = as_ids([FINISH_CODES["length"]])
        ref[f"{key}.eos_text"] = ctrl[f"{key}.eos_text"] = as_ids([0])
        cand[f"{key}.eos_text"] = as_ids([int(bool(name) and name in answer.text)])
        notes.append(f"eos {eos}: logit_bias {bias:.3g} makes it the oracle's greedy token at step {j}")
    if not ref:
        raise SkipCheck("; ".join(notes))
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=notes)


@register_check(
    id="endpoint.stream.identity", component="endpoint", level="serving", kind=Kind.BITEXACT,
    control="the streamed answer with its last token and finish reason lost",
)
def check_stream_identity(ctx: CheckContext) -> Trial:
    ep = session(ctx)
    ref, cand, ctrl, notes = {}, {}, {}, []
    for i, g in enumerate(greedy_answers(ctx)[: sizes(ctx).streamed]):
        try:
            streamed = ep.complete_streamed(g.prompt, **greedy_body(ctx), stream_options={"include_usage": True})
        except EndpointAnswerError as exc:
            notes.append(f"stream_options.include_usage refused ({exc}); streamed without it")
            streamed = ep.complete_streamed(g.prompt, **greedy_body(ctx))
        key = f"prompt{i}"
        tokens = streamed.resolved_ids()
        ref[f"{key}.tokens"], cand[f"{key}.tokens"] = as_ids(g.tokens), as_ids(tokens)
        ctrl[f"{key}.tokens"] = as_ids(tokens[:-1])
        ref[f"{key}.text"], cand[f"{key}.text"] = _text(g.answer.text), _text(streamed.text)
        ctrl[f"{key}.text"] = _text(streamed.text[:-1])
        ref[f"{key}.finish"], cand[f"{key}.finish"] = _finish(g.answer), _finish(streamed)
        ctrl[f"{key}.finish"] = as_ids([FINISH_CODES[None]])
        if g.answer.usage and streamed.usage:
            ref[f"{key}.usage"] = ctrl[f"{key}.usage"] = as_ids([int(g.answer.usage.get("completion_tokens", -1))])
            cand[f"{key}.usage"] = as_ids([int(streamed.usage.get("completion_tokens", -2))])
        plain = ep.complete_streamed(g.prompt, max_tokens=greedy_body(ctx)["max_tokens"], temperature=0)
        ref[f"{key}.plain.text"], cand[f"{key}.plain.text"] = _text(g.answer.text), _text(plain.text)
        ctrl[f"{key}.plain.text"] = _text(plain.text[:-1])
        ref[f"{key}.plain.finish"], cand[f"{key}.plain.finish"] = _finish(g.answer), _finish(plain)
        ctrl[f"{key}.plain.finish"] = as_ids([FINISH_CODES[None]])
    notes.append("reference: the endpoint's own non-streamed answer to the same greedy request, streamed with "
                 "top-k logprobs and again without any (a server may frame plain text deltas apart)")
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=notes)
