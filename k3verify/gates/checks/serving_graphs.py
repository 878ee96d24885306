"""CUDA-graph decode checks (CUDA only; skipped with a reason elsewhere).

- replay vs eager: the captured step replayed equals the same static step run eagerly, bit for bit,
  over many steps; control: a replay over stale static inputs.
- shrunk cache: after the latent cache is re-created with fewer pages (the allocator may hand back
  the same base address), replay still equals eager because the signature (shape + stride, not only
  data_ptr) forces a re-capture; control: the same with the signature check turned off.
"""

from __future__ import annotations

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.fixtures import prompt, serving_model
from k3verify.gates.replay import replay_vs_eager
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.runner import ModelRunner

PAGE = 16


def _runner(ctx: CheckContext, num_pages: int) -> ModelRunner:
    if ctx.device.type != "cuda":
        raise SkipCheck("CUDA graphs need a CUDA device")
    model = serving_model(ctx, torch.bfloat16)
    return ModelRunner(model, num_pages=num_pages, page_size=PAGE, num_slots=8, max_context=256)


def _prompts(ctx: CheckContext) -> list[list[int]]:
    return [prompt(ctx, n, salt=i).tolist() for i, n in enumerate((5, 17, 33))]


@register_check(id="serving.graph.replay_vs_eager", component="serving", level="serving", kind=Kind.BITEXACT,
                control="the graph replayed over the previous step's static inputs", devices=("cuda",))
def check_graph_replay(ctx: CheckContext) -> Trial:
    runner = _runner(ctx, 64)
    graphs = GraphDecoder(runner.model, runner.max_context, buckets=(4,))
    ref, cand, ctrl = replay_vs_eager(runner, graphs, _prompts(ctx), steps=24)
    if ctrl is None:
        raise RuntimeError("no stale-input control was recorded: the graph was never captured")
    return Trial(reference=ref[1:], candidate=cand[1:], control=ctrl,
                 metrics={"captures": float(graphs.captures)}, notes=["24 steps, 3 sequences in a bucket of 4"])


@register_check(id="serving.graph.shrunk_cache", component="serving", level="serving", kind=Kind.BITEXACT,
                control="capture signature checks data_ptr only (stale slice offsets replayed)",
                devices=("cuda",))
def check_graph_shrunk_cache(ctx: CheckContext) -> Trial:
    outs = {}
    for checked in (True, False):
        runner = _runner(ctx, 64)
        graphs = GraphDecoder(runner.model, runner.max_context, buckets=(4,))
        graphs.check_signature = checked
        replay_vs_eager(runner, graphs, _prompts(ctx), steps=2)  # captures over the 64-page cache
        small = ModelRunner(runner.model, num_pages=24, page_size=PAGE, num_slots=8, max_context=256)
        del runner
        ref, cand, _ = replay_vs_eager(small, graphs, _prompts(ctx), steps=6)
        outs[checked] = (ref, cand)
    ref, cand = outs[True]
    return Trial(reference=ref, candidate=cand, control=outs[False][1],
                 notes=["cache re-created with 24 of 64 pages after capture"])
