"""Fixtures for the server tests: one real k3-tiny server per module, on 127.0.0.1 at a free port."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server_harness import RunningServer, running_server  # noqa: E402


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[RunningServer]:
    with running_server(debug=True) as server:
        yield server


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
