"""Is a seeded request's output independent of what shares its batch? Measured per device and dtype.

The sampler's draws are batch-invariant by construction (serving/sampler.py); the logits may not be. For each
trial a target prompt is generated alone and inside packed batches of 2, 3, 4 and 8 (other prompts of other
lengths): the largest |logit difference| of the target row under teacher forcing, and whether free-running
seeded sampling (temperature 0.8, seed 123) gives the same tokens. On CUDA both eager decode and CUDA-graph
decode (whose buckets pad the batch) are measured.

    python tools/batch_invariance.py                               # cpu, float32 and bfloat16
    python tools/batch_invariance.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.runner import ModelRunner, build_runner
from k3verify.serving.sampler import SamplingParams, sample_tokens

SAMPLED = SamplingParams(max_tokens=1, temperature=0.8, seed=123)


def _run(runner: ModelRunner, prompts: list[list[int]], steps: int, forced: list[int] | None,
         graphs: GraphDecoder | None) -> tuple[list[int], list[torch.Tensor]]:
    """Generate `steps` tokens for every prompt in one packed batch; row 0 is the target. Returns the target's
    tokens and its logits per step (fed `forced` tokens instead of its own when given)."""
    ids = list(range(len(prompts)))
    for sid, p in zip(ids, prompts, strict=True):
        runner.admit(sid, len(p) + steps + 1)
    try:
        logits = runner.prefill(list(zip(ids, prompts, strict=True)))
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for step in range(steps):
            rows.append(logits[0].float().cpu())
            seeds = torch.tensor([123] + [7 * i for i in ids[1:]], device=logits.device)
            positions = torch.tensor([len(p) + step for p in prompts], device=logits.device)
            drawn = sample_tokens(logits.float(), [SAMPLED] * len(ids), seeds, positions).tolist()
            tokens.append(drawn[0])
            feed = [forced[step] if forced is not None else drawn[0]] + drawn[1:]
            logits = runner.decode(list(zip(ids, feed, strict=True)), graphs)
        return tokens, rows
    finally:
        for sid in ids:
            runner.release(sid)


def measure(device: str, dtype: str, trials: int, steps: int, use_graphs: bool,
            batches: tuple[int, ...] = (2, 3, 4, 8)) -> list[dict[str, Any]]:
    cfg = get_preset("k3-tiny")
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=getattr(torch, dtype), device=device, num_slots=8)
    graphs = GraphDecoder(runner.model, runner.max_context) if use_graphs else None
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:  # 3: a graph bucket of 4 with one padded scratch row
        max_diff, same = 0.0, 0
        for _ in range(trials):
            prompts = [torch.randint(0, 4000, (int(torch.randint(3, 40, (1,), generator=gen)),),
                                     generator=gen).tolist() for _ in range(batch)]
            alone_tokens, alone_logits = _run(runner, prompts[:1], steps, None, graphs)
            _, forced_logits = _run(runner, prompts, steps, alone_tokens, graphs)
            crowded_tokens, _ = _run(runner, prompts, steps, None, graphs)
            max_diff = max(max_diff, max(float((a - b).abs().max()) for a, b in zip(alone_logits, forced_logits,
                                                                                    strict=True)))
            same += crowded_tokens == alone_tokens
        eager = sorted(graphs.eager_buckets) if graphs else []  # buckets whose capture failed (logged)
        decode = "eager" if not graphs else f"cuda graphs (buckets {eager} eager)" if eager else "cuda graphs"
        rows.append({"device": device, "dtype": dtype, "decode": decode,
                     "batch": batch, "trials": trials, "steps": steps,
                     "max_abs_logit_diff": max_diff, "seeded_tokens_identical": same})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batches", default="2,3,4,8", help="batch sizes the target prompt shares")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    paths = (False, True) if args.device.startswith("cuda") else (False,)
    rows = [r for dtype in args.dtypes.split(",") for g in paths
            for r in measure(args.device, dtype, args.trials, args.steps, g,
                            tuple(int(b) for b in args.batches.split(",")))]
    print("| device | dtype | decode | batch | max abs logit diff vs alone | seeded tokens identical |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['device']} | {r['dtype']} | {r['decode']} | {r['batch']} | {r['max_abs_logit_diff']:.3g} | "
              f"{r['seeded_tokens_identical']}/{r['trials']} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
