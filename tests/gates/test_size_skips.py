"""A check skipped for size makes the verdict INCONCLUSIVE: a PASS at real size needs zero size skips; other
skips (a CUDA-only kernel on CPU) do not."""

from __future__ import annotations

from k3verify.gates.core.evidence import SIZE_SKIP, missing_evidence

RAN = {"id": "model.logits.fp32", "status": "pass"}


def test_a_size_skip_is_missing_evidence() -> None:
    sized = {"id": "served.vs_transformers", "status": "skipped",
             "reason": f"{SIZE_SKIP} transformers' model in float32 would hold 55.4 GB"}
    why = missing_evidence([RAN, sized])
    assert len(why) == 1 and "skipped for size" in why[0] and "served.vs_transformers" in why[0]


def test_other_skips_are_not() -> None:
    cuda = {"id": "kernel.kda.prefill", "status": "skipped", "reason": "needs CUDA"}
    assert missing_evidence([RAN, cuda]) == []
