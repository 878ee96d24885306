"""CUDA-graph decode checks (CUDA only; skipped with a reason elsewhere).

- replay vs eager: the captured step replayed equals the same static step run eagerly, bit for bit,
  over many steps; control: a replay over stale static inputs.
- shrunk cache: after the latent cache is re-created with fewer pages AT THE SAME BASE ADDRESS (the
  allocator may do that; the check makes it certain by laying the new cache over the old storage) and
  the same KDA state tensors, replay still equals eager because the signature (shape + stride, not
  only data_ptr) forces a re-capture. Control: the same with the signature check turned off, which
  must replay the stale graph (asserted: no re-capture) over slice offsets of the old page count.
  A signature of data pointers alone is exactly that control, so it goes red.
"""

from __future__ import annotations

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared.builders import prompt, serving_model
from k3verify.gates.shared.replay import replay_vs_eager
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.runner import ModelRunner

PAGE = 16


def _runner(ctx: CheckContext, num_pages: int) -> ModelRunner:
    if ctx.device.type != "cuda":
        raise SkipCheck("CUDA graphs need a CUDA device")
    model = serving_model(ctx, torch.bfloat16)
    return ModelRunner(model, num_pages=num_pages, page_size=PAGE, num_slots=8, max_context=256)


def _prompts(ctx: CheckContext, salt: int = 0) -> list[list[int]]:
    return [prompt(ctx, n, salt=salt + i).tolist() for i, n in enumerate((5, 17, 33))]


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


def _shrunk_in_place(runner: ModelRunner, num_pages: int) -> ModelRunner:
    """A runner over the same model with `num_pages` pages whose latent cache begins at the old cache's
    address (a view of its storage) and that keeps the old KDA state pool: between the two, only the
    latent cache's shape and strides differ, so every MLA slice above the first moves. The whole old storage
    is zeroed first: a stale graph reading the old offsets must find nothing there (left in place, the capture
    run's latents of the same prompts equal the right ones, and the control would pass)."""
    old_kv, old_pool = runner.kv_cache.data, runner.state_pool
    old_kv.zero_()
    small = ModelRunner(runner.model, num_pages=num_pages, page_size=PAGE, num_slots=old_pool.num_slots,
                        max_context=runner.max_context)
    kv = small.kv_cache
    kv.data = old_kv.view(-1)[: kv.data.numel()].view(kv.data.shape).zero_()
    small.state_pool = small.model.state_pool = old_pool
    if kv.data.data_ptr() != old_kv.data_ptr() or kv.data.shape == old_kv.shape:
        raise RuntimeError("the shrunk cache is not at the old address with a new shape: the check would test nothing")
    return small


@register_check(id="serving.graph.shrunk_cache", component="serving", level="serving", kind=Kind.BITEXACT,
                control="capture signature checks data_ptr only (stale slice offsets replayed)",
                devices=("cuda",))
def check_graph_shrunk_cache(ctx: CheckContext) -> Trial:
    if len(ctx.cfg.full_attn_layers) < 2:
        raise SkipCheck(f"needs >= 2 MLA layers (a shrunk cache moves the slices above the first); the preset "
                        f"has {len(ctx.cfg.full_attn_layers)}")
    outs = {}
    for checked in (True, False):
        runner = _runner(ctx, 64)
        graphs = GraphDecoder(runner.model, runner.max_context, buckets=(4,))
        graphs.check_signature = checked
        replay_vs_eager(runner, graphs, _prompts(ctx), steps=2)  # captures over the 64-page cache
        small = _shrunk_in_place(runner, 24)
        del runner
        ref, cand, _ = replay_vs_eager(small, graphs, _prompts(ctx, salt=10), steps=6)  # not the capture's prompts
        outs[checked] = (ref, cand, graphs.captures)
    if outs[False][2] != 1:
        raise RuntimeError(f"the control re-captured ({outs[False][2]} captures): it must replay the stale graph")
    ref, cand, captures = outs[True]
    return Trial(reference=ref, candidate=cand, control=outs[False][1], metrics={"captures": float(captures)},
                 notes=["latent cache re-created with 24 of 64 pages at the same base address (old storage zeroed), "
                        "same state pool; other prompts than the capture run's"])
