"""`serve --speculative ngram` is visible to an operator: /metrics counts score passes, drafted and accepted
tokens, per-request auto-off and cost-policy declines; an engine without a speculator exports none of them."""

from __future__ import annotations

import re
from typing import Any

import httpx
from server_harness import make_tiny_runner, running_server

from k3verify.api.metrics import SPECULATION_COUNTERS
from k3verify.cli import build_parser
from k3verify.commands.serve_engine import _speculator
from k3verify.commands.serve_options import ServeOptions
from k3verify.serving.runner import generate_greedy
from k3verify.serving.spec.drafter import ControlledDrafter
from k3verify.serving.spec.step import SpeculativeStep

K = 4

PROMPT = list(range(100, 4600, 23))  # 196 distinct ids: some of the generated ones recur, so n-grams draft
NEW = 40


def _counters(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(k3v_spec_\w+_total) (\S+)$", text, re.M)}


def _serve_flags() -> ServeOptions:
    """What `serve --speculative ngram` parses into, with its defaults (cost policy and auto-off on)."""
    return ServeOptions.from_args(build_parser().parse_args(["serve", "--speculative", "ngram", "--num-draft", str(K),
                                                             "--max-batch", "8"]))


def _served_counters(runner: Any, speculator: SpeculativeStep | None) -> dict[str, float]:
    """One greedy completion of PROMPT through the API process (as `serve` runs it), then the metrics page."""
    with running_server(runner, api_process=True, speculator=speculator) as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": server.model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0})
        assert r.status_code == 200, r.text
        return _counters(httpx.get(f"{server.url}/metrics", timeout=10).text)


def test_served_speculation_counts_drafted_and_accepted_tokens_on_metrics() -> None:
    """serve's own n-gram speculator shows every counter, with score passes and drafted tokens; the same served
    step with drafts that follow the model (ControlledDrafter: its greedy text) counts every draft accepted. The
    n-gram drafter on random weights is almost never right
    (serving/spec/drafter.py), hence the second run for acceptance."""
    runner = make_tiny_runner()
    ngram = _served_counters(runner, _speculator(_serve_flags(), runner))
    assert set(ngram) == {f"{name}_total" for name in SPECULATION_COUNTERS}
    assert ngram["k3v_spec_verify_steps_total"] > 0 and ngram["k3v_spec_drafted_tokens_total"] > 0, ngram

    runner = make_tiny_runner()
    plain = generate_greedy(make_tiny_runner(), [PROMPT], NEW)[0]
    step = _speculator(_serve_flags(), runner)
    assert step is not None
    step.drafter = ControlledDrafter(K, {1: PROMPT + plain}, 0.0, 4608)  # the engine's first seq id is 1
    c = _served_counters(runner, step)
    assert c["k3v_spec_drafted_tokens_total"] == c["k3v_spec_accepted_tokens_total"] > 0, c
    assert c["k3v_spec_emitted_tokens_total"] > c["k3v_spec_accepted_tokens_total"]


def test_plain_serving_exports_no_speculation_counters() -> None:
    """Without --speculative the page has no k3v_spec_* series (an operator can tell speculation is off)."""
    with running_server(api_process=True) as server:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "k3v_time_to_first_token_seconds" in text and not _counters(text)
