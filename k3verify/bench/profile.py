"""Where a decode step's time goes: GPU kernels by category, idle gaps inside a replay, host time.

Method: `steps` graph-replayed decode steps (after warm-up) under torch.profiler with CUDA activity;
the Chrome trace is parsed for kernel / memcpy / memset records. Kernels launched by one
cudaGraphLaunch share its correlation id, which splits the GPU timeline into steps:
  span    = last kernel end - first kernel start of a step (what the GPU spends on it),
  busy    = union of its kernel intervals, idle = span - busy (launch gaps between graph nodes),
  host    = wall time of one engine step (fill static inputs, replay, argmax to host) - span.
If the profiler sees no kernels inside graphs, the same step runs eagerly for the breakdown and the
result says so.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

_CATEGORIES = (  # first match wins; matched against the lower-cased kernel name
    ("moe grouped gemm", ("grouped",)),
    ("kda recurrent (fla)", ("fused_recurrent", "recurrent_kda")),
    ("kda chunk (fla)", ("chunk_kda", "chunk_gated", "kda")),
    ("causal conv", ("conv",)),
    ("norm", ("rms", "norm")),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas", "matmul", "splitk")),
    ("softmax", ("softmax",)),
    ("top-k / sort", ("topk", "sort", "radix", "bitonic")),
    ("gather / scatter / index", ("index", "gather", "scatter")),
    ("reduction", ("reduce",)),
    ("copy / cast / fill", ("memcpy", "memset", "copy", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in _CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _trace(fn: Callable[[], None]) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            return json.load(fh).get("traceEvents", [])
    finally:
        os.unlink(path)


def summarize(events: list[dict[str, Any]], steps: int, host_step_s: list[float]) -> dict[str, Any]:
    """Per-step numbers from a Chrome trace of `steps` decode steps (times in the trace are in us)."""
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    launches = {e.get("args", {}).get("correlation") for e in events
                if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", "")}
    launches.discard(None)
    by_step: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in gpu:
        corr = e.get("args", {}).get("correlation")
        by_step[corr if corr in launches else "eager"].append(e)
    step_groups = [v for k, v in by_step.items() if k != "eager"] or [gpu]
    spans, busys = [], []
    for group in step_groups:
        if not group:
            continue
        iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in group]
        spans.append(max(b for _, b in iv) - min(a for a, _ in iv))
        busys.append(_union(iv))
    n = max(len(step_groups), 1) if launches else steps
    per_cat: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        for table, key in ((per_cat, category(e["name"])), (per_name, e["name"][:90])):
            table[key][0] += float(e["dur"])
            table[key][1] += 1
    span_ms = (statistics.median(spans) if launches else sum(spans) / n) / 1e3 if spans else 0.0
    busy_ms = (statistics.median(busys) if launches else sum(busys) / n) / 1e3 if busys else 0.0
    host_ms = statistics.median(host_step_s) * 1e3
    return {
        "steps": steps, "graph_steps_seen": len(step_groups) if launches else 0,
        "kernels_per_step": len(gpu) / n, "host_step_ms": host_ms, "gpu_span_ms": span_ms, "gpu_busy_ms": busy_ms,
        "idle_inside_step_ms": span_ms - busy_ms, "host_outside_gpu_ms": max(host_ms - span_ms, 0.0),
        "by_category": [{"category": k, "ms_per_step": v[0] / 1e3 / n, "kernels_per_step": v[1] / n}
                        for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1][0])],
        "top_kernels": [{"name": k, "ms_per_step": v[0] / 1e3 / n, "count_per_step": v[1] / n}
                        for k, v in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:15]],
    }


def profile_decode(runner: Any, graphs: Any, prompts: torch.Tensor, steps: int = 8) -> dict[str, Any]:
    """Prefill B prompts, warm the bucket up, then profile `steps` decode steps as the engine runs them."""
    B, T = prompts.shape
    base = max(runner.active_ids, default=-1) + 1
    ids = list(range(base, base + B))
    for sid in ids:
        runner.admit(sid, T + 2 * steps + 4)
    try:
        toks = runner.prefill([(sid, prompts[i].tolist()) for i, sid in enumerate(ids)]).argmax(-1).tolist()
        host: list[float] = []

        def step(record: bool) -> None:
            nonlocal toks
            t0 = time.perf_counter()
            logits = runner.decode(list(zip(ids, toks, strict=True)), graphs)
            toks = logits.argmax(-1).tolist()  # the engine needs the tokens on the host: part of a step
            if record:
                host.append(time.perf_counter() - t0)

        for _ in range(steps):
            step(False)  # warm-up: capture, allocator, autotune
        def recorded_steps() -> None:
            for _ in range(steps):
                step(True)

        events = _trace(recorded_steps)
        out = summarize(events, steps, host)
        out["batch"] = B
        out["graphs"] = bool(graphs.use_graphs)
        if graphs.use_graphs and out["graph_steps_seen"] == 0:
            out["note"] = "the profiler recorded no kernels inside CUDA graphs: breakdown comes from the trace as is"
        return out
    finally:
        for sid in ids:
            runner.release(sid)
