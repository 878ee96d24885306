"""Prefill through CUDA graphs (serving/prefill_graphs.GraphPrefill) against the eager prefill, on the served path.

The 1k prefill row and every served TTFT are host-bound on the H200: a 1 x 1024 prefill of kl-48b-8l took ~29 ms
of wall time for ~11 ms of kernels (lab/gpu/prefill_diag.py, 2026-12-04). For each pack (one long prompt, or B
prompts of one length) this script admits the prompts as fresh sequences and prefills them through the runner
three ways: eagerly, through the static step without a graph, and replayed from the bucket's graph. It prints the
median milliseconds of the eager prefill and of the replay, the bucket, and two checks: replay == static step (bit
for bit) and the replay's relative RMS distance from the eager logits. A bucket whose capture failed says why.

    python -m lab.gpu.prefill_graph_probe [--preset kl-48b-8l] [--packs 1x1024,1x8192,16x128,64x128,37x128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3verify.bench.speeds import runner_prefill
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.gates import Kind, compare
from k3verify.presets import get_preset
from k3verify.serving.model import ServingModel
from k3verify.serving.prefill_graphs import GraphPrefill
from k3verify.serving.runner import ModelRunner


def _ms(fn: object, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kl-48b-8l")
    ap.add_argument("--packs", default="1x1024,1x8192,16x128,64x128,37x128")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_graph_probe.py needs CUDA (it captures CUDA graphs)")
    dev = torch.device("cuda")
    cfg = get_preset(a.preset)
    packs = [tuple(int(v) for v in p.split("x")) for p in a.packs.split(",")]
    max_tokens = max(b * n for b, n in packs)
    model = ServingModel(cfg, torch.bfloat16, dev).load(synthetic_tensors(cfg, 0, device=dev))
    page = 64
    runner = ModelRunner(model, num_pages=2 * max_tokens // page + 4 * max(b for b, _ in packs) + 8, page_size=page,
                         num_slots=max(b for b, _ in packs) + 1, max_context=max(n for _, n in packs) + 8)
    graphs = GraphPrefill(model, max_tokens=max_tokens, max_seqs=4 * max(b for b, _ in packs))
    static = GraphPrefill(model, max_tokens=max_tokens, max_seqs=graphs.max_seqs, use_graphs=False)
    print(f"{'pack':>8s} {'bucket (T, B, L)':>18s} {'eager ms':>9s} {'replay ms':>9s} {'ratio':>6s} "
          f"{'replay==static':>14s} {'rms vs eager':>12s}")
    for B, n in packs:
        g = torch.Generator().manual_seed(B * 100_003 + n)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for _ in range(B)]
        shape = graphs.shape_for([n] * B)
        eager = runner_prefill(runner, prompts, None)
        eager_ms = _ms(lambda prompts=prompts: runner_prefill(runner, prompts, None))
        cand = runner_prefill(runner, prompts, graphs, times=graphs.capture_after + 1)
        bucket = "-" if shape is None else f"{shape.num_tokens}, {shape.num_seqs}, {shape.max_len}"
        if shape is None or shape in graphs.eager_shapes:
            why = "no bucket" if shape is None else graphs.eager_shapes[shape]
            print(f"{B:>3d}x{n:<4d} {bucket:>18s} {eager_ms:9.2f} {'-':>9s} {'-':>6s}  {why}"[:300])
            continue
        replay_ms = _ms(lambda prompts=prompts: runner_prefill(runner, prompts, graphs))
        same = torch.equal(cand, runner_prefill(runner, prompts, static))
        rms = compare(Kind.RMS, eager, cand, 1.0).metric
        print(f"{B:>3d}x{n:<4d} {bucket:>18s} {eager_ms:9.2f} {replay_ms:9.2f} {eager_ms / replay_ms:5.2f}x "
              f"{str(same):>14s} {rms:12.2e}")
    print(f"captures {graphs.captures}, replays {graphs.replays}, eager buckets {graphs.eager_shapes}")


if __name__ == "__main__":
    main()
