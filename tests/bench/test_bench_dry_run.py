"""The bench's logic on CPU (kl-tiny, wall clock): parity gating, baseline loading, decode timing rows.

Speeds measured here mean nothing; the point is that the GPU run's code paths are exercised in CI."""

from __future__ import annotations

import pytest
import torch

from k3verify.bench.run import BenchPlan, run_bench
from k3verify.cli import main
from k3verify.presets import get_preset, preset_hf_config

CARD_GIB = 0.007  # a fake card just above the planned peak: the fit check passes


@pytest.fixture(scope="module")
def dry_run():  # type: ignore[no-untyped-def]
    from k3verify.oracle.hf_kimi_linear import torch_kda_paths

    plan = BenchPlan("kl-tiny", prefill_lens=(64,), batches=(1, 3), new_tokens=4, prompt_len=8, parity_len=64,
                     profile_batches=(3,), profile_prefill_lens=(48,), served_concurrency=(1, 3),
                     served_requests_per_client=2, card_gib=CARD_GIB,
                     streamed_gold=True)
    with torch_kda_paths(torch.device("cpu")):
        return run_bench(plan, get_preset("kl-tiny"), preset_hf_config("kl-tiny"), torch.device("cpu"), 1e10)


def test_bench_gates_before_timing_and_reports_ratios(dry_run) -> None:  # type: ignore[no-untyped-def]
    """Parity ran (candidate passed, control failed) before any speed, and every row carries a ratio."""
    assert [p["id"] for p in dry_run.parity] == ["bench.prefill_logits_vs_fp32_gold",
                                                 "bench.decode_logits_vs_fp32_gold",
                                                 "bench.served_vs_bench_path.c1", "bench.served_vs_bench_path.c3"]
    for parity in dry_run.parity:
        assert parity["status"] == "pass", parity
        assert parity["control_metric"] > parity["metric"]
        assert parity["bar"] is None if parity["kind"] == "bitexact" else parity["metric"] <= parity["bar"]
    assert dry_run.speeds_reported
    assert any(n.startswith("gold: the K3 reference in fp32, streamed") for n in dry_run.notes)
    assert [r["tokens"] for r in dry_run.prefill] == [64]
    assert [r["batch"] for r in dry_run.decode] == [1, 3]
    for row in dry_run.prefill + dry_run.decode:
        assert row["ours_tok_s"] > 0 and row["baseline_tok_s"] > 0 and row["ratio"] > 0
    for row in dry_run.decode:
        assert 0 < row["fraction_of_floor"] and row["floor_bytes"] > 0
    cfg = get_preset("kl-tiny")
    b1, b3 = dry_run.decode
    # the floor counts the experts the run actually touched: exactly k at batch 1 (= the uniform formula)
    assert b1["distinct_experts_per_layer"] == cfg.num_experts_per_token
    assert b1["floor_bytes"] == b1["floor_bytes_uniform_routing"]
    assert cfg.num_experts_per_token <= b3["distinct_experts_per_layer"] <= min(cfg.num_experts,
                                                                                 3 * cfg.num_experts_per_token)
    assert [r["concurrency"] for r in dry_run.served] == [1, 3]
    for row, bench in zip(dry_run.served, dry_run.decode, strict=True):
        assert row["requests"] == 2 * row["concurrency"] and row["tokens"] == row["requests"] * 4
        assert row["tok_s"] > 0 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["itl_p50_ms"] > 0
        assert row["bench_tok_s"] == bench["ours_tok_s"] and row["served_over_bench"] > 0
        # one untimed wave of the same shape first (compiles and autotuning outside the timed wall)
        assert row["warmup"]["requests"] == row["concurrency"] and row["warmup"]["engine_steps"] > 0
        assert row["ttft_slowest"][0]["ttft_ms"] == pytest.approx(row["ttft_p99_ms"])  # under 100 requests p99 = max
        assert row["server_layout"] == "api_process" and row["cpus_usable"] >= 1  # the HTTP server apart, as serve
        assert "cpu_throttled_ms" in row and "cgroup_quota_cpus" in row
        assert row["arrivals"]["bursts"] >= 1 and row["admission_holds"] >= 0
    (pre,) = dry_run.profile_prefill  # eager prefill of one 48-token sequence, 3 traced repeats
    assert pre["tokens"] == 48 and pre["steps"] == 3 and pre["host_step_ms"] > 0 and pre["graphs"] is False
    (prof,) = dry_run.profile  # on CPU the trace has no GPU kernels: only the host side is measured
    assert prof["batch"] == 3 and prof["host_step_ms"] > 0 and prof["kernels_per_step"] == 0


def test_speeds_are_withheld_when_parity_is_red(monkeypatch: pytest.MonkeyPatch) -> None:
    """A red parity result means no speed is reported at all."""
    from k3verify.bench import run as bench_run
    from k3verify.oracle.hf_kimi_linear import torch_kda_paths

    monkeypatch.setattr(bench_run, "model_parity", lambda *a, **k: {"id": "x", "status": "fail"})
    plan = BenchPlan("kl-tiny", prefill_lens=(32,), batches=(1,), new_tokens=2, prompt_len=4, parity_len=32)
    with torch_kda_paths(torch.device("cpu")):
        result = run_bench(plan, get_preset("kl-tiny"), preset_hf_config("kl-tiny"), torch.device("cpu"), 1e10)
    assert not result.speeds_reported and result.prefill == [] and result.decode == []
    assert any("withheld" in n for n in result.notes)


