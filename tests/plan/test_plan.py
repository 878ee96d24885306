"""`k3verify plan`: per-rank bytes on the meta device. Weights equal a real build's bytes, caches equal the
cache classes' own tensors, ranks split what they should, the CLI prints the table and JSON, and the GPU
measurement's plumbing runs end to end on CPU with counting stand-ins for the CUDA memory counters."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from k3verify.cli import main
from k3verify.plan import measure as measure_mod
from k3verify.plan.memory import PlanRequest, expert_copy_bytes, plan, plan_rank
from k3verify.presets import get_preset
from k3verify.serving.model import ServingModel
from k3verify.serving.parallel.layout import ParallelLayout


def _bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_single_rank_weights_equal_the_served_model(preset: str) -> None:
    cfg = get_preset(preset)
    (only,) = plan(cfg, PlanRequest(1, 1, 256, 2, 128))
    assert only.weights == _bytes(ServingModel(cfg, torch.bfloat16, "meta"))


def test_caches_and_block_buffer_match_their_shapes() -> None:
    """k3-tiny, 2 sequences of 256 tokens, pages of 16: MLA latents, KDA states + conv windows, block buffer."""
    cfg = get_preset("k3-tiny")
    (p,) = plan(cfg, PlanRequest(1, 1, 256, 2, 128))
    pages = 2 * math.ceil(256 / 16) + 1
    assert p.mla_cache == len(cfg.full_attn_layers) * pages * 16 * cfg.mla_cache_width * 2
    dk, D, W = cfg.kda_head_dim, cfg.kda_dim, cfg.conv_kernel_size
    assert p.kda_state == len(cfg.kda_layers) * 3 * (cfg.kda_num_heads * dk * dk + 3 * D * (W - 1)) * 4
    assert p.block_residual == 128 * 3 * cfg.hidden_size * 2  # 6 layers, block size 2 -> 3 entries
    one_slot = len(cfg.kda_layers) * (cfg.kda_num_heads * dk * dk + 3 * D * (W - 1)) * 4
    assert p.prefix_snapshots == 64 * (one_slot + 4 * cfg.vocab_size)  # serve's default budget: 64 snapshots
    (off,) = plan(cfg, PlanRequest(1, 1, 256, 2, 128, prefix_snapshots=0))
    assert off.prefix_snapshots == 0 and p.total - off.total == p.prefix_snapshots


def test_ranks_split_weights_and_kda_state() -> None:
    """k3-tp4 at 4 GPUs: every rank holds a quarter of the KDA state and less than half the weights; the ranks
    together hold at least the whole model (replicated parts once per rank)."""
    cfg = get_preset("k3-tp4")
    (one,) = plan(cfg, PlanRequest(1, 1, 256, 1, 128))
    (four,) = plan(cfg, PlanRequest(4, 4, 256, 1, 128))
    assert four.ranks == [0, 1, 2, 3]
    assert four.kda_state * 4 == one.kda_state
    assert four.mla_cache == one.mla_cache  # the latent is head-independent: every rank caches it whole
    assert four.weights < one.weights / 2 and 4 * four.weights >= one.weights


def test_uneven_ranks_are_planned_apart() -> None:
    cfg = get_preset("k3-tiny")  # 3 KDA heads over 2 ranks
    plans = plan(cfg, PlanRequest(2, 2, 256, 1, 128))
    assert sorted(r for p in plans for r in p.ranks) == [0, 1] and len(plans) == 2
    assert plans[0].total > plans[1].total


def test_cached_experts_add_the_bf16_copy() -> None:
    cfg = get_preset("k3-tiny")
    (packed,) = plan(cfg, PlanRequest(1, 1, 256, 1, 128))
    (cached,) = plan(cfg, PlanRequest(1, 1, 256, 1, 128, experts="cached"))
    moe_layers = cfg.num_hidden_layers - 1
    per = cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.expert_in_dim * 2
    assert cached.expert_bf16_copy == per * moe_layers == expert_copy_bytes(cfg, ParallelLayout(1, 1), torch.bfloat16)
    assert cached.total - packed.total == cached.expert_bf16_copy


def test_plan_cli_prints_the_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = main(["plan", "--preset", "k3-slice-4l", "--gpus", "1", "--context", "8192", "--segment", "4096",
               "--gpu-memory-gib", "79.1", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "| ranks | weights |" in text and "k3-slice-4l: tp=1 ep=1" in text
    data = json.loads(out.read_text())
    (rank,) = data["ranks"]
    assert rank["total"] == sum(rank[k] for k in ("weights", "expert_bf16_copy", "mla_cache", "kda_state",
                                                  "block_residual", "transient", "prefix_snapshots"))
    assert 10 * 2**30 < rank["weights"] < 14 * 2**30  # K3 widths cut to 4 layers and 64 experts, MXFP4 packed


@pytest.mark.parametrize(("flags", "message"), [
    (["--gpus", "4", "--tp", "2"], "each degree must be 1 or the world size"),
    (["--gpus", "2", "--tp", "4", "--ep", "4"], "is a world of 4 ranks, but --gpus is 2"),
    (["--context", "100", "--segment", "200"], "segment 200 exceeds context 100"),
    (["--measure"], "--measure needs a CUDA device"),
])
def test_plan_usage_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "--measure" in flags and torch.cuda.is_available():
        pytest.skip("CUDA present: --measure would run")
    assert main(["plan", "--preset", "kl-tiny", *flags]) == 2
    assert message in capsys.readouterr().err


class FakeCuda:
    """Counting stand-ins for the CUDA memory counters, so the measurement's plumbing runs on CPU."""

    def __init__(self) -> None:
        self.allocated, self.peak = 1000, 1000

    def memory_allocated(self, *_: object) -> int:
        self.allocated += 10
        self.peak = max(self.peak, self.allocated + 5)
        return self.allocated

    def max_memory_allocated(self, *_: object) -> int:
        return self.peak

    def reset_peak_memory_stats(self, *_: object) -> None:
        self.peak = self.allocated


