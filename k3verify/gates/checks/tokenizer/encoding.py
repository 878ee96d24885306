"""The shipped tokenizer and chat renderer (SPEC §7) against references written here, token id for token id.

Every expected id was computed once from the committed vocabulary (k3verify/tokenizer/assets, built
deterministically by tools/build_tokenizer.py) and pinned as a literal in gates/shared/tokenizer_pins.py: no reference
calls the code under test. Special ids are the released offsets from N = 4096. Chat references are assembled
from those literals by an independent rendering of the SPEC's turn format; the long-input reference pieces
come from a pure-Python splitter; the streaming references are literal strings. Id sequences are compared as
int64 tensors and text as its UTF-8 bytes, so a length mismatch is a failed comparison, never a crash.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from k3verify.gates import CheckContext, Kind, Trial, register_check
from k3verify.gates.shared.tokenizer_pins import (
    CALL_CAP_TEXT,
    EXACT_IDS,
    INJECTION_CONVERSATIONS,
    INJECTION_IDS,
    LONG_RUNS,
    PLAIN_IDS,
    RENDER_CONVERSATIONS,
    SPEC_CALL_CHARS,
    SPEC_RUN_CHARS,
    SPECIAL_IDS,
    STREAM_CASES,
    Message,
)
from k3verify.tokenizer import (
    IncrementalDecoder,
    KimiTokenizer,
    default_tokenizer,
    encode_chat,
    encode_rendered,
    render_chat,
    render_chat_text,
    split_for_encoding,
)
from k3verify.tokenizer.tokenizer import ASSETS_DIR, MODEL_FILE, PAT_STR, load_mergeable_ranks


def _ids(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _utf8(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def _expand(runs: Sequence[tuple[int, int]]) -> list[int]:
    return [token for token, count in runs for _ in range(count)]


def _reference_chat(messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
    """SPEC §7: `<|im_{role}|>{name or role}<|im_middle|>{content}<|im_end|>` per turn (tool: system marker),
    then `<|im_assistant|>assistant<|im_middle|>`, from the pinned tables only."""
    ids: list[int] = []
    for message in messages:
        role = str(message["role"])
        ids.append(SPECIAL_IDS["<|im_system|>" if role == "tool" else f"<|im_{role}|>"])
        ids += PLAIN_IDS[str(message.get("name") or role)]
        ids.append(SPECIAL_IDS["<|im_middle|>"])
        content = message["content"]
        text = content if isinstance(content, str) else "".join(part["text"] for part in content)
        ids += PLAIN_IDS[text] if text else []
        ids.append(SPECIAL_IDS["<|im_end|>"])
    if add_generation_prompt:
        ids += [SPECIAL_IDS["<|im_assistant|>"], *PLAIN_IDS["assistant"], SPECIAL_IDS["<|im_middle|>"]]
    return ids


def _segment_ids(tok: KimiTokenizer, messages: Sequence[Message], add_generation_prompt: bool, *,
                 allow_special_in_text: bool = False, drop_role_word: bool = False) -> list[int]:
    """The shipped segments encoded one by one, with the control's fault switched in."""
    ids: list[int] = []
    after_role_marker = False
    for seg in render_chat(messages, add_generation_prompt=add_generation_prompt):
        if seg.special:
            ids.append(tok.special_id(seg.text))
            after_role_marker = seg.text != "<|im_middle|>" and seg.text != "<|im_end|>"
            continue
        if not (drop_role_word and after_role_marker):
            ids += tok.encode(seg.text, allow_special=allow_special_in_text)
        after_role_marker = False
    return ids


