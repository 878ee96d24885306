"""Hostile OpenAI-compatible servers on 127.0.0.1, one behaviour each, with no model behind them: canned answers of
a fixed form (legacy completions logprobs with `token_id:N` tokens), so that `parity --endpoint` gets through its
probe and its checks run against whatever the behaviour breaks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOP = 5  # alternatives listed per position (the checks ask for 5)
NOT_FOUND = {"error": {"message": "not found", "type": "not_found"}}


def canned_completion(body: dict[str, Any], value: float = -1.0, *, logprobs: bool = True) -> dict[str, Any]:
    """max_tokens token ids derived from the prompt, each listed with TOP alternatives (`value`, value - 1, ...)."""
    prompt = [int(t) for t in body.get("prompt") or [1]]
    ids = [(sum(prompt) + 7 * i) % 97 + 3 for i in range(int(body.get("max_tokens") or 1))]
    choice: dict[str, Any] = {"index": 0, "text": "", "finish_reason": "length"}
    if logprobs:
        choice["logprobs"] = {
            "tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [value for _ in ids],
            "top_logprobs": [{f"token_id:{(t + j) % 97 + 3}" if j else f"token_id:{t}": value - j for j in range(TOP)}
                             for t in ids],
            "text_offset": [0 for _ in ids]}
    return {"id": "cmpl-0", "object": "text_completion", "model": "hostile", "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt)
                      + len(ids)}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HostileServer

    def log_message(self, *args: Any) -> None:  # quiet: the test's output names what matters
        return

    def do_GET(self) -> None:
        self.server.answer(self, None)

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.server.answer(self, json.loads(self.rfile.read(length) or b"{}"))

    def send_json(self, status: int, data: Any, *, headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(data).encode()  # NaN and Infinity go out as the bare literals some servers emit
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(raw)


class HostileServer(ThreadingHTTPServer):
    """Answers /v1/models and /v1/completions as `behaviour` says; everything else 404."""

    daemon_threads = True

    def __init__(self, behaviour: str) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.behaviour = behaviour
        self.completions = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, h: Handler, body: dict[str, Any] | None) -> None:
        path, b = h.path.partition("?")[0], self.behaviour
        try:
            if path == "/v1/models":
                self._models(h, b)
            elif path == "/v1/completions" and body is not None:
                self._completion(h, b, body)
            else:
                h.send_json(404, NOT_FOUND)
        except (BrokenPipeError, ConnectionResetError):
            return  # the client gave up, as it should

    def _models(self, h: Handler, b: str) -> None:
        models = {"object": "list", "data": [{"id": "hostile", "object": "model"}]}
        if b == "trickle":  # one byte every 0.2 s, forever (a server that never finishes its answer)
            h.send_response(200)
            h.send_header("content-length", "1000000")
            h.end_headers()
            while True:
                h.wfile.write(b" ")
                h.wfile.flush()
                time.sleep(0.2)
        elif b == "huge_declared":  # 100 MB declared up front
            h.send_response(200)
            h.send_header("content-length", str(100 * 1024 * 1024))
            h.end_headers()
            for _ in range(100 * 1024):
                h.wfile.write(b"\0" * 1024)
        elif b == "huge_undeclared":  # no length: bytes until the client stops reading
            h.send_response(200)
            h.send_header("connection", "close")
            h.end_headers()
            h.close_connection = True
            while True:
                h.wfile.write(b"[" * 65536)
        elif b == "redirect":
            h.send_response(307)
            h.send_header("location", "http://evil.example/v1/models")
            h.send_header("content-length", "0")
            h.end_headers()
        elif b == "wrong_models":
            h.send_json(200, {"object": "list", "data": 5})
        else:
            h.send_json(200, models)

    def _completion(self, h: Handler, b: str, body: dict[str, Any]) -> None:
        if body.get("echo") or body.get("logit_bias"):
            h.send_json(400, {"error": {"message": "not supported here", "type": "invalid_request_error"}})
            return
        with self.lock:
            self.completions += 1
            n = self.completions
        if b == "nan":
            h.send_json(200, canned_completion(body, float("nan")))
        elif b == "wrong_logprobs":
            answer = canned_completion(body)
            answer["choices"][0]["logprobs"] = {"content": [5]}
            h.send_json(200, answer)
        elif b == "no_logprobs":
            h.send_json(200, canned_completion(body, logprobs=False))
        elif b == "500_then_200" and n == 3:  # the probe sends two completions; the third is a check's
            h.send_json(500, {"error": {"message": "upstream overloaded", "type": "server_error"}})
        elif b == "endless_stream" and body.get("stream"):
            h.send_response(200)
            h.send_header("content-type", "text/event-stream")
            h.send_header("connection", "close")
            h.end_headers()
            h.close_connection = True
            event = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x", "finish_reason": None}]}).encode()
            while True:
                h.wfile.write(event + b"\n\n")
        else:
            h.send_json(200, canned_completion(body))


@contextmanager
def hostile(behaviour: str) -> Iterator[HostileServer]:
    server = HostileServer(behaviour)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
