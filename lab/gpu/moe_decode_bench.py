"""The routed-expert combine of one kl-48b-shaped MoE layer on CUDA: the decode kernels (each tile choice; a
trailing "c": the compact grid) against the grouped GEMMs (sort, gather, torch._grouped_mm x2, un-sort), per step
size; microseconds per layer and the touched experts' bytes over that time. A measuring tool for choosing
decode_launch.pick_tiles, not a gate (the combine's parity is kernel.moe.decode_vs_torch).

Routing: top-k of randn(T, E) + skew * bias(E), one bias per run. skew 0 spreads pairs evenly (64 tokens touch
~224 of 256 experts); the bench's random-weight kl-48b-8l router is skewed: it touched 55 and 91 distinct
experts per layer at 16 and 64 tokens (bench.json distinct_experts_per_layer, 2026-12-03), which skew 1 gives
(54 and 98, the busiest expert 10 and 39 pairs). A "c" is the compact grid, "f" the grid with an expert's column
blocks launched back to back (Tiles.cols_first); `bits` says whether that grid wrote the other's bits; "expert
list alone" times the compact grid's one-program prep (decode_launch.active_experts) by itself: at 64 tokens the
compact grid lost ~250 us a layer (2026-12-04), and whether that is its prep is what this column says.

    python -m lab.gpu.moe_decode_bench [--experts 256 --hidden 2304 --inter 1024 --top-k 8 --tokens 1,2,4,5,16,64
                                        --skew 0,1]
"""

from __future__ import annotations

import argparse

import torch

from k3verify.kernels.moe import decode_launch, grouped
from k3verify.serving.layers.mlp import silu_glu


def _time_us(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()  # replayed: launch overhead as in the served decode step
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2304)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="1,2,4,5,16,64")
    ap.add_argument("--skew", default="0,1", help="router skew values, one table each")
    args = ap.parse_args()
    E, D, I, k = args.experts, args.hidden, args.inter, args.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * D**-0.5).bfloat16()
    w2 = (torch.randn(E, D, I, device="cuda", generator=g) * I**-0.5).bfloat16()
    spec = decode_launch.GluSpec("silu")
    tiles = [decode_launch.Tiles(bn, 4, st) for bn in (16, 32, 64) for st in (3, 4)]
    tiles += [decode_launch.Tiles(bn, 4, 4, compact=True) for bn in (32, 64)]
    tiles += [decode_launch.Tiles(bn, 4, st, cols_first=True) for bn in (32, 64, 128) for st in (3, 4)]
    tiles += [decode_launch.Tiles(64, 4, 4, compact=True, cols_first=True)]
    names = [f"bn{t.block_n}/s{t.num_stages}" + ("c" if t.compact else "") + ("f" if t.cols_first else "")
             for t in tiles]
    for skew in (float(v) for v in args.skew.split(",")):
        print(f"E={E} D={D} I={I} k={k} skew={skew}; us per layer (CUDA graph replay); GB/s of the touched experts' "
              "bytes")
        print(f"{'tokens':>6} {'experts':>7} {'busiest':>7} {'grouped':>9} {'decode(pick)':>13} " +
              " ".join(f"{n:>9}" for n in names) + "  best GB/s")
        bias = torch.randn(E, device="cuda", generator=g) * skew
        for T in (int(t) for t in args.tokens.split(",")):
            _row(T, E, D, k, w13, w2, spec, tiles, g, bias)


def _row(T: int, E: int, D: int, k: int, w13: torch.Tensor, w2: torch.Tensor, spec: decode_launch.GluSpec,
         tiles: list[decode_launch.Tiles], g: torch.Generator, bias: torch.Tensor) -> None:
    I = w2.shape[-1]
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    weights, idx = (torch.randn(T, E, device="cuda", generator=g) + bias).sigmoid().topk(k, dim=1)
    weights = weights.float()
    touched = int(idx.unique().numel())
    busiest = int(torch.bincount(idx.flatten()).max())
    nbytes = touched * 3 * I * D * 2
    ref = grouped.moe_grouped_combine(x, w13, w2, weights, idx, silu_glu)
    got = decode_launch.combine(x, w13, w2, weights, idx, spec)
    rel = float((got - ref).norm() / ref.norm())
    one = decode_launch.combine(x, w13, w2, weights, idx, spec, tiles=decode_launch.Tiles(64, 4, 4))
    bits = torch.equal(one, decode_launch.combine(x, w13, w2, weights, idx, spec,
                                                tiles=decode_launch.Tiles(64, 4, 4, cols_first=True)))
    t_grouped = _time_us(lambda: grouped.moe_grouped_combine(x, w13, w2, weights, idx, silu_glu))
    t_pick = _time_us(lambda: decode_launch.combine(x, w13, w2, weights, idx, spec))
    per_tile = [_time_us(lambda t=t: decode_launch.combine(x, w13, w2, weights, idx, spec, tiles=t))
                for t in tiles]
    flat = idx.reshape(-1)
    t_list = _time_us(lambda: decode_launch.active_experts(flat, E))  # the compact grid's one-program prep alone
    best = min([t_pick, *per_tile])
    print(f"{T:>6} {touched:>7} {busiest:>7} {t_grouped:>9.1f} {t_pick:>13.1f} " +
          " ".join(f"{t:>9.1f}" for t in per_tile) +
          f"  {nbytes / best / 1e3:>6.0f} (grouped {nbytes / t_grouped / 1e3:.0f}); rel vs grouped {rel:.1e}; "
          f"bits {bits}; expert list alone {t_list:.1f} us")


if __name__ == "__main__":
    main()
