"""Serving across a gloo world of 2 on this host: rank 0 (this process) runs the runner / engine / HTTP server,
rank 1 (spawned) replays its calls. Greedy tokens, over the runner and over HTTP, equal the single process's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from k3verify.api.app import create_app
from k3verify.api.thread import ServerThread
from k3verify.commands.serve_parallel import DIST_CHECKS, dist_gate_reason
from k3verify.serving.engine import Engine
from k3verify.serving.parallel.layout import ParallelLayout
from k3verify.serving.parallel.world import ServingWorld, WorldSpec
from k3verify.serving.runner import ModelRunner, build_runner, generate_greedy
from k3verify.target import Target, resolve_target
from k3verify.tokenizer import default_tokenizer

CACHES = {"num_pages": 64, "page_size": 8, "num_slots": 4, "max_context": 256}
PROMPTS = [[5, 17, 300, 42, 9], [1000, 3, 3, 77, 2048, 11, 12, 13, 14]]


@pytest.fixture(scope="module")
def target() -> Target:
    return resolve_target("k3-tiny")


@pytest.fixture(scope="module")
def world(target: Target) -> Iterator[ServingWorld]:
    w = ServingWorld(target.cfg, WorldSpec(str(target.checkpoint_dir), 2, 2, "cpu", CACHES, torch.float32))
    yield w
    w.close()


def single_runner(target: Target) -> ModelRunner:
    return build_runner(target.cfg, target.weights(), dtype=torch.float32, **CACHES)


def test_mirrored_runner_generates_the_single_process_tokens(target: Target, world: ServingWorld) -> None:
    """Packed prefill, paged caches and decode steps, every call replayed on rank 1: same greedy tokens."""
    want = generate_greedy(single_runner(target), PROMPTS, 6)
    assert generate_greedy(world.runner, PROMPTS, 6) == want
    world.runner.check_integrity()
    assert world.runner.active_ids == []


def test_rank_zero_serves_http(target: Target, world: ServingWorld) -> None:
    """The engine and the OpenAI app on rank 0's mirrored runner answer a greedy completion with the tokens
    the single process generates."""
    tok = default_tokenizer()
    want = generate_greedy(single_runner(target), [PROMPTS[1]], 5)[0]
    engine = Engine(world.runner, tok, eos_token_ids=(-1,), vocab_size=target.cfg.vocab_size).start()
    app = create_app(engine, tok, model_name="k3-tiny")
    try:
        with ServerThread(app) as server:
            r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                           json={"model": "k3-tiny", "prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0,
                                 "logprobs": 1})
    finally:
        engine.stop()
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["tokens"]
    names = [tok.token_bytes(t) if t < tok.n_vocab else f"<|unused_{t}|>".encode() for t in want]
    assert got == [n.decode("utf-8", errors="replace") for n in names]


def test_engine_restart_resets_every_rank(target: Target, world: ServingWorld) -> None:
    """Engine faults mid-request: the supervisor's cache reset reaches rank 1 too, so after as many faults as there
    are state slots the next request still runs and generates the single-process tokens (a follower that kept the
    lost sequences would run out of slots, refuse the admission and leave rank 0 alone in the collectives)."""
    tok = default_tokenizer()
    want = generate_greedy(single_runner(target), [PROMPTS[0]], 5)[0]
    engine = Engine(world.runner, tok, eos_token_ids=(-1,), vocab_size=target.cfg.vocab_size).start()
    app = create_app(engine, tok, model_name="k3-tiny")
    body = {"model": "k3-tiny", "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "logprobs": 0}
    try:
        with ServerThread(app) as server:
            failed = []
            for _ in range(CACHES["num_slots"]):
                engine.inject_fault("fault on rank 0")
                failed.append(httpx.post(f"{server.url}/v1/completions", timeout=120, json=body))
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json=body)
    finally:
        engine.stop()
    assert all(f.status_code == 503 and "fault on rank 0" in f.text for f in failed)
    assert engine.status().restarts == CACHES["num_slots"] and r.status_code == 200, r.text
    names = [tok.token_bytes(t) if t < tok.n_vocab else f"<|unused_{t}|>".encode() for t in want]
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [n.decode("utf-8", errors="replace") for n in names]
    world.runner.check_integrity()


def _report(tmp_path: Path, statuses: dict[str, str], tp: int, ep: int) -> Path:
    results = [{"id": i, "status": s, "metrics": {"tp": float(tp), "ep": float(ep)}} for i, s in statuses.items()]
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"results": results}))
    return path


def test_serving_gate_needs_every_dist_check_at_the_layout(tmp_path: Path) -> None:
    layout = ParallelLayout(2, 2)
    ok = _report(tmp_path, {c: "pass" for c in DIST_CHECKS}, 2, 2)
    assert dist_gate_reason(ok, layout) is None
    other = _report(tmp_path, {c: "pass" for c in DIST_CHECKS}, 2, 1)
    assert "the dist.* checks ran at tp=2 ep=1, not tp=2 ep=2" in str(dist_gate_reason(other, layout))
    missing = _report(tmp_path, {c: "pass" for c in DIST_CHECKS[1:]}, 2, 2)
    assert f"{DIST_CHECKS[0]} did not run" in str(dist_gate_reason(missing, layout))
    failed = _report(tmp_path, {**{c: "pass" for c in DIST_CHECKS}, "dist.greedy": "fail"}, 2, 2)
    assert "dist.greedy fail" in str(dist_gate_reason(failed, layout))
