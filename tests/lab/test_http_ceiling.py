"""The served bench's clients split over processes (bench/served.run_client_processes), through the real app and
uvicorn against lab/http_ceiling.py's stub engine."""

from __future__ import annotations

from lab.http_ceiling import run


def test_clients_split_over_processes_deliver_every_token() -> None:
    """5 clients, 2 per process: 3 client processes started together; every streamed token arrives, each request
    is attributed to its client, and the rate cannot exceed what the stub engine emits."""
    row = run(concurrency=5, step_ms=2.0, per_process=2, waves=2, new_tokens=8)
    assert row["client_processes"] == 3
    assert row["warm_up_requests"] == 5, "each client's connection is opened and warmed before the timed requests"
    assert row["tokens"] == 5 * 2 * 8
    assert 0 < row["tok_s"] <= row["engine_rate"] * 1.05, row


def test_one_process_for_few_clients() -> None:
    row = run(concurrency=2, step_ms=2.0, per_process=16, waves=1, new_tokens=4)
    assert row["client_processes"] == 1 and row["tokens"] == 8
