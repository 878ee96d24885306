"""The OpenAI error envelope `{"error": {message, type, param, code}}` and the handlers that answer with it.

Every error, including FastAPI's own validation/404/405 responses and anything unhandled (500), leaves as
this envelope.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error rendered as the OpenAI envelope `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


RETRY_AFTER_S = 5  # an engine restart (its loop: at once; its process: the checkpoint read again) takes seconds


def engine_unavailable(reason: str) -> APIError:
    """503: the engine loop is not running (failed, stalled, stopped, or its process is being restarted)."""
    return APIError(503, reason, type="server_error", code="engine_unavailable")


def error_response(err: APIError) -> JSONResponse:
    """The envelope with its status; a 401 names the scheme, a 503 says when to try again."""
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    if err.status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(err.envelope(), status_code=err.status, headers=headers)


async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(APIError(400, f"invalid request: {exc.errors()[:1]}"))


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(APIError(exc.status_code, message, code=code))


async def on_unhandled_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {str(exc)[:200]}",
                                   type="server_error"))


def install_error_handlers(app: FastAPI) -> None:
    """Route our APIError, FastAPI's request validation, Starlette's HTTP errors and any other exception
    through the envelope."""
    app.exception_handler(APIError)(on_api_error)
    app.exception_handler(RequestValidationError)(on_validation_error)
    app.exception_handler(StarletteHTTPException)(on_http_error)
    app.exception_handler(Exception)(on_unhandled_error)
