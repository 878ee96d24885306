"""The bench's timed workloads: packed prefill, greedy generate (prefill + decode steps), the experts a
decode step touches (for the floor)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from k3verify.bench.floor import decode_floor_bytes
from k3verify.bench.timing import cuda_time, random_prompt
from k3verify.config import ModelConfig
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.prefill_graphs import GraphPrefill
from k3verify.serving.runner import ModelRunner


class DeviceMarks:
    """Points on the device's timeline (CUDA events; wall clock on CPU), read only at the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.points: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def seconds(self, i: int, j: int) -> float:
        if self.cuda:
            self.points[j].synchronize()
            return float(self.points[i].elapsed_time(self.points[j])) / 1e3
        return float(self.points[j] - self.points[i])


def generate_ours(runner: ModelRunner, graphs: GraphDecoder | None, prompts: torch.Tensor, new_tokens: int,
                  decode_spans: list[float] | None = None, prefill_graphs: GraphPrefill | None = None) -> torch.Tensor:
    """Greedy: packed prefill of B prompts (through `prefill_graphs` when given, as the served engine prefills
    with them on), then new_tokens-1 decode steps -> [B, new_tokens] ids. Each step feeds the previous step's ids
    on the device (the engine's decode path, no host round trip); with `decode_spans`, the device time from the end
    of the prefill to the end of the last step is appended."""
    B, T = prompts.shape
    ids = list(range(B))
    for sid in ids:
        runner.admit(sid, T + new_tokens)
    marks = DeviceMarks(runner.device)
    try:
        logits = runner.prefill([(sid, prompts[sid].tolist()) for sid in ids], prefill_graphs)
        out = [logits.argmax(-1)]
        marks.mark()
        for _ in range(new_tokens - 1):
            runner.set_next_tokens(ids, out[-1])
            out.append(runner.decode_next(ids, graphs).argmax(-1))
        marks.mark()
        if decode_spans is not None:
            decode_spans.append(marks.seconds(0, 1))
        return torch.stack(out, dim=1)
    finally:
        for sid in ids:
            runner.release(sid)


def runner_prefill(runner: ModelRunner, prompts: list[list[int]], graphs: GraphPrefill | None,
                    times: int = 1) -> torch.Tensor:
    """Admit the prompts as fresh sequences, prefill them (through `graphs` when given) `times` times, release:
    the last call's [n, V] logits."""
    out = torch.empty(0)
    for _ in range(times):
        first = max(runner.active_ids, default=-1) + 1
        ids = list(range(first, first + len(prompts)))
        for sid, p in zip(ids, prompts, strict=True):
            runner.admit(sid, len(p))  # a prefill alone: no room for a next token needed
        try:
            out = runner.prefill(list(zip(ids, prompts, strict=True)), graphs)
        finally:
            for sid in ids:
                runner.release(sid)
    return out


PREFILL_ROUNDS = 7


def time_prefill(fn_ours: Any, fn_theirs: Any, T: int, rounds: int = PREFILL_ROUNDS) -> dict[str, Any]:
    """Both sides timed in alternation, `rounds` times each after three untimed calls, medians compared. A 1k prefill is
    mostly host work on either side, so the machine's drift moves it between runs; back-to-back calls per side
    would charge that drift to one side, alternating puts it on both. `*_spread` = (slowest - fastest) / median,
    for the reader."""
    sides = {"ours": fn_ours} if fn_theirs is None else {"ours": fn_ours, "baseline": fn_theirs}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for fn in sides.values():
        cuda_time(fn, warmup=2, repeats=1)
    for _ in range(rounds):
        for name, fn in sides.items():
            times[name].append(cuda_time(fn, warmup=0, repeats=1).median_s)
    median = {name: statistics.median(t) for name, t in times.items()}
    row: dict[str, Any] = {"tokens": T, "ours_tok_s": T / median["ours"], "rounds": rounds,
                           "ours_spread": (max(times["ours"]) - min(times["ours"])) / median["ours"]}
    if fn_theirs is not None:
        row |= {"baseline_tok_s": T / median["baseline"], "ratio": median["baseline"] / median["ours"],
                "baseline_spread": (max(times["baseline"]) - min(times["baseline"])) / median["baseline"]}
    return row


def time_decode(cfg: ModelConfig, runner: ModelRunner, graphs: GraphDecoder | None, hf_model: Any, B: int,
                prompt_len: int, new_tokens: int, bandwidth: float, seed: int, *, compare_eager: bool = False,
                prefill_graphs: GraphPrefill | None = None) -> dict[str, Any]:
    """Greedy generate of B prompts: tok/s over the whole call (prefill included) and the steady decode step
    (device time after the prefill / steps); beside the baseline's generate, or our own eager decode."""
    prompts = random_prompt(B, prompt_len, cfg.vocab_size, seed, runner.model.device)
    for _ in range(1 if prefill_graphs is None else prefill_graphs.capture_after):
        generate_ours(runner, graphs, prompts, new_tokens, prefill_graphs=prefill_graphs)  # warm-up (captures)
    spans: list[float] = []
    t = cuda_time(lambda: generate_ours(runner, graphs, prompts, new_tokens, spans, prefill_graphs), warmup=0,
                  repeats=2)
    step_s = statistics.median(spans) / max(new_tokens - 1, 1)
    touched = measured_distinct_experts(runner, prompts)
    floor = decode_floor_bytes(cfg, B, prompt_len + new_tokens, distinct_experts=touched)
    uniform = decode_floor_bytes(cfg, B, prompt_len + new_tokens)
    row: dict[str, Any] = {"batch": B, "ours_tok_s": B * new_tokens / t.median_s, "ours_step_ms": step_s * 1e3,
                           "floor_step_ms": floor.total / bandwidth * 1e3,
                           "fraction_of_floor": floor.total / bandwidth / step_s, "floor_bytes": floor.total,
                           "distinct_experts_per_layer": touched, "floor_bytes_uniform_routing": uniform.total}
    if hf_model is not None:
        mask = torch.ones_like(prompts)

        def gen() -> Any:
            return hf_model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

        theirs = cuda_time(gen, warmup=1, repeats=2)
        row |= {"baseline_tok_s": B * new_tokens / theirs.median_s, "ratio": theirs.median_s / t.median_s}
    elif compare_eager and graphs is not None:
        eager = cuda_time(lambda: generate_ours(runner, None, prompts, new_tokens), warmup=1, repeats=2)
        row |= {"eager_tok_s": B * new_tokens / eager.median_s, "vs_eager": eager.median_s / t.median_s}
    return row


def measured_distinct_experts(runner: ModelRunner, prompts: torch.Tensor, steps: int = 4) -> float | None:
    """Mean number of distinct experts one decode step of this batch touches per MoE layer, counted on
    eager decode steps of the same prompts (the floor's expert bytes; None for a model without MoE)."""
    from k3verify.serving.layers.moe import Router

    B, T = prompts.shape
    counts: list[int] = []

    def hook(module: torch.nn.Module, args: Any, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        if T == 1 or out[1].shape[0] == B:  # decode steps (a prefill routes B*T rows)
            counts.append(int(out[1].unique().numel()))

    handles = [m.register_forward_hook(hook) for m in runner.model.modules() if isinstance(m, Router)]
    try:
        generate_ours(runner, None, prompts, steps + 1)
    finally:
        for h in handles:
            h.remove()
    return sum(counts) / len(counts) if counts else None