def test_served_parity_red_withholds_every_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A served path whose tokens differ from the bench path's stops the run before any speed."""
    from k3verify.bench import served
    from k3verify.oracle.hf_kimi_linear import torch_kda_paths

    monkeypatch.setattr(served, "served_parity", lambda *a, **k: {"id": "bench.served_vs_bench_path.c1",
                                                                    "status": "fail"})
    plan = BenchPlan("kl-tiny", prefill_lens=(32,), batches=(1,), new_tokens=2, prompt_len=4, parity_len=32,
                     served_concurrency=(1,))
    with torch_kda_paths(torch.device("cpu")):
        result = run_bench(plan, get_preset("kl-tiny"), preset_hf_config("kl-tiny"), torch.device("cpu"), 1e10)
    assert not result.speeds_reported and result.prefill == result.decode == result.served == []


def test_bench_without_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal path does not apply")
    assert main(["bench"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_speeds_are_withheld_without_a_model_level_reference() -> None:
    """--no-baseline (or a K3 preset) leaves only graph-vs-eager parity: no speed may be reported."""
    plan = BenchPlan("kl-tiny", prefill_lens=(32,), batches=(1,), new_tokens=2, prompt_len=4, parity_len=32,
                     baseline=False)
    result = run_bench(plan, get_preset("kl-tiny"), preset_hf_config("kl-tiny"), torch.device("cpu"), 1e10)
    assert not result.speeds_reported and result.prefill == [] and result.decode == []
    assert any("no model-level parity" in n for n in result.notes)


def test_readme_table_from_the_json(dry_run, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """`bench --table run.json` renders hardware, workload, ours, baseline, ratio, % of floor (no GPU)."""
    import json

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dry_run.to_dict()))
    assert main(["bench", "--table", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| hardware | workload | ours | baseline" in out
    assert "decode batch 3" in out and "prefill 64 tokens" in out and "% (floor" in out
    assert "3 streaming clients in 1 client process, 6 requests, server " in out and "ITL p50 / p99" in out
    withheld = {**dry_run.to_dict(), "speeds_reported": False, "notes": ["parity is not green"]}
    path.write_text(json.dumps(withheld))
    assert main(["bench", "--table", str(path)]) == 1
    assert "No speeds" in capsys.readouterr().out


def test_k3_preset_is_gated_on_the_k3_reference_gold() -> None:
    """transformers has no K3: the fp32 K3 reference is the gold, the bf16 reference the baseline distance."""
    plan = BenchPlan("k3-tiny", prefill_lens=(32,), batches=(1,), new_tokens=3, prompt_len=4, parity_len=48)
    result = run_bench(plan, get_preset("k3-tiny"), preset_hf_config("k3-tiny"), torch.device("cpu"), 1e10)
    assert [p["id"] for p in result.parity] == ["bench.prefill_logits_vs_fp32_gold",
                                                "bench.decode_logits_vs_fp32_gold"]
    assert all(p["status"] == "pass" and p["baseline_vs_gold_rms"] > 0 for p in result.parity)
    assert result.speeds_reported and result.baseline_name == "K3 reference (bf16)"


def test_prefill_graph_rows_fail_when_nothing_replays() -> None:
    """With --prefill-graphs on the CPU the static step runs without a graph: the parity rows must fail with the
    reason (an eager result held to itself would pass them) and the speeds are withheld. The bench's own packs fit
    its runner (an 8k-class prompt admitted for a prefill alone)."""
    from k3verify.oracle.hf_kimi_linear import torch_kda_paths

    plan = BenchPlan("kl-tiny", prefill_lens=(64,), batches=(1, 3), new_tokens=4, prompt_len=8, parity_len=64,
                     prefill_graphs=True)
    with torch_kda_paths(torch.device("cpu")):
        result = run_bench(plan, get_preset("kl-tiny"), preset_hf_config("kl-tiny"), torch.device("cpu"), 1e10)
    rows = [r for r in result.parity if r["id"].startswith("bench.prefill_graph")]
    assert [r["id"] for r in rows] == [f"bench.prefill_graph_{w}.{t}" for t in ("1x64", "1x8", "3x8")
                                       for w in ("replay_vs_static", "vs_eager")]
    assert all(r["status"] == "fail" and "not replayed" in r["notes"][-1] for r in rows)
    assert not result.speeds_reported and result.prefill == []


def test_bench_refuses_before_allocating_on_a_card_too_small() -> None:
    """kl-48b-8l's bench plan (weights + our model, caches, transients) fits an 80 GB H100 and not a 40 GiB card,
    which is told in sizes before anything is allocated; the fp32 transformers gold fits neither."""
    from k3verify.bench.memory_fit import bench_peak, fp32_whole_fits, require_bench_fits
    from k3verify.plan.device_fit import DoesNotFit

    cfg = get_preset("kl-48b-8l")
    peak = bench_peak(cfg, context=8192 + 256, batch=64, segment=8192)
    require_bench_fits(peak, 79.1)
    with pytest.raises(DoesNotFit, match=r"bench .* needs 5\d\.\d GiB, this card has 40\.0 GiB; try "):
        require_bench_fits(peak, 40.0)
    assert not fp32_whole_fits(cfg, 79.1) and fp32_whole_fits(get_preset("kl-tiny"), 0.006)
    with pytest.raises(DoesNotFit):
        run_bench(BenchPlan("kl-tiny", prefill_lens=(64,), batches=(1,), card_gib=0.001), get_preset("kl-tiny"),
                  preset_hf_config("kl-tiny"), torch.device("cpu"), 1e10)


def test_lazy_synthetic_weights_equal_the_generated_ones() -> None:
    """Our model's weights drawn again one at a time are the tensors the golds were built from."""
    from k3verify.bench.memory_fit import LazySynthetic
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors

    cfg = get_preset("kl-tiny")
    whole, lazy = synthetic_tensors(cfg, 3), LazySynthetic(cfg, 3, torch.device("cpu"))
    assert list(lazy) == list(whole) and all(torch.equal(lazy[n], t) for n, t in whole.items())
