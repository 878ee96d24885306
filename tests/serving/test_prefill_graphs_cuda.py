"""CUDA-graph prefill on a GPU (marked gpu; skipped on CPU): a bucket captured on its second sighting replays the
static step bit for bit over other prompts and lengths, a replay over stale buffers does not, a re-created cache
forces a re-capture, and the fla / SDPA fast paths (not the torch references) ran inside the capture."""

from __future__ import annotations

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.kernels.attn import CAUSAL_STATIC
from k3verify.kernels.kda import PREFILL_STATIC
from k3verify.kernels.registry import CUDA, REGISTRY, TRITON
from k3verify.presets import get_preset
from k3verify.serving.prefill_graphs import GraphPrefill
from k3verify.serving.runner import ModelRunner, build_runner

pytestmark = pytest.mark.gpu


def _runner(preset: str) -> ModelRunner:
    cfg = get_preset(preset)
    return build_runner(cfg, synthetic_tensors(cfg, device="cuda"), dtype=torch.bfloat16, device="cuda",
                        num_pages=128, page_size=16, num_slots=8, max_context=512)


def _run(runner: ModelRunner, prompts: list[list[int]], graphs: GraphPrefill) -> torch.Tensor:
    first = max(runner.active_ids, default=-1) + 1
    ids = list(range(first, first + len(prompts)))
    for sid, p in zip(ids, prompts, strict=True):
        runner.admit(sid, len(p) + 1)
    try:
        return runner.prefill(list(zip(ids, prompts, strict=True)), graphs)
    finally:
        for sid in ids:
            runner.release(sid)


@pytest.mark.parametrize("preset", ["kl-tiny", "k3-tiny"])
def test_replay_equals_static_step_and_stale_replay_differs(preset: str) -> None:
    runner = _runner(preset)
    graphs = GraphPrefill(runner.model, max_tokens=512, max_seqs=16)
    static = GraphPrefill(runner.model, max_tokens=512, max_seqs=16, use_graphs=False)
    g = torch.Generator().manual_seed(0)
    vocab = runner.model.cfg.vocab_size
    packs = [[torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
             for lens in ((30, 50, 20), (50, 40), (60, 30), (10, 40, 33))]  # all in bucket (128, 4, 64)
    assert len({graphs.shape_for([len(p) for p in prompts]) for prompts in packs}) == 1
    _run(runner, packs[0], graphs)  # first sighting: eager
    assert graphs.captures == 0 and graphs.replays == 0
    for prompts in packs:
        cand = _run(runner, prompts, graphs)
        ref = _run(runner, prompts, static)
        assert torch.equal(cand, ref), prompts
    assert graphs.captures == 1 and graphs.replays == len(packs) and not graphs.eager_shapes
    # the fast paths, not the torch references, ran the static step (the capture runs the same dispatch)
    assert REGISTRY.last_backend.get(PREFILL_STATIC) == TRITON and REGISTRY.last_backend.get(CAUSAL_STATIC) == CUDA
    stale = graphs.replay_stale([len(p) for p in packs[0]])  # the buffers hold the last pack
    assert stale is not None and not torch.equal(stale, _run(runner, packs[0], static))


def test_recreated_caches_force_a_recapture() -> None:
    runner = _runner("kl-tiny")
    graphs = GraphPrefill(runner.model, max_tokens=512, max_seqs=16, capture_after=1)
    prompts = [list(range(3, 70)), list(range(9, 40))]
    first = _run(runner, prompts, graphs)
    runner.reset_caches()
    again = _run(runner, prompts, graphs)
    assert graphs.captures == 2 and torch.equal(first, again)
