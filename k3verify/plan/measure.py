"""`k3verify plan --measure` (GPU only): build the single-rank model at real width with synthetic weights,
run the planned prefill (one sequence, `segment` tokens per step until `context`), and put the measured
CUDA memory next to the plan: weights, caches, peak, and the peak inside each sublayer kind.

Two passes over a fresh sequence each: the first measures the whole step's peak (max_memory_allocated,
reset after a short warm-up that builds whatever the model keeps after its first forward), the second hooks
every attention / FFN module and records the peak inside it over its own start.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

import torch

from k3verify.config import ModelConfig
from k3verify.plan.memory import PlanRequest, plan_rank
from k3verify.plan.transients import Step, kind_totals
from k3verify.serving.parallel.layout import ParallelLayout

WARMUP_TOKENS = 64


def _kind_of(name: str, module: torch.nn.Module, cfg: ModelConfig) -> str | None:
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "model" or parts[1] != "layers":
        return None
    layer = int(parts[2])
    if parts[3] == "self_attn":
        return cfg.layer_kind(layer)
    return {"mlp": "dense_mlp", "block_sparse_moe": "moe"}.get(parts[3])


def _hook_kinds(model: torch.nn.Module, cfg: ModelConfig, peaks: dict[str, int]) -> list[Any]:
    handles = []
    for name, module in model.named_modules():
        kind = _kind_of(name, module, cfg)
        if kind is None:
            continue
        start: dict[str, int] = {}

        def pre(_m: Any, _args: Any, start: dict[str, int] = start) -> None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start["at"] = torch.cuda.memory_allocated()

        def post(_m: Any, _args: Any, _out: Any, kind: str = kind, start: dict[str, int] = start) -> None:
            torch.cuda.synchronize()
            peaks[kind] = max(peaks.get(kind, 0), torch.cuda.max_memory_allocated() - start["at"])

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def _prefill_all(runner: Any, seq_id: int, ids: list[int], segment: int, between: Callable[[], None]) -> None:
    runner.admit(seq_id, len(ids))
    for a in range(0, len(ids), segment):
        between()
        runner.prefill([(seq_id, ids[a:a + segment])])
    torch.cuda.synchronize()
    runner.release(seq_id)


def measure(cfg: ModelConfig, req: PlanRequest, device: torch.device, seed: int = 0) -> dict[str, Any]:
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.serving.model import ServingModel
    from k3verify.serving.runner import ModelRunner

    if req.tp != 1 or req.ep != 1 or req.batch != 1:
        raise ValueError("--measure runs one GPU, one sequence: --tp 1 --ep 1 --batch 1")
    model = ServingModel(cfg, req.dtype, device)
    mode = getattr(model, "mxfp4_mode", "cached")
    tensors = synthetic_tensors(cfg, seed, device=device)
    model.load(tensors)
    del tensors
    gc.collect()
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    pages = math.ceil(req.context / req.page_size) + 1
    runner = ModelRunner(model, num_pages=pages, page_size=req.page_size, num_slots=1, max_context=req.context)
    caches = torch.cuda.memory_allocated(device) - weights
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (req.context,), generator=g).tolist()
    _prefill_all(runner, 0, ids[:WARMUP_TOKENS], WARMUP_TOKENS, lambda: None)
    resident = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _prefill_all(runner, 1, ids, req.segment, lambda: None)
    peak = torch.cuda.max_memory_allocated(device)
    kinds: dict[str, int] = {}
    handles = _hook_kinds(model, cfg, kinds)
    _prefill_all(runner, 2, ids, req.segment, lambda: None)
    for h in handles:
        h.remove()
    predicted = plan_rank(cfg, ParallelLayout(1, 1), PlanRequest(
        1, 1, req.context, 1, req.segment, req.dtype, "cached" if mode == "cached" else "packed", req.page_size,
        prefix_snapshots=0))  # the measured step runs without the prefix cache
    pred_kinds = kind_totals(cfg, ParallelLayout(1, 1), Step(req.segment, req.context, 1, req.dtype.itemsize))
    return {"experts_mode": mode, "context": req.context, "segment": req.segment, "predicted": predicted.to_dict(),
            "measured": {"weights": weights, "caches": caches, "resident_after_warmup": resident, "peak": peak,
                         "transient": peak - resident, "kinds": kinds},
            "predicted_kinds": pred_kinds, "ratio": predicted.total / peak}
