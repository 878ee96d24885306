"""Where does an eager prefill spend its host time? (diagnostic, CUDA)

Builds a preset's ServingModel on CUDA with synthetic weights, then for each pack shape (one sequence of T
tokens, or B sequences of T tokens): wall time per prefill (model.prefill, no caches), the host-sync sites
(torch.cuda.set_sync_debug_mode, our frames only) and the top functions by own host time (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.batch import PackedBatch
from k3verify.serving.model import ServingModel
from lab.host_syncs import sync_sites


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kl-48b-8l")
    ap.add_argument("--shapes", default="1x1024,64x128,1x8192")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    dev = torch.device("cuda")
    cfg = get_preset(a.preset)
    model = ServingModel(cfg, torch.bfloat16, dev).load(synthetic_tensors(cfg, 0, device=dev))
    rows = []
    for shape in a.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        ids = torch.randint(0, cfg.vocab_size, (B * T,), device=dev)
        pack = PackedBatch.build(ids, [T] * B, device=dev)
        for _ in range(2):
            model.prefill(pack)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            model.prefill(pack)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 5 * 1e3
        stack_sites = sync_sites(lambda pack=pack: model.prefill(pack))
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(3):
            model.prefill(pack)
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
        print(f"===== {a.preset} prefill {B} x {T}: {ms:.2f} ms, {B * T / ms * 1e3:,.0f} tok/s")
        print("sync sites:", dict(stack_sites) or "none")
        print("\n".join(s.getvalue().splitlines()[:a.top + 12]))
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.top + 10)
        print("\n".join(s.getvalue().splitlines()[:a.top + 22]))
        rows.append((shape, ms, sum(stack_sites.values())))
    print("shape      ms      syncs")
    for shape, ms, n in rows:
        print(f"{shape:9s} {ms:7.2f} {n:5d}")


if __name__ == "__main__":
    main()
