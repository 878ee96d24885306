"""Where a decode step's (or a prefill's) time goes: GPU kernels by category, idle gaps inside a replay, host time.

Method: `steps` graph-replayed decode steps (after warm-up) under torch.profiler with CUDA activity;
the Chrome trace is parsed for kernel / memcpy / memset records. Kernels launched by one
cudaGraphLaunch share its correlation id, which splits the GPU timeline into steps:
  span    = last kernel end - first kernel start of a step (what the GPU spends on it),
  busy    = union of its kernel intervals, idle = span - busy (launch gaps between graph nodes),
  host    = wall time of one engine step (schedule, fill static inputs, replay, sample on the device,
            collect the previous step's ids) - span; with the overlap, host work hides behind the GPU.
If the profiler sees no kernels inside graphs, the breakdown comes from the trace as is and the result says so.
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

from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.request import Request
from k3verify.serving.runner import ModelRunner
from k3verify.serving.sampler import SamplingParams
from k3verify.serving.scheduler import Scheduler
from k3verify.serving.step_loop import StepLauncher

_CATEGORIES = (  # first match wins; matched against the lower-cased kernel name
    ("moe decode experts", ("moe_gate_up", "moe_down")),  # kernels/moe/decode_kernel.py
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


TOP_KERNELS = 40  # kernels listed by name per profile: enough to see every small launch of a batch-1 step


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
                        for k, v in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]],
    }


def profile_decode(runner: ModelRunner, graphs: GraphDecoder, prompts: torch.Tensor, steps: int = 8
                   ) -> dict[str, Any]:
    """B greedy requests through the engine's own step (scheduler plan, StepLauncher: graph replay, sampling on
    the device, pinned readback, step n+1 launched before step n is collected); after warm-up, `steps` decode
    steps are profiled. Host time per step is the engine loop's wall time per step, overlap included."""
    B, T = prompts.shape
    base = max(runner.active_ids, default=-1) + 1
    params = SamplingParams(max_tokens=2 * steps + 4, temperature=0.0, ignore_eos=True)
    reqs = {sid: Request(seq_id=sid, prompt_ids=prompts[i].tolist(), max_new_tokens=params.max_tokens, params=params,
                         stop_ids=frozenset(), seed=0, decoder=None, sink=lambda event: None, arrival=0.0)
            for i, sid in enumerate(range(base, base + B))}
    sched = Scheduler(runner, max_step_tokens=B * T + B)
    for req in reqs.values():
        sched.add(req)
    launcher = StepLauncher(runner, graphs)
    in_flight = launcher.launch(sched.schedule(), reqs)  # the prefill step
    host: list[float] = []

    def step(record: bool) -> None:
        nonlocal in_flight
        t0 = time.perf_counter()
        launched = launcher.launch(sched.schedule(), reqs)
        if in_flight is not None:
            launcher.collect(in_flight)
        in_flight = launched
        if record:
            host.append(time.perf_counter() - t0)

    def traced() -> None:
        for _ in range(steps):
            step(True)

    try:
        for _ in range(steps):
            step(False)  # warm-up: capture, allocator, autotune
        events = _trace(traced)
        out = summarize(events, steps, host)
    finally:
        if in_flight is not None:
            launcher.collect(in_flight)
        for sid in reqs:
            sched.finish(sid)
    out["batch"] = B
    out["graphs"] = bool(graphs.use_graphs)
    if graphs.use_graphs and out["graph_steps_seen"] == 0:
        out["note"] = "the profiler recorded no kernels inside CUDA graphs: breakdown comes from the trace as is"
    return out


def profile_prefill(runner: ModelRunner, tokens: int, vocab_size: int, seed: int, repeats: int = 3) -> dict[str, Any]:
    """One sequence of `tokens` prefilled eagerly (as the bench's prefill speed measures it), `repeats` times
    after one warm-up, traced: per prefill, the kernels by category, the GPU span (first kernel start to last
    kernel end: launch gaps included, since prefill is not graph-captured) and the host wall time."""
    ids = torch.randint(0, vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    sid = max(runner.active_ids, default=-1) + 1
    host: list[float] = []

    def once(record: bool) -> None:
        runner.admit(sid, tokens)
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                runner.prefill([(sid, ids)])
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            if record:
                host.append(time.perf_counter() - t0)
        finally:
            runner.release(sid)

    def traced() -> None:
        for _ in range(repeats):
            once(True)

    once(False)  # warm-up: compiles, autotuning, allocator
    events = _trace(traced)
    out = summarize(events, repeats, host)
    out["tokens"] = tokens
    out["graphs"] = False
    out["note"] = "eager prefill: the span includes launch gaps and the host's time between launches"
    return out
