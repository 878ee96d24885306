"""Launch configurations of the Triton KDA score kernels, timed and held to the shipped launch bit for bit (CUDA).

The fused score's speed-up over the unfused path fell from 1.59x at 1 row to 0.95x at 8 (2026-12-02): its cost
grew in whole waves. Built by Triton 3.6 for the H200 a program of either kernel held 170-200 registers, so two
fit on an SM. This script launches the recording kernel and the fused kernel with other value blocks, warp counts
and register caps (`maxnreg`: the compiler spills the rest) at each row count on one KDA layer of `--preset`,
checks that every output (o, y, conv records, state records) has the shipped launch's bits, and prints the median
microseconds per call (`--calls` back-to-back calls in one CUDA graph), the unfused path as its total (conv +
record + norm kernels). The first launch of each list is the shipped one (score_launch.RECORD_LAUNCH /
FUSED_LAUNCH).

    python -m lab.gpu.score_tune [--preset kl-48b-8l] [--rows 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import torch

from k3verify.bench.timing import cuda_time
from k3verify.gates.shared.spec_cases import bits, op_case
from k3verify.kernels.kda import score_launch as vt
from k3verify.presets import get_preset

# Wider value blocks with more warps keep 32 state values per thread but run a head's q/k conv, L2 norms and gate
# in fewer programs (one at BV = dv: no head ticket is waited on)
WIDE = [vt.Launch(64, 8, 128), vt.Launch(64, 8), vt.Launch(128, 16, 128), vt.Launch(128, 16), vt.Launch(128, 8)]
# The positions unrolled at compile time (the same code): a position's loads (its conv taps, g, beta) may issue
# before the previous position's step has finished, where the loop body waits on each in turn
UNROLLED = [vt.Launch(32, 4, 128, unroll=True), vt.Launch(32, 4, unroll=True), vt.Launch(16, 2, 128, unroll=True)]
# Triton's software pipelining of the runtime loop's loads (its default is 3 stages)
STAGED = [vt.Launch(32, 4, 128, stages=1), vt.Launch(32, 4, 128, stages=4)]
# the wide launches lost at every row count on the H200 (docs/results/README.md indexes the run): --wide
FUSED = [vt.FUSED_LAUNCH, vt.Launch(32, 4), vt.Launch(16, 2, 128), *UNROLLED, *STAGED]
RECORD = [vt.RECORD_LAUNCH, vt.Launch(32, 4), vt.Launch(16, 2, 128), *UNROLLED, *STAGED]


def _desc(launch: vt.Launch) -> str:
    extra = (" unrolled" if launch.unroll else "") + ("" if launch.stages is None else f" stages {launch.stages}")
    return f"BV {launch.value_block:3d} warps {launch.num_warps:2d} maxnreg {launch.maxnreg or '-':>3}{extra}"


def _graph_us(fn: Callable[[], object], calls: int) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time(graph.replay, warmup=2, repeats=5).median_s / calls * 1e6


Row = tuple[int, str, str, float, bool]


def _sweep(rows: int, preset: str, num_draft: int, calls: int, wide: bool) -> list[Row]:
    cfg, dev = get_preset(preset), torch.device("cuda")
    c = op_case(SimpleNamespace(cfg=cfg, device=dev, generator=torch.Generator().manual_seed(rows)),
                torch.bfloat16, rows=rows, num_draft=num_draft)
    B, n, h, dk = c.g.shape
    conv_rec = torch.empty(B, n, 3, h * dk, cfg.conv_kernel_size - 1, device=dev)
    state_rec = torch.empty(B, n, h, dk, dk, device=dev)

    def fused(launch: vt.Launch) -> tuple[torch.Tensor, ...]:
        o, y = vt.fused_triton(c.xs, c.weights, c.windows, c.state, c.slots, c.keep, c.g, c.beta, c.gate,
                               c.norm_weight, c.eps, c.scale, conv_rec, state_rec, launch=launch)
        return o, y, conv_rec, state_rec

    def unfused(launch: vt.Launch) -> tuple[torch.Tensor, ...]:
        q, k, v = vt.spec_conv_triton(c.xs, c.weights, c.windows, c.slots, c.keep, conv_rec)
        o = vt.record_triton(q.view(B, n, h, dk), k.view(B, n, h, dk), v.view(B, n, h, dk), c.g, c.beta,
                             c.state, c.slots, c.scale, state_rec, launch=launch)
        return o, vt.norm_triton(o, c.gate, c.norm_weight, c.eps), conv_rec, state_rec

    out: list[Row] = []
    extra = WIDE if wide else []
    for kind, run, launches in (("fused", fused, FUSED + extra), ("unfused", unfused, RECORD + extra)):
        shipped = [bits(t).clone() for t in run(launches[0])]
        for launch in launches:
            try:
                same = all(torch.equal(bits(t), s) for t, s in zip(run(launch), shipped, strict=True))
                us = _graph_us(partial(run, launch), calls)
            except Exception as e:  # a launch the compiler refuses (shared memory, registers): say so, go on
                print(f"rows {rows} {kind} {_desc(launch)}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            out.append((rows, kind, _desc(launch), us, same))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kl-48b-8l")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--wide", action="store_true", help="also the wide value blocks (64 / 128 columns per program)")
    a = ap.parse_args()
    table = [row for rows in a.rows.split(",") for row in _sweep(int(rows), a.preset, a.num_draft, a.calls, a.wide)]
    print("\nrows  path     launch                        us/call  vs shipped unfused  bits equal to shipped")
    base = {r: us for r, kind, desc, us, _ in table if kind == "unfused" and desc == _desc(RECORD[0])}
    for rows, kind, desc, us, same in table:
        print(f"{rows:4d}  {kind:7s}  {desc}  {us:8.1f}  {base.get(rows, float('nan')) / us:17.2f}x  {same}")


if __name__ == "__main__":
    main()
