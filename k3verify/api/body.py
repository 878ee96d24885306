"""Reading a request body under limits enforced while reading: JSON only (415 for any other Content-Type: a
browser may send a cross-origin `text/plain` POST without asking first, never an `application/json` one), at most
MAX_BODY_BYTES (413 as soon as the declared length or the bytes received pass it, never buffering more), at most
MAX_JSON_DEPTH levels of nesting (400; Python's json would otherwise recurse into a RecursionError), strict JSON
(no NaN or Infinity), and text without lone UTF-16 surrogates (which no tokenizer can encode).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import torch
from fastapi import Request

from k3verify.api.errors import APIError

MAX_BODY_BYTES = 8 << 20
MAX_JSON_DEPTH = 32  # a chat body nests 5 deep
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


JSON_MEDIA_TYPE = "application/json"


def _too_large(size: int | None) -> APIError:
    """413 naming the limit; `size` is None for a body sent without a Content-Length (chunked), read only until it
    passed the limit: how long it would have been is unknown, and a partial count would mislead."""
    if size is None:
        return APIError(413, f"the request body exceeds the limit of {MAX_BODY_BYTES} bytes (it was sent in chunks "
                             "without a Content-Length; reading stopped once it passed the limit)")
    return APIError(413, f"the request body of {size} bytes exceeds the limit of {MAX_BODY_BYTES} bytes")


def check_json_content_type(value: str | None) -> None:
    """415 unless the Content-Type is application/json, bare or with charset=utf-8 (JSON is UTF-8: RFC 8259)."""
    media, *params = [part.strip() for part in (value or "").split(";")]
    charset_only = all(p.lower().replace(" ", "") in ("charset=utf-8", 'charset="utf-8"') for p in params)
    if media.lower() != JSON_MEDIA_TYPE or not charset_only:
        got = "no Content-Type" if value is None else f"Content-Type {value[:80]!r}"
        raise APIError(415, f"request bodies must be JSON, sent as Content-Type: {JSON_MEDIA_TYPE} (optionally with "
                            f"charset=utf-8); got {got}", code="unsupported_media_type")


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 as soon as the declared length or the bytes read pass MAX_BODY_BYTES
    (never buffering more than the limit)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, f"invalid Content-Length header: {declared[:40]!r}")
        if int(declared) > MAX_BODY_BYTES:
            raise _too_large(int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large(None)  # more than declared cannot reach us: the HTTP layer cuts the body there
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings do not count)."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = torch.frombuffer(bytearray(brackets), dtype=torch.uint8)
    steps = ((codes == ord("[")) | (codes == ord("{"))).to(torch.int32) * 2 - 1  # only brackets are left
    return int(steps.cumsum(0).max())


def check_json_depth(raw: bytes) -> None:
    """400 for a body nested deeper than MAX_JSON_DEPTH; a body with fewer opening brackets needs no scan."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the JSON body nests {depth} levels deep; the limit is {MAX_JSON_DEPTH}")


def parse_body(raw: bytes) -> Any:
    """The JSON value of a request body: 413 over MAX_BODY_BYTES, 400 nested deeper than MAX_JSON_DEPTH, 400 when
    it is not JSON (NaN and Infinity included, which Python's json would otherwise accept)."""
    if len(raw) > MAX_BODY_BYTES:
        raise _too_large(len(raw))
    check_json_depth(raw)

    def reject_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(raw, parse_constant=reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}") from None
    if b"\\u" in raw:  # only a \u escape can smuggle a lone UTF-16 surrogate, which no tokenizer can encode
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(400, f"the JSON body holds a lone UTF-16 surrogate ({exc.object[exc.start]!r}), "
                                "which is not text") from None
    return data


async def read_json(request: Request) -> Any:
    """The Content-Type checked, then read_body and parse_body; a large body is parsed off the event loop (the
    depth scan and json.loads of 8 MiB take a fraction of a second that other clients must not wait for)."""
    check_json_content_type(request.headers.get("content-type"))
    raw = await read_body(request)
    return parse_body(raw) if len(raw) < (64 << 10) else await asyncio.to_thread(parse_body, raw)