def test_measure_plumbing_runs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU command's code path (synthetic weights, runner, warm-up, two passes, hooks per sublayer kind,
    the plan of the same step) runs on k3-tiny with stand-in counters; numbers are the stand-ins'."""
    fake = FakeCuda()
    for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    cfg = get_preset("k3-tiny")
    result = measure_mod.measure(cfg, PlanRequest(1, 1, 128, 1, 64, torch.float32), torch.device("cpu"))
    assert set(result["measured"]["kinds"]) == {"kda", "mla", "dense_mlp", "moe"}
    assert set(result["predicted_kinds"]) == {"kda", "mla", "dense_mlp", "moe"}
    assert result["experts_mode"] == "cached" and result["predicted"]["expert_bf16_copy"] > 0
    assert result["ratio"] == result["predicted"]["total"] / result["measured"]["peak"]


def test_the_plan_holds_the_peaks_measured_on_an_h100() -> None:
    """`bench --context` on one H100 80 GB (docs/results/h100-2026-12-06b/lc-*.json): the measured CUDA peak of
    each row against the plan for the same request, within the bench's 10%. kl-48b-8l's peak at 1K and 32K is its
    first MoE call, which stacks the layer's bf16 experts beside themselves (3.6 GB); at 128K, MLA's prefill over
    the cached prefix, without a [T, Tk] mask."""
    folder = Path(__file__).parents[2] / "docs" / "results" / "h100-2026-12-06b"
    rows = 0
    for path in sorted(folder.glob("lc-*.json")):
        data = json.loads(path.read_text())
        cfg = get_preset(data["preset"])
        for r in data["rows"]:
            req = PlanRequest(1, 1, r["context"] + 17, 1, min(data["segment"], r["context"]), torch.bfloat16,
                              "packed", 64, prefix_snapshots=0)  # the bench's request: 16 decoded tokens + 1
            want = plan_rank(cfg, ParallelLayout(1, 1), req).total
            assert abs(want / r["peak_bytes"] - 1) <= 0.10, (path.name, r["context"], want, r["peak_bytes"])
            rows += 1
    assert rows == 6
