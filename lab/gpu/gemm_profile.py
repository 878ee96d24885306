"""Which GEMMs of an eager decode step take how long, by shape, against the bytes they must read (diagnostic, CUDA).

The bench's batch-1 profile (2026-12-02) put 79 GEMM kernels at 0.69 ms of a 1.45 ms graph step, named only by
cuBLAS's kernel names. This script runs `--steps` eager decode steps of `--preset` at `--batch` under
torch.profiler with shapes recorded and groups the device time of every matrix-multiply op by its input shapes:
calls per step, microseconds per call, the weight's bytes and the bandwidth that implies (weight bytes over the
call's device time; at small batch a GEMM is a weight read). Eager launches add host gaps between kernels, not
device time to a kernel: the per-call times are the graph step's.

    python -m lab.gpu.gemm_profile [--preset kl-48b-8l] [--batch 1] [--steps 8]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from math import prod

import torch
from torch.profiler import ProfilerActivity, profile

from k3verify.bench.timing import random_prompt
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kl-48b-8l")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (no device times)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cfg = get_preset(a.preset)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = ServingModel(cfg, dtype, dev).load(synthetic_tensors(cfg, 0, device=dev))
    ctx = a.prompt_len + 2 * a.steps + 16
    runner = ModelRunner(model, num_pages=a.batch * (-(-ctx // 64)) + 8, page_size=64, num_slots=a.batch + 1,
                         max_context=ctx)
    prompts = random_prompt(a.batch, a.prompt_len, cfg.vocab_size, 0, dev)
    ids = list(range(a.batch))
    for sid in ids:
        runner.admit(sid, ctx)
    nxt = runner.prefill([(sid, prompts[sid].tolist()) for sid in ids]).argmax(-1)
    for _ in range(3):  # warm-up: cuBLAS heuristics, Triton compiles
        runner.set_next_tokens(ids, nxt)
        nxt = runner.decode_next(ids, None).argmax(-1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(a.steps):
            runner.set_next_tokens(ids, nxt)
            nxt = runner.decode_next(ids, None).argmax(-1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    # the outermost matmul op of each call carries its kernels' device time; nested ones (linear -> mm) repeat it
    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key not in MATMULS:
            continue
        shapes = [tuple(s) for s in ev.input_shapes if s]
        weight = max(shapes[1:], key=prod, default=())
        row = rows[(ev.key, str(shapes))]
        row[0] += ev.count
        row[1] += ev.device_time_total
        row[2] = prod(weight) * dtype.itemsize if weight else 0
    linears = {k: v for k, v in rows.items() if k[0] == "aten::linear"}
    shown = linears or rows
    total = sum(v[1] for v in shown.values()) / a.steps
    print(f"{a.preset} batch {a.batch}: {len(shown)} matmul shapes, {total / 1e3:.3f} ms of device time per eager step")
    print(f"{'op':12s} {'input shapes':60s} {'calls/step':>10s} {'us/call':>8s} {'MB':>7s} {'GB/s':>7s}")
    for (op, desc), (count, device_us, nbytes) in sorted(shown.items(), key=lambda kv: -kv[1][1])[:a.top]:
        per = device_us / max(count, 1)
        print(f"{op:12s} {desc[:60]:60s} {count / a.steps:10.1f} {per:8.1f} {nbytes / 1e6:7.2f} "
              f"{nbytes / (per * 1e-6) / 1e9 if per else 0:7.0f}")


if __name__ == "__main__":
    main()
