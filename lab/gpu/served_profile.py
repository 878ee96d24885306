"""Where does the served engine's host time go under streaming clients? (diagnostic, CUDA; `--device cpu` smoke)

The served bench (H200, 2026-12-02, API server in its own process) measured decode-only engine steps at the bench
path's step time, but steps carrying prompt chunks at 65 ms (c16, ~768 prompt tokens) and 137 ms (c64, ~2.7k)
from launch to launch, where lab/gpu/engine_step_diag.py had timed a mixed step of 4k prompt tokens beside 64
running rows at 40 ms in process. This script builds the bench's runner and engine graphs for one concurrency,
serves them as `bench --served` does, runs one untimed and `--waves` timed waves of free-running streaming clients,
and prints the engine step breakdown, the arrival bursts, the host CPU facts, then where the engine thread's wall
time went by sampling its stack every millisecond (lab/stack_sampler.py; cProfile on Python 3.12 mixed every
thread of the process into one another's frames). `--probe calls` instead lists the engine thread's C calls that
held it over 2 ms, by call site (lab/host_syncs.LongCalls: a wait for the GPU inside a launch shows there, named);
`--probe spin` does the same with a GPU spin kernel queued ahead, so that every call that waits for the GPU shows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from k3verify.bench import served as sv
from k3verify.bench.timing import random_prompt
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.engine import ADMIT_MAX_HOLD_S, ADMIT_QUIET_S
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner
from lab.host_syncs import LongCalls
from lab.stack_sampler import StackSampler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kl-48b-8l")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2, help="requests per client in the profiled part")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--admit-quiet-ms", type=float, default=1e3 * ADMIT_QUIET_S)
    ap.add_argument("--admit-max-hold-ms", type=float, default=1e3 * ADMIT_MAX_HOLD_S)
    ap.add_argument("--probe", choices=("sampler", "calls", "spin"), default="sampler")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cfg = get_preset(a.preset)
    model = ServingModel(cfg, torch.bfloat16, dev).load(synthetic_tensors(cfg, 0, device=dev))
    c, ctx, page = a.concurrency, a.prompt_len + a.new_tokens + 8, 64
    runner = ModelRunner(model, num_pages=c * (-(-ctx // page)) + 8, page_size=page, num_slots=c + 1, max_context=ctx)
    graphs = sv.engine_graphs(runner, GraphDecoder(model, ctx, buckets=(c,), use_graphs=dev.type == "cuda"), (c,))
    with sv.served_stack(runner, graphs, c, max(sv.MIN_STEP_TOKENS, c * a.prompt_len),
                         admit_quiet_s=a.admit_quiet_ms / 1e3, admit_max_hold_s=a.admit_max_hold_ms / 1e3) as stack:
        waves = [random_prompt(c, a.prompt_len, cfg.vocab_size, 10_000, dev).tolist()]
        sv._timed_waves(stack, waves, a.new_tokens)  # untimed: first compiles of this shape mix
        waves = [random_prompt(c, a.prompt_len, cfg.vocab_size, r, dev).tolist() for r in range(a.waves)]
        assert stack.engine._thread.ident is not None
        if a.probe == "sampler":
            with StackSampler(stack.engine._thread.ident, idle=("_handle_commands",)) as sampler:
                row = sv._timed_waves(stack, waves, a.new_tokens)
            found = f"----- engine thread, sampled (lab/stack_sampler.py)\n{sampler.table(a.top)}"
        else:
            calls = LongCalls(spin_s=0.02 if a.probe == "spin" else 0.0)
            stack.engine.call(lambda: (sys.setprofile(calls.hook), calls.arm()))
            try:
                row = sv._timed_waves(stack, waves, a.new_tokens)
            finally:
                stack.engine.call(lambda: sys.setprofile(None))
            found = f"----- engine thread, C calls that held it (lab/host_syncs.LongCalls)\n{calls.table(a.top)}"
    print(f"===== {a.preset} served at concurrency {c}: {row['tok_s']:,.0f} tok/s, ITL p50 {row['itl_p50_ms']:.2f} ms, "
          f"TTFT p50 {row['ttft_p50_ms']:.1f} ms")
    print("steps:", row["steps"])
    print("arrivals:", row["arrivals"], "admission holds:", row["admission_holds"])
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"host CPU: {row['cpus_usable']} usable, cgroup quota {row['cgroup_quota_cpus']} CPUs, throttled "
          f"{row['cpu_throttled_ms']} ms during the timed waves; load average {load}")
    print(found)


if __name__ == "__main__":
    main()
