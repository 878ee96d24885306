"""A smaller run of tools/load_test.py: concurrent streaming clients with malformed requests and hang-ups."""

from __future__ import annotations

import asyncio

import pytest
from server_harness import TINY, RecordingRunner, make_tiny_runner, running_server

from tools import load_test


def run(clients: int, requests_per_client: int) -> None:
    runner = RecordingRunner(make_tiny_runner(num_slots=16, num_pages=96))  # 1520 tokens: requests must queue
    with running_server(runner) as server:
        result = asyncio.run(load_test.run_load(server.url, model=TINY, clients=clients,
                                                requests_per_client=requests_per_client, seed=1, timeout_s=240))
        print(result.summary())
        runner.assert_empty()
    assert not result.failures, result.failures[:10]
    assert result.completed + result.malformed + result.disconnected == result.requests
    assert result.completed >= result.requests // 2 and result.malformed > 0 and result.disconnected > 0
    assert runner.max_batch_seen > 1


def test_load_16_clients() -> None:
    """16 streaming clients × 4 requests: every well-formed one completes, malformed → 400, no 5xx, caches freed."""
    run(16, 4)


@pytest.mark.slow
def test_load_64_clients() -> None:
    """The full 64-client run of the script."""
    run(64, 4)
