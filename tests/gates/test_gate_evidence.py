"""The evidence rule: a run whose model-comparing checks did not run is INCONCLUSIVE, never PASS, in every format."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from k3verify.commands.parity import EXIT_CODES
from k3verify.gates import CheckContext, Kind, Registry, SkipCheck, Trial
from k3verify.gates.core.binding import recompute_summary, summary_problem
from k3verify.gates.core.evidence import MIN_ENDPOINT_POSITIONS, missing_evidence
from k3verify.gates.core.suite import RunResult
from k3verify.gates.report.console import verdict_line
from k3verify.gates.report.json_report import load_report, write_reports

RunFactory = Callable[..., RunResult]  # the run_checks fixture (conftest.py)


def _r(check_id: str, status: str = "pass", reason: str | None = None, **metrics: float) -> dict[str, Any]:
    return {"id": check_id, "status": status, "reason": reason, "metrics": metrics}


ENDPOINT_OK = [_r("endpoint.greedy.tokens", positions=24), _r("endpoint.logprobs.topk"),
               _r("endpoint.chat.template")]


@pytest.mark.parametrize(("results", "needle"), [
    ([_r("endpoint.chat.template"), _r("endpoint.greedy.tokens", "skipped", "no token ids"),
      _r("endpoint.logprobs.topk", "skipped", "no token ids")], "endpoint: endpoint.greedy.tokens did not run"),
    ([_r("endpoint.greedy.tokens", positions=MIN_ENDPOINT_POSITIONS - 1), _r("endpoint.logprobs.topk")],
     f"fewer than the {MIN_ENDPOINT_POSITIONS}"),
    ([_r("endpoint.greedy.tokens", positions=24), _r("endpoint.logprobs.topk", "skipped", "no top_logprobs")],
     "endpoint.logprobs.* did not run (endpoint.logprobs.topk: no top_logprobs)"),
    ([_r("model.logits.fp32", "skipped", "checkpoint too large"), _r("kda.module.fp32")],
     "model: model.logits.*"),
    ([_r("kda.module.fp32"), _r("dist.weights.slices"), _r("dist.greedy", "skipped", "one process")],
     "parallel: dist.*logits or dist.greedy"),
    ([_r("kda.module.fp32", "skipped", "cuda only")], "no check ran"),
    ([], "no check ran"),
])
def test_runs_without_model_evidence_name_what_is_missing(results: list[dict[str, Any]], needle: str) -> None:
    """Each family in play needs its evidence; the reason names the family and the checks."""
    reasons = missing_evidence(results)
    assert any(needle in r for r in reasons), reasons


def test_runs_with_evidence_miss_nothing() -> None:
    """Evidence present in every family in play: nothing missing; module-only runs need no whole-model check."""
    assert missing_evidence(ENDPOINT_OK) == []
    assert missing_evidence([_r("model.logits.fp32"), _r("served.vs_gold", "skipped", "no gold"),
                             _r("dist.tp.logits"), _r("dist.greedy", "skipped", "x")]) == []
    assert missing_evidence([_r("kda.module.fp32"), _r("mla.module.fp32", "skipped", "x")]) == []


def _report(results: list[dict[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {"results": results, "summary": {}}
    data["summary"] = recompute_summary(data)
    return data


def test_inconclusive_verdict_is_recomputed_and_cannot_be_edited_to_pass() -> None:
    """The verdict follows from the results: an all-skipped endpoint run is inconclusive, and a summary edited to
    pass (missing evidence dropped) contradicts its own results."""
    data = _report([_r("endpoint.chat.template"), _r("endpoint.greedy.tokens", "skipped", "no ids")])
    assert data["summary"]["verdict"] == "inconclusive" and data["summary"]["missing_evidence"]
    assert summary_problem(data) is None
    forged = json.loads(json.dumps(data))
    forged["summary"]["verdict"] = "pass"
    del forged["summary"]["missing_evidence"]
    assert "contradicts its results" in str(summary_problem(forged))
    red = _report([_r("endpoint.chat.template", "fail"), _r("endpoint.greedy.tokens", "skipped", "no ids")])
    assert red["summary"]["verdict"] == "fail"  # red wins over inconclusive


def test_inconclusive_run_fails_junit_and_says_why_in_html_and_exit_code(registry: Registry, run_checks: RunFactory,
                                                                       tmp_path: Path) -> None:
    """A run whose endpoint checks pass or skip but never compared outputs: JUnit gets a failing verdict.evidence
    testcase, the HTML banner and the console's verdict line give the reasons, parity's exit code is its own."""

    @registry.register_check(id="endpoint.t.protocol", component="endpoint", level="serving", kind=Kind.BITEXACT,
                             control="ids shifted")
    def protocol(ctx: CheckContext) -> Trial:
        r = torch.arange(4)
        return Trial(reference=r, candidate=r.clone(), control=r + 1)

    @registry.register_check(id="endpoint.greedy.tokens", component="endpoint", level="serving",
                             kind=Kind.BITEXACT, control="none")
    def greedy(ctx: CheckContext) -> Trial:
        raise SkipCheck("the endpoint's logprobs identify none of its tokens")

    run = run_checks(list(registry))
    assert run.verdict == "inconclusive"
    write_reports(run, tmp_path)
    data = load_report(tmp_path)
    assert data["summary"]["missing_evidence"] == run.missing_evidence
    junit = (tmp_path / "junit.xml").read_text()
    assert 'name="verdict.evidence"' in junit and 'type="inconclusive"' in junit
    assert "endpoint.greedy.tokens did not run" in junit
    assert "not verified: endpoint: endpoint.greedy.tokens did not run" in (tmp_path / "report.html").read_text()
    assert verdict_line(run).startswith("[bold yellow]INCONCLUSIVE[/]: endpoint: endpoint.greedy.tokens did not run")
    assert EXIT_CODES["inconclusive"] not in (EXIT_CODES["pass"], EXIT_CODES["fail"], 2, 3)
