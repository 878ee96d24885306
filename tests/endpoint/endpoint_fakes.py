"""Faulty servers for the endpoint checks: a runner that picks a wrong token at one decode step, and an HTTP
proxy in front of a real server that can refuse requests or perturb answers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response


class WrongTokenAt:
    """Proxy over a ModelRunner: at the `step`-th decode of every sequence, the token after the argmax wins by 1."""

    def __init__(self, runner: Any, step: int) -> None:
        self.runner, self.step = runner, step
        self.decodes: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def decode(self, seqs: list[tuple[int, int]], *args: Any, **kw: Any) -> torch.Tensor:
        return self._runner_up_at_step([sid for sid, _ in seqs], self.runner.decode(seqs, *args, **kw).clone())

    def decode_next(self, seq_ids: list[int], *args: Any, **kw: Any) -> torch.Tensor:
        """The engine's decode (each sequence fed the token stored for it on the device)."""
        return self._runner_up_at_step(seq_ids, self.runner.decode_next(seq_ids, *args, **kw).clone())

    def _runner_up_at_step(self, seq_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for row, seq_id in enumerate(seq_ids):
            self.decodes[seq_id] = self.decodes.get(seq_id, 0) + 1
            if self.decodes[seq_id] == self.step:
                top = int(logits[row].argmax())
                logits[row, (top + 1) % logits.shape[-1]] = logits[row, top] + 1.0
        return logits


Refuse = Callable[[str, dict[str, Any]], tuple[int, dict[str, Any]] | None]
Perturb = Callable[[str, dict[str, Any], dict[str, Any]], dict[str, Any]]


def proxy_app(upstream: str, *, refuse: Refuse | None = None, perturb: Perturb | None = None) -> FastAPI:
    """Forwards everything to `upstream`; `refuse(path, body)` may answer instead (status, JSON), `perturb(path,
    request body, answer)` may rewrite a JSON answer."""
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw) if raw else {}
        if refuse is not None and (refused := refuse(path, body)) is not None:
            return JSONResponse(refused[1], status_code=refused[0])
        async with httpx.AsyncClient(base_url=upstream, timeout=120) as client:
            resp = await client.request(request.method, f"/{path}", content=raw,
                                        headers={"content-type": "application/json"} if raw else {})
        kind = resp.headers.get("content-type", "")
        if perturb is not None and kind.startswith("application/json") and resp.status_code == 200:
            return JSONResponse(perturb(path, body, resp.json()), status_code=200)
        return Response(resp.content, status_code=resp.status_code, media_type=kind or None)

    return app
