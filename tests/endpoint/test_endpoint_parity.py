"""`k3verify parity --endpoint`: green against our own server (k3-tiny, kl-tiny, fp32), red against faulty ones with
the check and position named, and skipped-with-reason where a stub lacks a feature."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from endpoint_fakes import WrongTokenAt, proxy_app

import k3verify
from k3verify.api.thread import ServerThread
from k3verify.cli import main
from k3verify.endpoint.local import serve_locally
from k3verify.gates.core.binding import source_digest
from k3verify.gates.report.json_report import load_report
from k3verify.gates.trust.lookup import GateWant, lookup_report
from k3verify.target import resolve_target

ENDPOINT_CHECKS = {"endpoint.greedy.tokens", "endpoint.logprobs.topk", "endpoint.logprobs.prompt",
                   "endpoint.chat.template", "endpoint.stop.strings", "endpoint.stop.eos",
                   "endpoint.stream.identity", "endpoint.batch.invariance", "endpoint.repeat.identity",
                   "endpoint.prefix.reuse"}


def parity(report: Path, *args: str, preset: str = "k3-tiny") -> tuple[int, dict[str, Any]]:
    code = main(["parity", "--preset", preset, "--dtype", "float32", "--report-dir", str(report), *args])
    return code, load_report(report)


def by_id(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in data["results"]}


@contextmanager
def served(preset: str = "k3-tiny", **kw: Any) -> Iterator[str]:
    with serve_locally(resolve_target(preset), torch.float32, torch.device("cpu"), **kw) as url:
        yield url


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_endpoint_parity_is_green_against_our_server(preset: str, tmp_path: Path) -> None:
    """Every endpoint check passes against `k3verify serve`'s engine in fp32, each control fails, the report says
    which server answered, and such a report never opens the serve gate."""
    code, data = parity(tmp_path, "--endpoint", "self", preset=preset)
    results = by_id(data)
    assert code == 0 and set(results) == ENDPOINT_CHECKS
    for r in results.values():
        assert r["status"] == "pass" and r["control"]["status"] == "fail", (r["id"], r["reason"])
    endpoint = data["run"]["endpoint"]
    assert endpoint["model"] == preset and endpoint["declared_dtype"] == "float32"
    assert endpoint["server"]["models"][0]["id"] == preset and endpoint["server"]["headers"]["server"] == "uvicorn"
    caps = endpoint["capabilities"]
    assert all(f["available"] for name, f in caps.items() if isinstance(f, dict) and name != "native_ids")
    assert not caps["native_ids"]["available"], "llama.cpp's native /completion is not ours"
    assert caps["logprob_form"] == "legacy+token_id" and caps["tokenize_field"] == "prompt"
    sent = endpoint["requests"]["sent"]  # two 404s: the probes of llama.cpp's GET /props and native /completion
    assert 0 < sent <= 400 and endpoint["requests"]["by_status"] == {"200": sent - 2, "404": 2}
    for check in ("endpoint.logprobs.topk", "endpoint.logprobs.prompt"):  # held to fp32 noise, controls far out
        r = results[check]
        assert r["bar"] < 1e-3 and r["control"]["metric"] >= 10 * r["bar"], (check, r["bar"], r["control"])
    want = GateWant(resolve_target(preset).digest, k3verify.__version__, "cpu", "float32", source_digest(), preset)
    gate = lookup_report(tmp_path, want)
    assert gate.passing is None and "--endpoint" in gate.reason


def test_wrong_token_at_one_step_fails_naming_check_and_position(tmp_path: Path) -> None:
    """A server whose model picks the runner-up token at decode step 3 fails endpoint.greedy.tokens at position 3
    of every prompt (and its logprobs there fail endpoint.logprobs.topk)."""
    with served(wrap_runner=lambda runner: WrongTokenAt(runner, step=3)) as url:
        code, data = parity(tmp_path, "--endpoint", url, "--only", "endpoint.greedy.tokens",
                            "--only", "endpoint.logprobs.topk")
    results = by_id(data)
    greedy = results["endpoint.greedy.tokens"]
    assert code == 1 and greedy["status"] == "fail" and greedy["control"]["status"] == "fail"
    named = [n for n in greedy["notes"] if "where the oracle's greedy token is" in n]
    assert named and all(" position 3:" in n for n in named), named
    assert {n.split(" position")[0] for n in named} == {"prompt 0", "prompt 1", "prompt 2"}
    topk = results["endpoint.logprobs.topk"]
    assert topk["status"] == "fail" and any("largest deviation at prompt" in n and "position 3:" in n
                                            for n in topk["notes"]), topk["notes"]


def shift_prompt_logprob(path: str, request: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """Perturb one echoed prompt logprob (position 5) by 0.01 nats."""
    if path == "v1/completions" and request.get("echo"):
        values = answer["choices"][0]["logprobs"]["token_logprobs"]
        values[5] += 0.01
    return answer


def test_proxy_perturbing_one_prompt_logprob_fails_naming_it(tmp_path: Path) -> None:
    """0.01 nats on one prompt position is far outside fp32 noise: endpoint.logprobs.prompt fails and names it."""
    with served() as url, ServerThread(proxy_app(url, perturb=shift_prompt_logprob)) as proxy:
        code, data = parity(tmp_path, "--endpoint", proxy.url, "--only", "endpoint.logprobs.prompt")
    result = by_id(data)["endpoint.logprobs.prompt"]
    assert code == 1 and result["status"] == "fail"
    assert any("largest deviation at scored prompt 0 position 5:" in n for n in result["notes"]), result["notes"]


def refuse_echo_and_tokenize(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    if path == "v1/completions" and body.get("echo"):
        return 400, {"object": "error", "message": "echo is not supported", "type": "BadRequestError",
                     "param": None, "code": 400}
    if path in ("tokenize", "v1/tokenize"):
        return 404, {"detail": "Not Found"}
    return None


def test_stub_without_prompt_logprobs_skips_those_checks_with_reason(tmp_path: Path) -> None:
    """No echo, no tokenize endpoint: prompt logprobs are skipped with the server's answer as the reason, the chat
    check falls back to prompt-token counts; nothing fails, and with neither greedy tokens nor a logprobs check run
    the verdict is inconclusive, not pass."""
    with served() as url, ServerThread(proxy_app(url, refuse=refuse_echo_and_tokenize)) as proxy:
        code, data = parity(tmp_path, "--endpoint", proxy.url, "--only", "endpoint.logprobs.prompt",
                            "--only", "endpoint.chat.template")
    results = by_id(data)
    assert code == 4 and data["summary"]["verdict"] == "inconclusive"
    assert data["summary"]["missing_evidence"] == [
        "endpoint: endpoint.greedy.tokens was not selected",
        "endpoint: endpoint.logprobs.* did not run (endpoint.logprobs.prompt: " + results[
            "endpoint.logprobs.prompt"]["reason"] + ")"]
    prompt = results["endpoint.logprobs.prompt"]
    assert prompt["status"] == "skipped" and "echo is not supported" in prompt["reason"]
    chat = results["endpoint.chat.template"]
    assert chat["status"] == "pass" and any("prompt token counts only" in n for n in chat["notes"])
    assert not any(k.endswith(".ids") for k in chat["per_key"])
    capabilities = data["run"]["endpoint"]["capabilities"]
    assert not capabilities["echo_logprobs"]["available"] and not capabilities["tokenize"]["available"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--only", "endpoint.greedy.tokens"], "need --endpoint"),
    (["--dtype", "float16"], "--dtype float16 applies to --endpoint runs only"),
    (["--endpoint", "http://127.0.0.1:9", "--timeout", "2"], "--endpoint http://127.0.0.1:9"),
    (["--endpoint", "ftp://x"], "must start with http"),
])
def test_endpoint_usage_errors_exit_2(argv: list[str], message: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Endpoint checks without an endpoint, endpoint flags without one, an unreachable or malformed URL: exit 2."""
    assert main(["parity", "--report-dir", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def strip_logprobs(path: str, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    for choice in answer.get("choices") or []:
        choice.pop("logprobs", None)
    return answer


def test_server_without_logprobs_is_inconclusive_never_pass(tmp_path: Path) -> None:
    """A server that answers but never returns logprobs offers nothing to compare: every output check skips with
    the probe's reason, and the verdict is INCONCLUSIVE (exit 4), naming the evidence that did not run."""
    with served() as url, ServerThread(proxy_app(url, perturb=strip_logprobs)) as proxy:
        code, data = parity(tmp_path, "--endpoint", proxy.url)
    results = by_id(data)
    assert code == 4 and data["summary"]["verdict"] == "inconclusive"
    assert results["endpoint.greedy.tokens"]["status"] == "skipped"
    assert "completions answered without logprobs" in results["endpoint.greedy.tokens"]["reason"]
    assert not any(r["status"] in ("fail", "vacuous", "error") for r in results.values())
    missing = data["summary"]["missing_evidence"]
    assert any(m.startswith("endpoint: endpoint.greedy.tokens did not run") for m in missing)
    junit = (tmp_path / "junit.xml").read_text()
    assert 'name="verdict.evidence"' in junit


def answer_repeats_differently(path: str, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """A proxy that, like a server restoring the wrong cached state, changes the first token of every second answer
    to the same short prompt."""
    key = (path, tuple(body.get("prompt") or ()))
    SEEN[key] = SEEN.get(key, 0) + 1
    if SEEN[key] % 2 == 0 and path == "v1/completions" and len(body.get("prompt") or ()) == 3:
        logprobs = answer["choices"][0].get("logprobs")
        if logprobs and logprobs.get("tokens"):
            first = logprobs["tokens"][0]
            other = next(t for t in (logprobs.get("top_logprobs") or [{}])[0] or {} if t != first)
            logprobs["tokens"][0] = other
    return answer


SEEN: dict[Any, int] = {}


def test_a_repeat_answered_from_a_wrong_cached_state_fails(tmp_path: Path) -> None:
    """The same greedy request sent twice: an answer that changes on the repeat (the first token replaced by a
    runner-up, as a prompt cache restoring the wrong state does) fails endpoint.repeat.identity, naming the prompt."""
    SEEN.clear()
    with served() as url, ServerThread(proxy_app(url, perturb=answer_repeats_differently)) as proxy:
        code, data = parity(tmp_path, "--endpoint", proxy.url, "--only", "endpoint.repeat.identity")
    result = by_id(data)["endpoint.repeat.identity"]
    assert code == 1 and result["status"] == "fail" and result["control"]["status"] == "fail"
    assert any("prompt 0 (3 tokens): the repeat answers" in n for n in result["notes"]), result["notes"]