def _whole_string_ids(tok: KimiTokenizer, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
    text, offsets = render_chat_text(messages, add_generation_prompt=add_generation_prompt)
    return encode_rendered(tok, text, offsets)


@register_check(
    id="tokenizer.encode.exact_ids", component="tokenizer", level="module", kind=Kind.BITEXACT,
    control="the pre-tokenizer groups digits unbounded (\\p{N}+ instead of \\p{N}{1,3})",
)
def check_encode_exact_ids(ctx: CheckContext) -> Trial:
    import tiktoken


    tok = default_tokenizer()
    digits_rule = r"\p{N}{1,3}"
    unbounded = tiktoken.Encoding(name="k3verify-control-digits-unbounded",
                                  pat_str=PAT_STR.replace(digits_rule, r"\p{N}+"),
                                  mergeable_ranks=load_mergeable_ranks(ASSETS_DIR / MODEL_FILE), special_tokens={})
    reference: dict[str, torch.Tensor] = {}
    candidate: dict[str, torch.Tensor] = {}
    control: dict[str, torch.Tensor] = {}
    for name, (text, ids) in EXACT_IDS.items():
        reference[f"encode:{name}"] = _ids(ids)
        candidate[f"encode:{name}"] = _ids(tok.encode(text))
        control[f"encode:{name}"] = _ids(unbounded.encode_ordinary(text))
        reference[f"decode:{name}"] = _utf8(text)
        candidate[f"decode:{name}"] = _utf8(tok.decode(ids))
        control[f"decode:{name}"] = candidate[f"decode:{name}"]
    return Trial(reference=reference, candidate=candidate, control=control,
                 notes=[f"{len(EXACT_IDS)} texts pinned against the committed {tok.num_base_tokens}-token vocab; "
                        "decode of the pinned ids must give the text back"])


@register_check(
    id="tokenizer.encode.user_text_plain", component="tokenizer", level="module", kind=Kind.BITEXACT,
    control="user text encoded with allow_special=True, so typed [EOS] / <|im_end|> become special ids",
)
def check_encode_user_text_plain(ctx: CheckContext) -> Trial:
    tok = default_tokenizer()
    reference: dict[str, torch.Tensor] = {}
    candidate: dict[str, torch.Tensor] = {}
    control: dict[str, torch.Tensor] = {}
    for name, (text, plain, parsed) in INJECTION_IDS.items():
        reference[f"plain:{name}"] = _ids(plain)
        candidate[f"plain:{name}"] = _ids(tok.encode(text))
        control[f"plain:{name}"] = _ids(tok.encode(text, allow_special=True))
        # The opt-in path parses names into the released ids (looked up by name here, pinned by value above).
        reference[f"allow_special:{name}"] = _ids(parsed)
        candidate[f"allow_special:{name}"] = _ids(tok.encode(text, allow_special=True))
        control[f"allow_special:{name}"] = candidate[f"allow_special:{name}"]
    named = {name: tok.special_id(name) for name in SPECIAL_IDS}
    reference["special_ids"] = _ids(list(SPECIAL_IDS.values()))
    candidate["special_ids"] = _ids(list(named.values()))
    control["special_ids"] = candidate["special_ids"]
    return Trial(reference=reference, candidate=candidate, control=control,
                 notes=["plain encode must never emit an id >= N for text spelling special tokens"])


def _chat_trial(conversations: Mapping[str, tuple[list[Message], bool]],
                control: Callable[[KimiTokenizer, list[Message], bool], list[int]], note: str) -> Trial:
    tok = default_tokenizer()
    ref: dict[str, torch.Tensor] = {}
    cand: dict[str, torch.Tensor] = {}
    ctrl: dict[str, torch.Tensor] = {}
    for name, (messages, gen) in conversations.items():
        expected = _ids(_reference_chat(messages, gen))
        ref[f"encode_chat:{name}"] = expected
        cand[f"encode_chat:{name}"] = _ids(encode_chat(tok, messages, add_generation_prompt=gen))
        ctrl[f"encode_chat:{name}"] = _ids(control(tok, messages, gen))
        ref[f"whole_string:{name}"] = expected
        cand[f"whole_string:{name}"] = _ids(_whole_string_ids(tok, messages, gen))
        ctrl[f"whole_string:{name}"] = cand[f"whole_string:{name}"]
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[note])


@register_check(
    id="tokenizer.chat.render", component="tokenizer", level="module", kind=Kind.BITEXACT,
    control="turns rendered without the role word (<|im_user|><|im_middle|>...)",
)
def check_chat_render(ctx: CheckContext) -> Trial:
    return _chat_trial(
        RENDER_CONVERSATIONS, lambda tok, m, gen: _segment_ids(tok, m, gen, drop_role_word=True),
        "reference: the SPEC §7 turn format assembled from pinned ids; candidates: encode_chat and the rendered "
        "string encoded with specials only at marker offsets")


@register_check(
    id="tokenizer.chat.user_text_plain", component="tokenizer", level="module", kind=Kind.BITEXACT,
    control="chat text runs encoded with allow_special=True, so a user typing markers injects them",
)
def check_chat_user_text_plain(ctx: CheckContext) -> Trial:
    return _chat_trial(
        INJECTION_CONVERSATIONS, lambda tok, m, gen: _segment_ids(tok, m, gen, allow_special_in_text=True),
        "content, content parts and names spelling [EOS], [BOS], [EOT], chat markers and a reserved token")


