"""Fixtures for the server tests: one real k3-tiny server per module and layout, on 127.0.0.1 at a free port."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server_harness import RunningServer, running_server  # noqa: E402


@pytest.fixture(scope="module", params=["in_process", "api_process"])
def tiny_server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """Every test of the shared server runs twice: the app in the engine's process, and in a process of its own
    linked to it (api/engine_link.py, what `serve` runs by default)."""
    with running_server(debug=True, api_process=request.param == "api_process") as server:
        yield server


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
