"""`k3verify serve` names the HTTP implementation uvicorn will run, and says what the slower one costs: uvicorn
itself falls back to asyncio / h11 silently when uvloop / httptools are missing."""

from __future__ import annotations

import importlib.util

import pytest

from k3verify.api import thread


def test_the_fast_implementation_is_named_plainly() -> None:
    if thread.server_impl() != thread.FAST_IMPL:
        pytest.skip(f"this environment runs {thread.server_impl()}")
    assert thread.describe_server_impl() == f"HTTP server {thread.FAST_IMPL}"


def test_a_missing_uvloop_or_httptools_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a))
    line = thread.describe_server_impl()
    assert line.startswith("HTTP server asyncio+") and "k3verify[serve]" in line