def _reference_pieces(text: str) -> list[int]:
    """Piece lengths by SPEC §7, char by char: a cut every SPEC_CALL_CHARS chars, and inside a whitespace or
    non-whitespace run each time it would exceed SPEC_RUN_CHARS."""
    lengths: list[int] = []
    for start in range(0, len(text), SPEC_CALL_CHARS):
        piece = run = 0
        run_is_space: bool | None = None
        for ch in text[start : start + SPEC_CALL_CHARS]:
            is_space = ch.isspace()
            if is_space != run_is_space:
                run_is_space, run = is_space, 0
            if run == SPEC_RUN_CHARS:
                lengths.append(piece)
                piece = run = 0
            piece += 1
            run += 1
        lengths.append(piece)
    return lengths


def _unsplit(tok: KimiTokenizer, text: str) -> list[int]:
    """The fault: the whole text handed to tiktoken at once; a panic (pyo3 PanicException is a BaseException)
    is recorded as the single id -1 so the control fails instead of erroring."""
    try:
        return tok.encoding.encode_ordinary(text)
    except BaseException as exc:  # tiktoken's Rust panic derives from BaseException, not Exception
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return [-1]


@register_check(
    id="tokenizer.encode.long_runs", component="tokenizer", level="module", kind=Kind.BITEXACT,
    control="no long-input split: the whole text goes to tiktoken as one piece",
)
def check_encode_long_runs(ctx: CheckContext) -> Trial:
    tok = default_tokenizer()
    reference: dict[str, torch.Tensor] = {}
    candidate: dict[str, torch.Tensor] = {}
    control: dict[str, torch.Tensor] = {}
    for name, (text, runs) in LONG_RUNS.items():
        reference[f"ids:{name}"] = _ids(_expand(runs))
        candidate[f"ids:{name}"] = _ids(tok.encode(text))
        control[f"ids:{name}"] = _ids(_unsplit(tok, text))
        reference[f"pieces:{name}"] = _ids(_reference_pieces(text))
        candidate[f"pieces:{name}"] = _ids([len(p) for p in split_for_encoding(text)])
        control[f"pieces:{name}"] = _ids([len(text)])
    reference["pieces:call_cap"] = _ids(_reference_pieces(CALL_CAP_TEXT))
    candidate["pieces:call_cap"] = _ids([len(p) for p in split_for_encoding(CALL_CAP_TEXT)])
    control["pieces:call_cap"] = _ids([len(CALL_CAP_TEXT)])
    return Trial(reference=reference, candidate=candidate, control=control,
                 notes=[f"runs of {', '.join(f'{n}={len(t)}' for n, (t, _) in LONG_RUNS.items())} chars; "
                        f"per-call cap on {len(CALL_CAP_TEXT)} chars of short runs"])


def _stream(tok: KimiTokenizer, ids: Sequence[int], skip_special: bool) -> tuple[str, list[int]]:
    decoder = IncrementalDecoder(tok, skip_special=skip_special)
    chunks = [decoder.push(i) for i in ids]
    tail = decoder.finish()
    return "".join(chunks) + tail, [len(c) for c in chunks]


@register_check(
    id="tokenizer.stream.incremental", component="tokenizer", level="module", kind=Kind.BITEXACT,
    control="a streaming decoder that emits special tokens' names even when asked to skip them",
)
def check_stream_incremental(ctx: CheckContext) -> Trial:
    tok = default_tokenizer()
    reference: dict[str, torch.Tensor] = {}
    candidate: dict[str, torch.Tensor] = {}
    control: dict[str, torch.Tensor] = {}
    for name, (ids, skip, text, chunk_chars) in STREAM_CASES.items():
        streamed, chunks = _stream(tok, ids, skip)
        wrong, wrong_chunks = _stream(tok, ids, skip_special=False)
        reference[f"stream:{name}"] = _utf8(text)
        candidate[f"stream:{name}"] = _utf8(streamed)
        control[f"stream:{name}"] = _utf8(wrong)
        reference[f"chunks:{name}"] = _ids(chunk_chars)
        candidate[f"chunks:{name}"] = _ids(chunks)
        control[f"chunks:{name}"] = _ids(wrong_chunks)
        reference[f"decode:{name}"] = _utf8(text)
        candidate[f"decode:{name}"] = _utf8(tok.decode(ids, skip_special=skip))
        control[f"decode:{name}"] = candidate[f"decode:{name}"]
    return Trial(reference=reference, candidate=candidate, control=control,
                 notes=["streamed text (pushes + finish) and decode() vs literal text; chunks: characters "
                        "emitted per push (a partial UTF-8 character is held back, then emitted at once)"])
