"""Long context on one GPU: one prompt of N tokens prefilled the way the engine chunks it (segments of --segment
tokens into one sequence's caches), then greedy decode steps at that context.

Per context it prints and writes (--json): prefill tok/s, the measured CUDA peak against `k3verify plan`'s
prediction for the same context and segment (within 10% passes), the decode step time against the bandwidth floor
at that context (MLA latents dominate the bytes there), and a parity row: logits of the bf16 serving path against
a gold that fits, the same serving code with fp32 weights and activations prefilled in the same segments (its
attention chunked by those segments over the paged fp32 latent cache; not an independent implementation: it
measures how far bf16 rounding drifts over a long context). Its bar is relative to the same measure at the shortest
context of the run (--parity-base): a drift more than 2x the short-context one fails.

    python -m lab.gpu.long_context --preset kl-48b-8l --contexts 32768,131072 --parity 32768
On CPU it runs a tiny preset at small contexts to check the logic (no speeds are meaningful there).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from k3verify.bench.floor import decode_floor_bytes, measure_copy_bandwidth
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.plan.memory import PlanRequest, plan_rank
from k3verify.presets import get_preset
from k3verify.serving.model import ServingModel
from k3verify.serving.parallel.layout import ParallelLayout
from k3verify.serving.runner import ModelRunner

PAGE_SIZE = 64
DRIFT_FACTOR = 2.0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(cfg: Any, dtype: torch.dtype, device: torch.device, context: int, extra: int) -> ModelRunner:
    model = ServingModel(cfg, dtype, device)
    tensors = synthetic_tensors(cfg, 0, device=device)
    model.load(tensors)
    del tensors
    gc.collect()
    pages = math.ceil((context + extra) / PAGE_SIZE) + 1
    return ModelRunner(model, num_pages=pages, page_size=PAGE_SIZE, num_slots=1, max_context=context + extra)


def prefill(runner: ModelRunner, ids: list[int], segment: int, extra: int) -> tuple[float, dict[int, torch.Tensor]]:
    """Seconds for the whole chunked prefill (room for `extra` decoded tokens after it), and the logits at each
    segment's last position (fp32, on the CPU)."""
    runner.admit(0, len(ids) + extra)
    kept: dict[int, torch.Tensor] = {}
    sync()
    start = time.perf_counter()
    for a in range(0, len(ids), segment):
        chunk = ids[a:a + segment]
        kept[a + len(chunk) - 1] = runner.prefill([(0, chunk)])[0]
    sync()
    seconds = time.perf_counter() - start
    return seconds, {p: v.float().cpu() for p, v in kept.items()}


def decode_step_s(runner: ModelRunner, first: int, steps: int) -> float:
    token = first
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        logits = runner.decode([(0, token)])
        token = int(logits[0].argmax())
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    cfg = get_preset(args.preset)
    contexts = [int(c) for c in args.contexts.split(",")]
    parity = {int(c) for c in args.parity.split(",") if c} | ({args.parity_base} if args.parity else set())
    bandwidth = measure_copy_bandwidth(device) if device.type == "cuda" else float("nan")
    rows: list[dict[str, Any]] = []
    for context in sorted(set(contexts) | parity):
        g = torch.Generator().manual_seed(context)
        ids = torch.randint(0, cfg.vocab_size, (context,), generator=g).tolist()
        segment = min(args.segment, context)
        runner = build(cfg, torch.bfloat16, device, context, args.decode_steps + 1)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds, logits = prefill(runner, ids, segment, args.decode_steps + 1)
        row: dict[str, Any] = {"context": context, "segment": segment, "prefill_s": seconds,
                               "prefill_tok_s": context / seconds}
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            plan = plan_rank(cfg, ParallelLayout(1, 1), PlanRequest(1, 1, context + args.decode_steps + 1, 1, segment,
                                                                    torch.bfloat16, "cached", PAGE_SIZE))
            row.update(peak_bytes=peak, planned_bytes=plan.total, plan_ratio=plan.total / peak,
                       plan_within_10pct=abs(plan.total / peak - 1) <= 0.10)
        step = decode_step_s(runner, int(logits[context - 1].argmax()), args.decode_steps)
        floor = decode_floor_bytes(cfg, 1, context).total / bandwidth
        row.update(decode_step_s=step, floor_s=floor, floor_fraction=floor / step)
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if context in parity:
            gold_runner = build(cfg, torch.float32, device, context, 1)
            _, gold = prefill(gold_runner, ids, segment, 1)
            keep = sorted(gold)
            del gold_runner
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            ours, ref = torch.stack([logits[p] for p in keep]), torch.stack([gold[p] for p in keep])
            row["parity_rel_rms"] = rel_rms(ours, ref)
            row["parity_positions"] = len(keep)
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = next((r["parity_rel_rms"] for r in rows if r["context"] == args.parity_base and "parity_rel_rms" in r), None)
    for r in rows:
        if "parity_rel_rms" in r and base is not None:
            r["parity_bar"] = DRIFT_FACTOR * base
            r["parity_pass"] = r["parity_rel_rms"] <= r["parity_bar"]
    return {"preset": args.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "copy_bandwidth_bytes_s": bandwidth, "rows": rows}


def table(result: dict[str, Any]) -> str:
    out = [f"long context, {result['preset']} on {result['device']}",
           "context  prefill tok/s  peak GiB  plan/peak  decode ms  floor ms  of floor  parity rel RMS (bar)"]
    for r in result["rows"]:
        peak = f"{r['peak_bytes'] / 2**30:8.1f}" if "peak_bytes" in r else "       -"
        ratio = f"{r['plan_ratio']:9.3f}" if "plan_ratio" in r else "        -"
        par = (f"{r['parity_rel_rms']:.3g} ({r.get('parity_bar', float('nan')):.3g}, "
               f"{'pass' if r.get('parity_pass') else 'FAIL' if 'parity_pass' in r else 'base'})"
               if "parity_rel_rms" in r else "-")
        out.append(f"{r['context']:7d}  {r['prefill_tok_s']:13.0f}  {peak}  {ratio}  {r['decode_step_s'] * 1e3:9.3f}  "
                   f"{r['floor_s'] * 1e3:8.3f}  {r['floor_fraction']:8.1%}  {par}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="kl-48b-8l")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--segment", type=int, default=8192, help="tokens per prefill step (the engine's chunk)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--parity", default="32768", help="contexts with a parity row (comma-separated; empty: none)")
    p.add_argument("--parity-base", type=int, default=1024, help="the short context whose drift sets the bar")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    print(table(result))
    failed = [r for r in result["rows"] if r.get("parity_pass") is False or r.get("plan_within_10pct") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
