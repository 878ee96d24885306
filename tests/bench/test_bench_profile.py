"""The decode profile's arithmetic on a hand-made Chrome trace: steps split by graph-launch
correlation, busy time as an interval union (overlaps counted once), idle gaps, host remainder."""

from __future__ import annotations

import pytest

from k3verify.bench.profile import category, summarize


def _kernel(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(corr: int) -> dict:
    return {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5, "args": {"correlation": corr}}


def test_summary_splits_steps_and_counts_gaps() -> None:
    events = [_launch(1), _launch(2),
              # step 1: 0-10 gemm, 8-12 overlapping kernel, idle 12-20, 20-30 -> span 30, busy 22
              _kernel("nvjet_tst_gemm", 0, 10, 1), _kernel("fused_recurrent_kda_fwd_kernel", 8, 4, 1),
              _kernel("vectorized_elementwise_kernel", 20, 10, 1),
              # step 2: identical shape, 100 us later
              _kernel("nvjet_tst_gemm", 100, 10, 2), _kernel("fused_recurrent_kda_fwd_kernel", 108, 4, 2),
              _kernel("vectorized_elementwise_kernel", 120, 10, 2)]
    out = summarize(events, steps=2, host_step_s=[50e-6, 70e-6])
    assert out["graph_steps_seen"] == 2 and out["kernels_per_step"] == 3
    assert out["gpu_span_ms"] == pytest.approx(0.030) and out["gpu_busy_ms"] == pytest.approx(0.022)
    assert out["idle_inside_step_ms"] == pytest.approx(0.008)
    assert out["host_step_ms"] == pytest.approx(0.060) and out["host_outside_gpu_ms"] == pytest.approx(0.030)
    cats = {c["category"]: c for c in out["by_category"]}
    assert cats["gemm"]["ms_per_step"] == pytest.approx(0.010) and cats["gemm"]["kernels_per_step"] == 1
    assert cats["kda recurrent (fla)"]["ms_per_step"] == pytest.approx(0.004)


def test_a_sum_of_durations_would_overcount_overlap() -> None:
    """Control for the union: two fully overlapping kernels are 10 us busy, not 20."""
    events = [_launch(1), _kernel("a_gemm", 0, 10, 1), _kernel("b_gemm", 0, 10, 1)]
    out = summarize(events, steps=1, host_step_s=[1e-4])
    assert out["gpu_busy_ms"] == pytest.approx(0.010) and out["idle_inside_step_ms"] == pytest.approx(0.0)


@pytest.mark.parametrize(("name", "cat"), [
    ("void cutlass::Kernel2<cutlass_grouped_gemm>", "moe grouped gemm"),
    ("moe_gate_up_kernel", "moe decode experts"),
    ("moe_down_kernel", "moe decode experts"),
    ("chunk_kda_fwd_kernel_o", "kda chunk (fla)"),
    ("_rms_norm_kernel", "norm"),
    ("void at::native::index_elementwise_kernel", "gather / scatter / index"),
    ("Memcpy DtoD (Device -> Device)", "copy / cast / fill"),
    ("something_unknown", "other"),
])
def test_kernel_categories(name: str, cat: str) -> None:
    assert category(name) == cat
