"""Where does a speculative round's time go at batch 1? (diagnostic, CUDA)

The speculative bench's batch-1 rows moved 1.33x-1.71x between lent H200s with the same GPU work per round (18
score steps against 17), while host-only phases of the same bench took 1.3-1.7x longer on the slower machines
(2026-12-02). Every round ends in a host sync (the accepted tokens decide the next drafts), so its host work runs
with the GPU idle. This script runs the offline loop's pieces for `--rounds` rounds of one sequence and times each
on the host (perf_counter), with the score's device time (CUDA events) beside them:

  propose   the controlled drafter (its reference: this model's own plain greedy continuation)
  score    staging + the score graph's replay (launch only: host time)
  commit    greedy acceptance on the device and the accepted prefix's commit behind it (launches)
  readback  the argmax ids and counts, .tolist(): waits for the score and commit (the GPU's time, not host work)
  accept    the host's greedy rule, held to the device's counts, and the runner's bookkeeping

and prints the medians per round: host work between two scores is the GPU's idle time at batch 1. On CUDA it also
splits the score: `to replay` (host time from the score call to the graph's launch: checks, signature, input
fill), the replay call itself, the graph's device time (an event right before the launch to one right after), and
the gap (host time from one round's readback to the next round's launch, the accept of one round plus the propose and
`to replay` of the next: the GPU idles through all of it). Inside `to replay`, the capture signature's check and the
inputs' fill are timed on their own.

--profile then runs the offline loop itself (offline.generate_speculative with score and decode graphs, as the bench
runs it) on the converged reference: its decode phase's wall time per score round beside the score's device time,
and a cProfile of the same run (top functions by own host time), to say which host work the round pays for.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from k3verify.bench.speeds import DeviceMarks, generate_ours
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner
from k3verify.serving.spec.accept import accept_read_back
from k3verify.serving.spec.drafter import ControlledDrafter
from k3verify.serving.spec.offline import generate_speculative, pad_drafts
from k3verify.serving.spec.score_graphs import ScoreGraphs, ScoreInputs
from k3verify.serving.spec.scorer import SpecScorer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kl-48b-8l")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--accept", type=float, default=0.8, help="the controlled drafter's nominal acceptance")
    ap.add_argument("--fused", action="store_true", help="the one-launch KDA score")
    ap.add_argument("--converge", type=int, default=6, help="untimed runs to make the reference the path's own")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (no graphs)")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="then the offline loop itself, timed and under cProfile: its TOP functions by own time")
    a = ap.parse_args()
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = get_preset(a.preset)
    model = ServingModel(cfg, dtype, dev).load(synthetic_tensors(cfg, 0, device=dev))
    k, new = a.num_draft, a.rounds * (a.num_draft + 1) + 8
    ctx = a.prompt_len + new + 2 * k + 64
    runner = ModelRunner(model, num_pages=2 * (-(-ctx // 64)) + 8, page_size=64, num_slots=2, max_context=ctx)
    scorer = SpecScorer(runner, k, 1, fused=a.fused)
    graphs = scorer.make_graphs(ctx, (1,)) if dev.type == "cuda" else None
    prompt = torch.randint(0, cfg.vocab_size, (1, a.prompt_len), generator=torch.Generator().manual_seed(0))
    host: dict[str, list[float]] = defaultdict(list)
    replays: list[tuple[float, float, object]] = []  # (host time before, after the launch, event before it)
    if dev.type == "cuda":
        plain_replay = torch.cuda.CUDAGraph.replay

        def marked_replay(graph: torch.cuda.CUDAGraph) -> None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            t = time.perf_counter()
            plain_replay(graph)
            replays.append((t, time.perf_counter(), event))

        torch.cuda.CUDAGraph.replay = marked_replay  # type: ignore[method-assign, assignment]
    inner: dict[str, float] = {}  # host ms of the score's own pieces in the current round

    def timed_piece(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            inner[name] = inner.get(name, 0.0) + 1e3 * (time.perf_counter() - t)
            return out
        return wrapper

    ScoreGraphs._signature = timed_piece("  signature", ScoreGraphs._signature)  # type: ignore[method-assign]
    ScoreInputs.fill = timed_piece("  fill", ScoreInputs.fill)  # type: ignore[method-assign]
    gpu_ms: list[float] = []
    rounds_ms: list[float] = []
    accepted: list[int] = []

    def one_run(reference: list[int], sid: int, timed: bool) -> list[int]:
        """a.rounds speculative rounds of one sequence drafting from `reference`; the tokens it produced."""
        drafter = ControlledDrafter(k, {0: reference}, 1.0 - a.accept, cfg.vocab_size, 0)
        runner.admit(sid, a.prompt_len + new + k)
        tokens = runner.prefill([(sid, prompt[0].tolist())]).argmax(-1).tolist()
        for _ in range(a.rounds):
            inner.clear()
            t0 = time.perf_counter()
            drafts = pad_drafts(drafter.propose(0, prompt[0].tolist() + tokens) or [tokens[-1]], k)
            t1 = time.perf_counter()
            marks = DeviceMarks(dev)
            marks.mark()
            logits = scorer.score([(sid, [tokens[-1], *drafts])], graphs)
            marks.mark()
            t2 = time.perf_counter()
            out = scorer.commit_greedy(logits, [drafts])
            t3 = time.perf_counter()
            row = out.tolist()[0]
            t4 = time.perf_counter()
            result = accept_read_back([row], [drafts])[0]
            scorer.committed([row[-1]])
            t5 = time.perf_counter()
            tokens += result.tokens
            if timed:
                gpu_ms.append(1e3 * marks.seconds(0, 1))
                for name, dt in (("propose", t1 - t0), ("verify", t2 - t1), ("commit", t3 - t2),
                                 ("readback", t4 - t3), ("accept", t5 - t4)):
                    host[name].append(1e3 * dt)
                if replays:
                    before, after, event = replays[-1]
                    host["to replay"].append(1e3 * (before - t1))
                    host["replay call"].append(1e3 * (after - before))
                    host["gap"].append(1e3 * (before - t0 + t5 - t4))  # propose .. launch, + accept
                    marks.points[0] = event  # the graph's own device time: from its launch
                    host["graph (device)"].append(1e3 * marks.seconds(0, 1))
                for name, ms in inner.items():  # inside `to replay` (on CPU: inside score)
                    host[name].append(ms)
                rounds_ms.append(1e3 * (t5 - t0))
                accepted.append(result.num_accepted)
        runner.release(sid)
        return tokens

    # The drafter's reference becomes the speculative path's own continuation before the timed run, as in the
    # bench (bench/spec_ref.converge_reference): in bf16 a score pass and plain decode flip near-tied argmaxes, so
    # plain greedy's continuation stops matching after the first flip and every later draft reads as rejected.
    reference = prompt[0].tolist() + generate_ours(runner, None, prompt.to(dev), new).tolist()[0]
    converged_after = None
    for attempt in range(a.converge):  # untimed; the first also warms up (captures, compiles)
        out = one_run(reference, 10 + attempt, timed=False)
        if len(out) <= len(reference) - a.prompt_len and out == reference[a.prompt_len:a.prompt_len + len(out)]:
            converged_after = attempt + 1  # the run followed its reference all the way
            break
        reference = prompt[0].tolist() + out
    one_run(reference, 10 + a.converge, timed=True)
    med = {name: statistics.median(v) for name, v in host.items()}
    work = sum(v for name, v in med.items() if name in ("propose", "verify", "commit", "accept"))
    print(f"{a.preset} batch 1, k={k}, nominal acceptance {a.accept:.0%}, {a.rounds} rounds "
          f"(mean accepted {statistics.mean(accepted):.2f}), KDA score {'fused' if a.fused else 'unfused'}, reference "
          + (f"converged after {converged_after} untimed runs" if converged_after else
             f"NOT converged in {a.converge} untimed runs: acceptance below nominal"))
    print(f"{'piece':10s} {'host ms (median)':>17s}")
    for name, v in med.items():
        print(f"{name:10s} {v:17.3f}")
    print(f"round {statistics.median(rounds_ms):.3f} ms; score on the device {statistics.median(gpu_ms):.3f} ms; "
          f"host work outside the readback wait {work:.3f} ms a round (the GPU's idle time at batch 1)")
    if a.profile:
        profile_loop(a, runner, scorer, graphs, reference, prompt[0].tolist(), new, ctx, statistics.median(gpu_ms))


def profile_loop(a: argparse.Namespace, runner: ModelRunner, scorer: SpecScorer, graphs: object,
                 reference: list[int], prompt: list[int], new: int, ctx: int, score_gpu_ms: float) -> None:
    """The bench's loop (offline.generate_speculative, no cost policy: every round scores): wall per round of its
    decode phase, then the same run under cProfile."""
    k, dev = a.num_draft, runner.device
    dgraphs = GraphDecoder(runner.model, ctx, buckets=(1,), use_graphs=dev.type == "cuda")

    def run() -> tuple[float, int]:
        drafter = ControlledDrafter(k, {0: reference}, 1.0 - a.accept, runner.model.cfg.vocab_size, 0)
        marks = DeviceMarks(dev)
        out = generate_speculative(scorer, drafter, [prompt], new, score_graphs=graphs,  # type: ignore[arg-type]
                                   decode_graphs=dgraphs, after_prefill=marks.mark)
        marks.mark()
        return marks.seconds(0, 1), out.score_steps + out.decode_steps

    run()  # warm-up: the decode graph's capture
    walls = [run() for _ in range(5)]
    wall, steps = statistics.median(w for w, _ in walls), walls[0][1]
    print(f"offline loop: decode phase {1e3 * wall:.2f} ms over {steps} steps = {1e3 * wall / steps:.3f} ms a step; "
          f"score on the device {score_gpu_ms:.3f} ms: {1e3 * wall / steps - score_gpu_ms:.3f} ms a step more")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        run()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.profile)
    print(f"cProfile of 3 runs ({3 * steps} steps): by own time")
    print("\n".join(line for line in s.getvalue().splitlines()[4:] if line.strip()))


if __name__ == "__main__":
    main()
