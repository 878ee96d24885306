"""Where does a served engine step spend its time? (diagnostic, CUDA)

The served bench (2026-12-02, kl-48b-8l on one H200) showed engine steps with prefill taking 70-88 ms from launch to
launch for 1.2k-4k prompt tokens, where `lab/gpu/prefill_diag.py` had measured the bare model prefill of 64 x 128
tokens at 55 ms; and decode-only steps at 64 rows taking 8.2 ms where the bench path's graph step takes 4.6 ms.
This script times the pieces of such steps in process, each alone and synchronised (median of `--reps`):

  model.prefill        the packed prefill without caches (what the bench's prefill rows time)
  runner.prefill       the same prompts through the runner: admitted slots, paged MLA latents, KDA states
  launch+collect       a whole StepLauncher step (prefill chunks + sampling + readback), as the engine runs it
  mixed step           prefill chunks of new sequences beside graph decode of running ones, one step
  decode graph         decode_next of the running rows through the captured graph

and for each: the host syncs (torch.cuda.set_sync_debug_mode, our frames), the MoE combine paths taken, and the
top functions by own host time (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.kernels.moe import grouped
from k3verify.presets import get_preset
from k3verify.serving.batch import PackedBatch
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.model import ServingModel
from k3verify.serving.request import Request
from k3verify.serving.runner import ModelRunner
from k3verify.serving.sampler import SamplingParams
from k3verify.serving.scheduler import PrefillChunk, StepPlan
from k3verify.serving.step_loop import StepLauncher
from lab.host_syncs import sync_sites


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], setup: Callable[[], Any], reps: int) -> float:
    """Median ms of `reps` single synchronised calls, each after its setup."""
    single = []
    for _ in range(reps):
        setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        single.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(single)


def top(fn: Callable[[], Any], setup: Callable[[], Any], n: int) -> str:
    setup()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    sync()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    return "\n".join(lines[3:3 + n + 3])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kl-48b-8l")
    ap.add_argument("--prompts", type=int, default=32, help="new sequences prefilled in one step")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--running", type=int, default=32, help="running rows decoded beside them (mixed step)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (no graphs, no syncs)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cfg = get_preset(a.preset)
    model = ServingModel(cfg, torch.bfloat16, dev).load(synthetic_tensors(cfg, 0, device=dev))
    ctx, page = 512, 64
    slots = a.prompts + a.running + 1
    runner = ModelRunner(model, num_pages=slots * (ctx // page) + 8, page_size=page, num_slots=slots, max_context=ctx)
    graphs = GraphDecoder(model, ctx, buckets=(max(a.running, 1),), use_graphs=dev.type == "cuda")
    launcher = StepLauncher(runner, graphs)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (a.prompt_len,), generator=gen).tolist() for _ in range(a.prompts)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    def request(sid: int, prompt: list[int]) -> Request:
        return Request(seq_id=sid, prompt_ids=prompt, max_new_tokens=64, params=params, stop_ids=frozenset(),
                       seed=sid, decoder=None, sink=lambda e: None, arrival=0.0)

    # running rows: admitted, prefilled once, then decoded from their stored next token
    running = list(range(1000, 1000 + a.running))
    for sid in running:
        runner.admit(sid, ctx)
    if running:
        first = runner.prefill([(sid, prompts[i % len(prompts)]) for i, sid in enumerate(running)])
        runner.set_next_tokens(running, first.argmax(-1))
        for b in graphs.buckets if graphs.use_graphs else ():
            graphs.ensure_captured(b)
    new_ids = list(range(a.prompts))
    reqs = {sid: request(sid, p) for sid, p in zip(new_ids, prompts, strict=True)}
    reqs |= {sid: request(sid, prompts[0]) for sid in running}
    flat = torch.tensor([t for p in prompts for t in p], device=dev)
    pack = PackedBatch.build(flat, [a.prompt_len] * a.prompts, device=dev)

    def fresh() -> None:
        for sid in new_ids:
            if sid in runner.active_ids:
                runner.release(sid)
            runner.admit(sid, a.prompt_len + 64)
        for sid in new_ids:
            reqs[sid].num_prefilled, reqs[sid].num_launched, reqs[sid].output_ids = 0, 0, []

    def rewind() -> None:  # the running rows decode at the same positions every rep
        for sid in running:
            runner._get(sid).cached = a.prompt_len

    def chunks() -> list[PrefillChunk]:
        return [PrefillChunk(reqs[sid], 0, a.prompt_len) for sid in new_ids]

    cases: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        ("model.prefill (no caches)", lambda: model.prefill(pack), lambda: None),
        ("runner.prefill", lambda: runner.prefill([(sid, prompts[i]) for i, sid in enumerate(new_ids)]), fresh),
        ("launch+collect (prefill only)",
         lambda: launcher.collect(launcher.launch(StepPlan(prefill=chunks()), reqs)), fresh),
    ]
    if running:
        cases += [
            ("decode graph (running rows)", lambda: runner.decode_next(running, graphs), rewind),
            ("launch+collect (decode only)",
             lambda: launcher.collect(launcher.launch(StepPlan(decode=[reqs[s] for s in running]), reqs)), rewind),
            ("launch+collect (mixed)",
             lambda: launcher.collect(launcher.launch(StepPlan(decode=[reqs[s] for s in running],
                                                               prefill=chunks()), reqs)),
             lambda: (fresh(), rewind())),
        ]
    rows = []
    for name, fn, setup in cases:
        for _ in range(2):
            setup()
            fn()
        sync()
        ms = timed(fn, setup, a.reps)
        setup()
        grouped.PATHS.clear()
        sites = sync_sites(fn)
        paths = dict(grouped.PATHS)
        print(f"===== {name}: {ms:.2f} ms; syncs {dict(sites) or 'none'}; MoE paths {paths}")
        print(top(fn, setup, a.top))
        rows.append((name, ms, sum(sites.values()), paths))
    print(f"\n{a.preset}: {a.prompts} prompts x {a.prompt_len} tokens, {a.running} running rows")
    print(f"{'case':32s} {'ms':>8s} {'syncs':>6s}  MoE paths")
    for name, ms, n, paths in rows:
        print(f"{name:32s} {ms:8.2f} {n:6d}  {paths}")


if __name__ == "__main__":
    main()
