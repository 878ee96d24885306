"""Launch configurations of fla's KDA decode recurrence (fused_recurrent_kda_fwd_kernel), timed (CUDA).

At batch 64 the bench's six KDA layers spend 0.585 ms a step in this kernel against ~0.37 ms of state traffic
(each row reads and writes its [heads, dk, dv] fp32 state once; 2026-12-04). fla launches it with a fixed value
block of 32 and 4 warps. This script launches the same kernel (the slot-indexed, in-place form the serving model
uses, through kernels/kda/fla_launch._recurrent) with other value blocks, warp counts and pipeline stages, on one
KDA layer of `--preset` at each batch, checks the output and the written state against fla's launch configuration
(bits, or the largest difference when they differ), and prints the median microseconds per call (`--calls`
back-to-back calls in one CUDA graph) with the
state traffic's bandwidth. The first configuration is fla's.

    python -m lab.gpu.kda_decode_tune [--preset kl-48b-8l] [--batch 1,16,64]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from k3verify.bench.timing import cuda_time
from k3verify.kernels.kda import fla_launch
from k3verify.presets import get_preset

CONFIGS = [(32, 4, 2), (32, 2, 2), (32, 2, 1), (32, 2, 3), (32, 1, 2), (64, 2, 2), (64, 4, 2), (16, 1, 2),
           (16, 2, 2)]  # (value block, warps, stages); fla's first


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, scale: float,
           bv: int, warps: int, stages: int) -> torch.Tensor:
    """The serving decode's direct launch (kernels/kda/fla_launch._recurrent, as kda_decode_slots_gated_fla calls
    it: the forget gate and beta's sigmoid inside the kernel, state read and written in place by slot) with
    another launch configuration -> o."""
    return fla_launch._recurrent(fla_launch.DECODE_SLOTS_GATED, q, k, v, g, beta, state, slots, scale,
                                 gate_in_kernel=True, beta_sigmoid_in_kernel=True, a_log=a_log, dt_bias=dt_bias,
                                 launch=(bv, warps, stages))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kl-48b-8l")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    cfg, dev = get_preset(a.preset), torch.device("cuda")
    H, dk = cfg.kda_num_heads, cfg.kda_head_dim
    copy = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    gbps = 2 * copy.numel() / cuda_time(lambda: copy.clone(), warmup=2, repeats=5).median_s / 1e9
    print(f"{a.preset}: {H} heads x dk {dk}; copy bandwidth {gbps:,.0f} GB/s")
    print(f"{'batch':>5s} {'BV':>4s} {'warps':>5s} {'stages':>6s} {'us':>8s} {'GB/s':>7s} {'% copy':>6s}  vs fla")
    for B in (int(b) for b in a.batch.split(",")):
        _sweep(B, H, dk, a.calls, gbps, dev)


def _sweep(B: int, H: int, dk: int, calls: int, gbps: float, dev: torch.device) -> None:
    gen = torch.Generator(device=dev).manual_seed(B)

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    q, k, v = r(B, 1, H, dk), r(B, 1, H, dk), r(B, 1, H, dk)
    g = torch.randn(B, 1, H, dk, generator=gen, device=dev)  # the gate's raw input
    beta = torch.randn(B, 1, H, generator=gen, device=dev)  # beta's logits
    a_log = torch.randn(H, generator=gen, device=dev)
    dt_bias = torch.randn(H * dk, generator=gen, device=dev)
    state0 = r(B + 1, H, dk, dk, dtype=torch.float32) * 0.1
    slots = torch.arange(1, B + 1, device=dev)  # slot 0 unused, as the pool's scratch slot
    ref: tuple[torch.Tensor, torch.Tensor] | None = None
    for bv, warps, stages in CONFIGS:
        state = state0.clone()
        call = partial(launch, q, k, v, g, beta, a_log, dt_bias, state, slots, dk ** -0.5, bv, warps, stages)
        out = call()
        if ref is None:
            ref, same = (state.clone(), out.clone()), "(fla)"  # the timed replays below update `state` in place
        else:
            d = max((state - ref[0]).abs().max().item(), (out.float() - ref[1].float()).abs().max().item())
            same = "bits" if torch.equal(state, ref[0]) and torch.equal(out, ref[1]) else f"max diff {d:.2e}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                call()
        us = cuda_time(graph.replay, warmup=2, repeats=5).median_s / calls * 1e6
        traffic = 2 * B * H * dk * dk * 4
        print(f"{B:5d} {bv:4d} {warps:5d} {stages:6d} {us:8.1f} {traffic / us / 1e3:7.0f} "
              f"{100 * traffic / us / 1e3 / gbps:5.0f}%  {same}")


if __name__ == "__main__":
    main()
